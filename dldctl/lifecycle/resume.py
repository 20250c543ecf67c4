"""`dldctl up --resume RUN`: continue a stopped or crashed run in its own run directory.

    check     nothing of the run still runs; a syncer checkpoint exists (a run that never
              checkpointed has nothing to continue: `dldctl up` starts a new one)
    ports     the syncer ports the inventory fixed are free here; each syncer host still has the
              memory its shards need (memcheck.py): as at `up`
    hosts     the run's own inventory (inventory.json, hosts adopted by `learner add` included),
              every host set up again (idempotent), fresh ports unless the inventory fixed them
    start     the processes `down` stopped (or that had crashed) pending again; removed and
              finished learners stay out; the supervisor starts them

The syncer resumes from its newest valid checkpoint by itself (syncer/checkpoint.py): the outer
steps, versions, token and goodput accounting go on from there; the learners join by fetching
the global state, as after any restart. A run whose supervisor died while its processes run on
(an orphan) is simply given its supervisor back.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from dldctl import shards
from dldctl.errors import DldError, OperationError, UsageError
from dldctl.hostruntime import HostRuntime
from dldctl.inventory import Inventory
from dldctl.lifecycle import codeship, memcheck, modelprobe, plan, provision
from dldctl.lifecycle import down as down_mod
from dldctl.lifecycle import up as up_mod
from dldctl.rundir import RunDir
from dldctl.runstate import DOWN_REASON, HostRecord, ProcStatus, RunState, new_proc
from syncer.common.resolved import ResolvedConfig

CHECKPOINT_NAME = "ckpt-*.pt"  # syncer/checkpoint.py's file names


def resume(run: RunDir, console: Console, timeout: float, memory_check: bool = True) -> tuple[RunDir, list[str]]:
    """Bring a run that is not live back up; (the run, the names still not running). A syncer
    host that cannot hold its shards now is refused first, as `up` does (memcheck.py)."""
    state = run.read_state()
    if run.live():
        raise UsageError(f"run {run.name} is up already", hint="`dldctl status --run " + run.name + "` shows it")
    if state.status in ("starting", "up"):  # an orphan: its processes may run on
        console.print(f"[yellow]run {run.name} lost its supervisor; restarting it[/]")
        up_mod.start_supervisor(run)
        return run, []
    _refuse_if_running(run)
    config = run.read_config()
    _require_checkpoint(run, config)
    inv = run.read_inventory()
    plan.check_fixed_ports(inv)  # the ports it fixed, taken while it was down
    for warning in memcheck.preflight(inv) if memory_check else []:  # the host may have less now
        console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    tree = codeship.scan(inv.run, inv.path)  # the workdir as it is now, shipped to every host again
    names = [h.name for h in inv.hosts] + [*shards.names(config.syncer.shards), *config.learner_ids]
    console.print(f"resuming run [bold]{run.name}[/] in {run.path}", highlight=False)
    with up_mod.Board(console, names) as board:
        make = lambda a: _new_ports(run, inv, config, a)
        config, runtimes, errors = up_mod.prepare_fleet(inv, run, board, make, tree)
        if "local" in state.hosts and "local" not in runtimes:  # the syncer here: the same code as the hosts
            runtimes["local"] = provision.local_runtime("local", run, tree)
        new_state = resumed_state(state, runtimes, errors)
        modelprobe.at_up(inv, config, up_mod.runtimes_of(new_state, errors), board)
        missing, native = up_mod.start_fleet(inv, run, board, new_state, timeout)
    run.event("resume", "run", f"resumed by `dldctl up --resume` ({len(new_state.learners(live=True))} learners)")
    up_mod.report_start(console, timeout, missing, native, errors)
    return run, missing


def _refuse_if_running(run: RunDir) -> None:
    """A `down` that did not finish may have left processes: resuming beside them would run two."""
    fleet = down_mod.RunProcesses(run)
    try:
        alive = fleet.alive()
        unknown = dict(fleet.unreachable)
    finally:
        fleet.close()
    if alive or unknown:
        what = [f"{r['target']} (pid {r['pid']} on {r['host']})" for r in alive]
        what += [f"host {h} did not answer ({why})" for h, why in unknown.items()]
        raise OperationError(
            f"run {run.name} is not stopped cleanly: {'; '.join(what)}",
            hint=f"`dldctl down --run {run.name}` stops what is left; then resume",
        )


def _require_checkpoint(run: RunDir, config: ResolvedConfig) -> None:
    """A local syncer's checkpoints must exist, each shard's in its own directory (a remote one's
    are checked by the syncer itself)."""
    for shard in config.syncer.on_host("local"):
        directory = shards.local_dir(run.path, shard) / "checkpoints"
        if not any(Path(directory).glob(CHECKPOINT_NAME)):
            which = f"syncer shard {shard} " if config.syncer.shards > 1 else "syncer "
            raise OperationError(
                f"run {run.name} has no {which}checkpoint in {directory}: there is nothing to resume",
                hint="`dldctl up` starts a new run (`[run] init_from` can start it from a model file)",
            )


def _new_ports(run: RunDir, inv: Inventory, config: ResolvedConfig, advertise: str) -> ResolvedConfig:
    """The run's configuration with the syncer's address worked out again (ports the inventory
    does not fix are picked afresh: the old ones may be taken by now); saved."""
    config = replace(config, syncer=plan.syncer_section(inv, advertise))
    run.write_config(config)
    return config


def resumed_state(state: RunState, runtimes: dict[str, HostRuntime], errors: dict[str, DldError]) -> RunState:
    """The state a resumed run starts from (pure): what `down` stopped is pending again, on a host
    that was set up; removed and finished learners, and those of unreachable hosts, stay stopped."""
    by_down = any(p.reason == DOWN_REASON for p in state.procs.values())
    procs = {}
    for name, proc in state.procs.items():
        again = proc.reason == DOWN_REASON if by_down else proc.kind in ("syncer", "learner")
        if not again:
            procs[name] = proc
        elif proc.host in errors:
            procs[name] = replace(proc, status=ProcStatus.STOPPED, reason=errors[proc.host].line())
        else:
            procs[name] = new_proc(proc.kind, proc.host)
    hosts = {**state.hosts, **{name: HostRecord(rt) for name, rt in runtimes.items()}}
    return replace(state, status="starting", stopped_at=None, procs=procs, hosts=hosts, faults=(), spares={})
