"""Will the syncer's shards, and the learners on the CPU, fit in their hosts' memory? Asked at
`up` and `up --resume` (before anything starts) and by `dldctl check`.

For a built-in model the shards' parameters are known before any learner joins: the preset's
shapes, the run's fragment plan and its shard map (an even split where this machine has no
torch). Each syncer host answers, through the same Host it is driven by (LocalHost here, SSH
elsewhere), running syncer/common/hostmem.py with its own Python: its /proc/meminfo and its
process's cgroup memory limits; syncer/common/memfit.py and dldctl/syncermem.py turn that into a
verdict. A model from a user's factory is not counted here (its size is known when the first
learner joins, and the syncer checks it then: syncer/core.py). The learners' side: each machine's
CPU learners by dldctl/learnermem.py's estimate, beside the syncer's floor where shards run there
too; learners on a GPU hold their model in its memory and are not counted.
"""

from __future__ import annotations

import json
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from dldctl import learnermem, shards, syncermem
from dldctl.errors import DldError, OperationError
from dldctl.hostopen import open_host
from dldctl.hosts import Host, LocalHost
from dldctl.inventory import HostSpec, Inventory
from dldctl.lifecycle import plan
from syncer.common import hostmem, memfit

# runs on each syncer host with its Python: the same file the syncer reads its own memory with
PROBE = Path(hostmem.__file__).read_text()


LEARNER_HINT = 'fewer learners or a smaller batch_size on that host (docs/operations.md, "Learner memory")'
HINT = 'run shards on other hosts ([syncer] shards, shard_hosts; docs/operations.md, "Syncer memory"), or free memory'


@dataclass(frozen=True)
class _Judged:
    """What a host's verdict says beside its need: free memory, status and line."""

    free: int | None
    which: str  # the limit that set `free`: MemAvailable, cgroup limit, or why it is unknown
    status: str  # syncermem.FITS, MAY_NOT_FIT or DOES_NOT_FIT
    line: str

    @property
    def ok(self) -> bool:
        return self.status != syncermem.DOES_NOT_FIT

    def judged(self) -> dict[str, object]:
        return {"free_B": self.free, "ok": self.ok, "status": self.status, "detail": self.line}


@dataclass(frozen=True)
class HostMemory(_Judged):
    """One syncer host: its shards' need, its free memory, the verdict."""

    need: syncermem.Need = field(kw_only=True)

    def to_dict(self) -> dict[str, object]:
        n = self.need
        return {
            "host": n.host,
            "shards": list(n.shards),
            "params": n.params,
            "floor_B": round(n.floor),
            "full_B": round(n.full),
            "peak_B": round(n.peak),
            "scorer_B": round(n.scorer),
            **self.judged(),
        }


def vocab_of(inv: Inventory) -> int:
    """The vocabulary as workload/data.py picks it: a uint16 .bin corpus 50304, bytes 256."""
    return 50304 if inv.run.data.endswith(".bin") else 256


def preset_shapes(inv: Inventory) -> list[tuple[str, tuple[int, ...]]] | None:
    """The run's parameter shapes for a built-in model; None for a user's factory."""
    from workload import presets

    if ":" in inv.run.model:
        return None
    return presets.param_shapes(inv.run.model, vocab_size=vocab_of(inv), block_size=inv.run.seq_len)


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


def ask(inv: Inventory, spec: HostSpec | None, name: str) -> tuple[int | None, str]:
    """(free bytes, which limit) of an inventory host, or of this machine (`spec` None: "local")."""
    machine = open_host(spec, inv.ssh) if spec is not None else LocalHost(name)
    try:
        return probe(machine, spec.python if spec is not None and not spec.local else sys.executable)
    finally:
        machine.close()


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
    parts = owned(inv, shapes)
    scorer = memfit.scorer_bytes(sum(parts), inv.syncer.shards, inv.run.global_eval_every)
    for need in syncermem.by_host(hosts, parts, learners, push_b, scorer):
        spec = specs.get(need.host)
        free, which = ask(inv, spec, need.host)
        status, line = syncermem.verdict(need, free, which, inv.syncer.shards)
        result.append(HostMemory(free, which, status, line, need=need))
    return result


