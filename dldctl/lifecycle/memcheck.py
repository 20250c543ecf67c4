"""Will the syncer's shards fit in their hosts' memory? Asked at `up` (before anything starts) and
by `dldctl check`.

For a built-in model the shards' parameters are known before any learner joins: the preset's
shapes, the run's fragment plan and its shard map (an even split where this machine has no
torch). Each syncer host answers, through the same Host it is driven by (LocalHost here, SSH
elsewhere), running syncer/common/hostmem.py with its own Python: its /proc/meminfo and its
process's cgroup memory limits; syncer/common/memfit.py and dldctl/syncermem.py turn that into a
verdict. A model from a user's factory is not counted here (its size is known when the first
learner joins, and the syncer checks it then: syncer/core.py).
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from dldctl import shards, syncermem
from dldctl.errors import DldError, OperationError
from dldctl.hosts import Host, LocalHost
from dldctl.inventory import Inventory
from dldctl.lifecycle import plan
from dldctl.lifecycle.provision import open_host
from syncer.common import hostmem, memfit

# runs on each syncer host with its Python: the same file the syncer reads its own memory with
PROBE = Path(hostmem.__file__).read_text()


HINT = 'run shards on other hosts ([syncer] shards, shard_hosts; docs/operations.md, "Syncer memory"), or free memory'


@dataclass(frozen=True)
class HostMemory:
    """One syncer host: its shards' need, its free memory, the verdict."""

    need: syncermem.Need
    free: int | None
    which: str  # the limit that set `free`: MemAvailable, cgroup limit, or why it is unknown
    status: str  # syncermem.FITS, MAY_NOT_FIT or DOES_NOT_FIT
    line: str

    @property
    def ok(self) -> bool:
        return self.status != syncermem.DOES_NOT_FIT

    def to_dict(self) -> dict[str, object]:
        n = self.need
        return {
            "host": n.host,
            "shards": list(n.shards),
            "params": n.params,
            "floor_B": round(n.floor),
            "full_B": round(n.full),
            "peak_B": round(n.peak),
            "free_B": self.free,
            "ok": self.ok,
            "status": self.status,
            "detail": self.line,
        }


def preset_shapes(inv: Inventory) -> list[tuple[str, tuple[int, ...]]] | None:
    """The run's parameter shapes for a built-in model (vocabulary as workload/data.py picks it:
    a uint16 .bin corpus 50304, bytes 256); None for a user's factory."""
    from workload import presets

    if ":" in inv.run.model:
        return None
    vocab = 50304 if inv.run.data.endswith(".bin") else 256
    return presets.param_shapes(inv.run.model, vocab_size=vocab, block_size=inv.run.seq_len)


def owned(inv: Inventory, shapes: list[tuple[str, tuple[int, ...]]]) -> list[int]:
    """Parameters each shard owns: the run's own fragment plan and shard map where torch is
    here to compute them (the syncer's code), else an even split."""
    count = inv.syncer.shards
    try:
        from syncer.wire import fragments
        from syncer.wire import shards as shard_map
    except ImportError:
        return syncermem.owned_even(syncermem.total_params(shapes), count)
    specs = [fragments.TensorSpec(n, s) for n, s in shapes]
    return [sum(shard_map.shard_plan(specs, inv.run.fragments, s, count).sizes()) for s in range(count)]


def probe(host: Host, python: str) -> tuple[int | None, str]:
    """(free bytes, which limit) on `host`; (None, why) when it cannot say."""
    try:
        out = host.run(f"{shlex.quote(python)} -c {shlex.quote(PROBE)}", timeout=60, check=False)
    except DldError as exc:
        return None, f"not asked: {exc.line()}"
    if out.status != 0:
        return None, f"not asked: {python} failed"
    try:
        return memfit.free(json.loads(out.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return None, "not asked: unreadable answer"


def assess(inv: Inventory) -> list[HostMemory] | None:
    """Every syncer host's verdict; None for a model from a user's factory (not counted here)."""
    shapes = preset_shapes(inv)
    if shapes is None:
        return None
    learners = len(plan.learner_plans(inv))
    push_b = memfit.push_bytes(inv.run.compression, inv.run.block)
    hosts = shards.hosts_of(inv.syncer.host, inv.syncer.shard_hosts, inv.syncer.shards)
    specs = {h.name: h for h in inv.hosts}
    result = []
    for need in syncermem.by_host(hosts, owned(inv, shapes), learners, push_b):
        spec = specs.get(need.host)
        machine = open_host(spec, inv.ssh) if spec is not None else LocalHost(need.host)
        try:
            free, which = probe(machine, spec.python if spec is not None and not spec.local else sys.executable)
        finally:
            machine.close()
        status, line = syncermem.verdict(need, free, which, inv.syncer.shards)
        result.append(HostMemory(need, free, which, status, line))
    return result


def preflight(inv: Inventory) -> list[str]:
    """At `up`: OperationError naming every syncer host whose shards cannot fit; else the
    warnings to print (a host that may not fit at full load or while checkpointing)."""
    found = assess(inv)
    if found is None:
        return []
    bad = [f"host {m.need.host}: {m.line}" for m in found if not m.ok]
    if bad:
        raise OperationError("; ".join(bad), hint=HINT + ", or pass --no-memory-check")
    return [f"host {m.need.host}: {m.line}" for m in found if m.status == syncermem.MAY_NOT_FIT]
