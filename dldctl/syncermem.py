"""Will each syncer shard fit in its host's memory? The estimate and the host's answer (pure).

A shard owning n of the model's parameters, with M learners pushing, holds (the capacity plan,
bench/capacity_model.py; measured in BENCHMARKS.md, "Capacity plan" and "Syncer memory"):

    floor = base + n * VECTORS_B                the three fp32 vectors alone: what it certainly needs
    full  = base + n * (state + push * M)       every fragment's round holding every learner's push
    peak  = full + n * CHECKPOINT_B             while a checkpoint is written (copy on write)

VECTORS_B: the three fp32 vectors every round updates (parameters, Nesterov momentum,
error-feedback residual); state: those and what the process keeps around them, 13.7 bytes per
parameter measured; push: one
pending push per parameter as the syncer holds it (decompressed, int4 codes still packed: half a
byte plus one fp32 scale per block); base: the empty syncer process. Rounds are called in turn,
so `full` is an upper bound: the 774M search with 16 learners held 12.4-13.7 GB (floor 9.5,
full 17.4) and peaked at 15.1. A host whose free memory is below its shards' floor cannot run
them (`up` refuses); one below `full` or `peak` may, and is warned about.

A host's memory is what its kernel says a new process can have: /proc/meminfo's MemAvailable,
or less where the process's cgroup (v1 or v2) has a limit (a container, a Slurm job, systemd).
The shell (dldctl/lifecycle/memcheck.py) reads those files on each syncer host; here they are
parsed. Shards on one host add up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

VECTORS_B = 12.0  # parameters, momentum, residual: fp32 each
STATE_B = 13.7  # bytes per parameter a shard holds with little pending (syncer_memory.json)
CHECKPOINT_B = 12.0  # more per parameter while a checkpoint is written
BASE_B = 0.25e9  # the empty syncer process (torch, zmq, the kernel)
CODE_B = {"int4": 0.5, "int8": 1.0, "bf16": 2.0, "none": 4.0}  # a pending push's codes per parameter
UNLIMITED = 1 << 60  # cgroup v1's "no limit" is 2^63 rounded down to a page; anything above this is none


@dataclass(frozen=True)
class Need:
    """What one host's syncer shards need, in bytes."""

    host: str
    shards: tuple[int, ...]
    params: int  # the parameters those shards own
    floor: float
    full: float
    peak: float


def push_bytes(compression: str, block: int) -> float:
    """One pending push per parameter: its codes plus, quantized, one fp32 scale per block."""
    return CODE_B[compression] + (4.0 / block if compression in ("int4", "int8") else 0.0)


def shard_need(params: int, learners: int, push_b: float) -> tuple[float, float, float]:
    """(floor, full, peak) bytes of one shard owning `params` parameters with `learners` pushing."""
    floor = BASE_B + params * VECTORS_B
    full = BASE_B + params * (STATE_B + push_b * learners)
    return floor, full, full + params * CHECKPOINT_B


def by_host(hosts: Sequence[str], owned: Sequence[int], learners: int, push_b: float) -> list[Need]:
    """Each host's shards (`hosts[s]` runs shard s, which owns `owned[s]` parameters), summed."""
    order: dict[str, list[int]] = {}
    for shard, host in enumerate(hosts):
        order.setdefault(host, []).append(shard)
    needs = []
    for host, ids in order.items():
        parts = [shard_need(owned[s], learners, push_b) for s in ids]
        floor, full, peak = (sum(p[i] for p in parts) for i in range(3))
        needs.append(Need(host, tuple(ids), sum(owned[s] for s in ids), floor, full, peak))
    return needs


def meminfo_available(text: str) -> int | None:
    """MemAvailable from /proc/meminfo's text, in bytes; None if it is not there."""
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key.strip() == "MemAvailable":
            value, *unit = rest.split()
            return int(value) * (1024 if unit and unit[0].lower() == "kb" else 1)
    return None


def cgroup_room(limit: str, usage: str) -> int | None:
    """Bytes a cgroup still allows (its limit less its usage, from memory.max / memory.current or
    memory.limit_in_bytes / memory.usage_in_bytes); None when it sets no limit or says nothing."""
    limit, usage = limit.strip(), usage.strip()
    if not limit or limit == "max" or not limit.isdigit() or int(limit) >= UNLIMITED:
        return None
    return max(0, int(limit) - (int(usage) if usage.isdigit() else 0))


def available(meminfo: str, rooms: Sequence[int | None]) -> tuple[int | None, str]:
    """(bytes a new process may have, which limit says so): the smallest of MemAvailable and the
    cgroup rooms that set a limit."""
    found: list[tuple[int, str]] = []
    mem = meminfo_available(meminfo)
    if mem is not None:
        found.append((mem, "MemAvailable"))
    found += [(room, "cgroup limit") for room in rooms if room is not None]
    return min(found) if found else (None, "unknown")


def gb(n: float) -> str:
    """`2.4 GB` (decimal, as the capacity plan writes them)."""
    return f"{n / 1e9:.1f} GB"


FITS, MAY_NOT_FIT, DOES_NOT_FIT = "ok", "warn", "fail"


def verdict(need: Need, free: int | None, which: str, shards: int) -> tuple[str, str]:
    """(FITS, MAY_NOT_FIT or DOES_NOT_FIT, one line) for one host: DOES_NOT_FIT only when the
    floor does not fit; a `full` or `peak` that does not is MAY_NOT_FIT."""
    ids = ",".join(map(str, need.shards))
    many = len(need.shards) > 1
    what = "the syncer needs" if shards == 1 else f"syncer shard{'s' if many else ''} {ids} need{'' if many else 's'}"
    line = (
        f"{what} {gb(need.floor)} to {gb(need.full)} ({gb(need.peak)} while checkpointing) "
        f"for {need.params / 1e6:,.1f} M parameters"
    )
    if free is None:
        return FITS, f"{line}; free memory unknown ({which})"
    line += f"; {gb(free)} free ({which})"
    if need.floor > free:
        return DOES_NOT_FIT, line
    if need.full > free:
        return MAY_NOT_FIT, line + ": may not fit once every round holds every learner's push"
    if need.peak > free:
        return MAY_NOT_FIT, line + ": a checkpoint may not fit"
    return FITS, line


def owned_even(total: int, shards: int) -> list[int]:
    """Parameters per shard when the exact fragment plan is not at hand: an even split."""
    return [total // shards + (1 if s < total % shards else 0) for s in range(shards)]


def total_params(shapes: Sequence[tuple[str, tuple[int, ...]]]) -> int:
    """The parameters of (name, shape) pairs."""
    total = 0
    for _, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total