@dataclass(frozen=True)
class LearnerMemory(_Judged):
    """One machine's CPU learners: their need, its free memory, the verdict."""

    need: learnermem.MachineNeed = field(kw_only=True)

    def to_dict(self) -> dict[str, object]:
        n = self.need
        return {
            "host": n.machine,
            "learners": n.learners,
            "learner_B": [round(b) for b in n.each],
            "syncer_B": round(n.beside),
            **self.judged(),
        }


def machine_of(inv: Inventory, name: str) -> str:
    """Which machine an inventory host name (or "local") is: "local" or its address."""
    spec = next((h for h in inv.hosts if h.name == name), None)
    return "local" if spec is None or spec.local else spec.address


def learner_needs(inv: Inventory, syncer: list[HostMemory]) -> list[tuple[HostSpec, learnermem.MachineNeed]]:
    """Each machine's CPU learners (hosts that share an address are one machine), with the
    syncer's floor where shards run beside them; the first host entry stands for the machine."""
    from workload import presets

    cfg = presets.config_for(inv.run.model, vocab_size=vocab_of(inv), block_size=inv.run.seq_len)
    params = syncermem.total_params(preset_shapes(inv) or [])
    groups: dict[str, list[HostSpec]] = {}
    for h in inv.hosts:
        if h.learners and not h.site and h.device == "cpu":
            groups.setdefault(machine_of(inv, h.name), []).append(h)
    out = []
    for key, specs in groups.items():
        beside = sum(m.need.floor for m in syncer if machine_of(inv, m.need.host) == key)
        each = tuple(
            learnermem.learner_need(cfg, params, h.batch_size or inv.run.batch_size, inv.run.seq_len)
            for h in specs
            for _ in range(h.learners * h.nproc)
        )
        out.append((specs[0], learnermem.MachineNeed(", ".join(h.name for h in specs), len(each), each, beside)))
    return out


def assess_learners(inv: Inventory, syncer: list[HostMemory] | None) -> list[LearnerMemory] | None:
    """Every machine's CPU learners' verdict (a machine that runs syncer shards too: its answer
    for them, not a second question); None for a model from a user's factory."""
    if syncer is None or ":" in inv.run.model:
        return None

    asked = {machine_of(inv, m.need.host): (m.free, m.which) for m in syncer}  # a syncer host's answer

    def one(item: tuple[HostSpec, learnermem.MachineNeed]) -> LearnerMemory:
        spec, need = item
        free, which = asked.get(machine_of(inv, spec.name)) or ask(inv, spec, spec.name)
        status, line = learnermem.verdict(need, free, which, inv.run.model)
        return LearnerMemory(free, which, status, line, need=need)

    needs = learner_needs(inv, syncer)
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(needs)))) as pool:  # one SSH round trip each, at once
        return list(pool.map(one, needs))


def add_check(inv: Inventory, spec: HostSpec, count: int) -> str | None:
    """At `learner add`: OperationError when `count` more CPU learners do not fit in what the host
    has free now (its running learners and syncer already hold theirs); else a warning or None."""
    if ":" in inv.run.model or spec.site or spec.device != "cpu":
        return None
    [(_, one)] = learner_needs(replace(inv, hosts=(replace(spec, learners=count),)), [])
    free, which = ask(inv, spec, spec.name)
    status, line = learnermem.verdict(one, free, which, inv.run.model)
    if status == syncermem.DOES_NOT_FIT:
        raise OperationError(f"host {spec.name}: {line}", hint=LEARNER_HINT + ", or pass --no-memory-check")
    return f"host {spec.name}: {line}" if status == syncermem.MAY_NOT_FIT else None


def preflight(inv: Inventory) -> list[str]:
    """At `up`: OperationError naming every host whose syncer shards or CPU learners cannot fit;
    else the warnings to print (a host that may not fit at full load or while checkpointing)."""
    found = assess(inv)
    if found is None:
        return []
    learners = assess_learners(inv, found) or []
    lines = [(m.ok, m.status, f"host {m.need.host}: {m.line}") for m in found]
    lines += [(m.ok, m.status, f"host {m.need.machine}: {m.line}") for m in learners]
    bad = [line for ok, _, line in lines if not ok]
    if bad:
        hints = [HINT] if any(not m.ok for m in found) else []
        hints += [LEARNER_HINT] if any(not m.ok for m in learners) else []
        raise OperationError("; ".join(bad), hint="; ".join(hints) + ", or pass --no-memory-check")
    return [line for _, status, line in lines if status == syncermem.MAY_NOT_FIT]
