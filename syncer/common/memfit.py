"""How much memory a syncer shard needs, and how much its host has free (pure: text in, bytes out).

A shard owning n of the model's parameters, with M learners pushing (the capacity plan,
bench/capacity_model.py, frozen at 5ce4e1c; measured in BENCHMARKS.md, "Capacity plan" and "Syncer memory"):

    floor = base + n * VECTORS_B                the three fp32 vectors alone: what it certainly needs
    full  = base + n * (state + push * M)       every fragment's round holding every learner's push
    peak  = full + n * CHECKPOINT_B             while a checkpoint is written (copy on write)

VECTORS_B: the three fp32 vectors every round updates (parameters, Nesterov momentum,
error-feedback residual); state: those and what the process keeps around them, 13.7 bytes per
parameter measured; push: one pending push per parameter as the syncer holds it (decompressed,
int4 codes still packed: half a byte plus one fp32 scale per block); base: the empty syncer
process. Rounds are called in turn, so `full` is an upper bound: the 774M search with 16
learners held 12.4-13.7 GB (floor 9.5, full 17.4) and peaked at 15.1.

A host's free memory is what its kernel says a new process can have: /proc/meminfo's
MemAvailable, or less where the process's cgroup (v1 or v2) or one above it has a limit (a
container, a Slurm job, a systemd slice); syncer/common/hostmem.py reads those files. Used by
`dldctl up` and `check` before a run starts (dldctl/syncermem.py) and by a syncer that learns its
model's size from the first learner (syncer/core.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

VECTORS_B = 12.0  # parameters, momentum, residual: fp32 each
STATE_B = 13.7  # bytes per parameter a shard holds with little pending (syncer_memory.json)
CHECKPOINT_B = 12.0  # more per parameter while a checkpoint is written
BASE_B = 0.25e9  # the empty syncer process (torch, zmq, the kernel)
SCORER_B = 4.0  # shard 0 of a sharded syncer that scores the global model: one fp32 copy of all of it
# a pending push's codes per parameter (2bit: one int8 a code; topk: int8 code + int64 index, 64 of 4,096)
CODE_B = {"int4": 0.5, "int8": 1.0, "bf16": 2.0, "none": 4.0, "2bit": 1.0, "topk": 9 * 64 / 4096}
UNLIMITED = 1 << 60  # cgroup v1's "no limit" is 2^63 rounded down to a page; anything above this is none


def push_bytes(compression: str, block: int) -> float:
    """One pending push per parameter: its codes plus, quantized, one fp32 scale per block."""
    return CODE_B[compression] + (4.0 / block if compression in ("int4", "int8", "2bit") else 0.0)


def shard_need(params: int, learners: int, push_b: float) -> tuple[float, float, float]:
    """(floor, full, peak) bytes of one shard owning `params` parameters with `learners` pushing."""
    floor = BASE_B + params * VECTORS_B
    full = BASE_B + params * (STATE_B + push_b * learners)
    return floor, full, full + params * CHECKPOINT_B


def scorer_bytes(total_params: int, shards: int, global_eval_every: int) -> float:
    """What shard 0 of a sharded syncer holds more to score the global model (syncer/shardscore.py):
    the whole model once, fp32; nothing unsharded (the syncer scores its own state) or unscored."""
    return SCORER_B * total_params if shards > 1 and global_eval_every > 0 else 0.0


def meminfo_available(text: str) -> int | None:
    """MemAvailable from /proc/meminfo's text, in bytes; None if it is not there."""
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key.strip() == "MemAvailable":
            value, *unit = rest.split()
            return int(value) * (1024 if unit and unit[0].lower() == "kb" else 1)
    return None


def cgroup_room(limit: str, usage: str, stat: str = "") -> int | None:
    """Bytes a cgroup still allows: its limit less what it uses (memory.max / memory.current, or
    memory.limit_in_bytes / memory.usage_in_bytes) but for the inactive page cache its memory.stat
    counts (reclaimed before anything is killed; a container that read its dataset is not full);
    None when it sets no limit or says nothing."""
    limit, usage = limit.strip(), usage.strip()
    if not limit or limit == "max" or not limit.isdigit() or int(limit) >= UNLIMITED:
        return None
    used = int(usage) if usage.isdigit() else 0
    return max(0, int(limit) - max(0, used - inactive_file(stat)))


def inactive_file(stat: str) -> int:
    """The inactive page cache of a cgroup's memory.stat: v1's hierarchical total_inactive_file,
    else inactive_file (v2, or v1 without totals); 0 if neither is there."""
    fields = dict(line.split(maxsplit=1) for line in stat.splitlines() if len(line.split()) == 2)
    value = fields.get("total_inactive_file", fields.get("inactive_file", "0")).strip()
    return int(value) if value.isdigit() else 0


def available(meminfo: str, rooms: Sequence[int | None]) -> tuple[int | None, str]:
    """(bytes a new process may have, which limit says so): the smallest of MemAvailable and the
    cgroup rooms that set a limit."""
    found: list[tuple[int, str]] = []
    mem = meminfo_available(meminfo)
    if mem is not None:
        found.append((mem, "MemAvailable"))
    found += [(room, "cgroup limit") for room in rooms if room is not None]
    return min(found) if found else (None, "unknown")


def free(answer: Mapping[str, Any]) -> tuple[int | None, str]:
    """`available` from syncer/common/hostmem.py's `probe()` answer (ValueError if malformed)."""
    try:
        rooms = [cgroup_room(*(str(part) for part in room)) for room in answer["rooms"]]
        return available(str(answer["meminfo"]), rooms)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a memory probe's answer: {exc}") from None


def gb(n: float) -> str:
    """`2.4 GB` (decimal, as the capacity plan writes them)."""
    return f"{n / 1e9:.1f} GB"


def floor_problem(params: int, free: int, which: str, shard: str = "the syncer") -> str | None:
    """The one line of a running shard that cannot hold `params` parameters in `free` bytes (the
    three vectors it would allocate: the process itself is already counted as used); else None."""
    need = params * VECTORS_B
    if need <= free:
        return None
    return (
        f"{shard} cannot hold this model: its {params / 1e6:,.1f} M parameters need {gb(need)} "
        f"(three fp32 vectors) and its host has {gb(free)} free ({which}); run more "
        "shards on other hosts ([syncer] shards, shard_hosts) or give the syncer's host memory"
    )
