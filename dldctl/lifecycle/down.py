"""`dldctl down`: stop everything on every host, final checkpoint, final model, a summary.

Order matters: the supervisor and its watchdog first (so nothing is restarted: once the run is
`stopping` neither restarts the other), then the learners with SIGTERM
(each sends its due fragments and says bye), then the syncer, asked to close its open rounds,
export the final model and checkpoint before it exits. A sharded syncer (dldctl/shards.py) is
stopped shard S-1 down to shard 1 first, each writing its final checkpoint as it exits (a shard
that is down is skipped: its newest checkpoint stands in), then shard 0, which assembles the
final model from every shard's newest checkpoint. Anything still alive after its grace period is
killed by process group. Processes are found in `procs.jsonl` (every process ever started), so
`down` works even when state.json is corrupt. Afterwards nothing of the run runs.
"""

from __future__ import annotations

import signal
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from rich.console import Console

from dldctl import shards, syncerctl
from dldctl.errors import ChaosError, DldError, OperationError, RunError
from dldctl.faults import links
from dldctl.hostopen import host_for
from dldctl.hosts import Host, ProcRef
from dldctl.hosts.slurm import SlurmHost
from dldctl.lifecycle import export as export_mod
from dldctl.lifecycle import shardgather
from dldctl.observe import runs
from dldctl.observe.snapshot_model import Snapshot, final_figures
from dldctl.rundir import RunDir
from dldctl.runstate import DOWN_REASON, Proc, ProcStatus, RunState
from dldctl.supervise import mirror
from dldctl.syncerctl import SyncerControl
from syncer.common import ckptname
from syncer.common.modelexport import CONFIG, EXPORT_DIR, WEIGHTS
from syncer.common.resolved import ResolvedConfig

LEARNER_GRACE_S = 20.0
SYNCER_GRACE_S = 20.0


@dataclass
class ShardStop:
    """A syncer shard's row of `down`'s summary: the outer step it stopped at (None: unknown) and
    how it stopped: stopped (its final checkpoint written), dead (not running: its newest
    checkpoint stands in), unreachable, or killed (it did not shut down when asked)."""

    shard: int
    outer_steps: int | None = None
    state: str = "dead"


class RunProcesses:
    """Every process ever started for the run, grouped by host, with the host connections."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.inv = run.read_inventory()
        self.hosts: dict[str, Host] = {}
        latest: dict[str, dict[str, Any]] = {}
        self.procs: list[dict[str, Any]] = run.started_procs()
        for record in self.procs:
            latest[record["target"]] = record
        self.latest = latest
        self._taken = {
            (r["host"], r["pid"], r["start_ticks"]) for r in self.procs if not r["target"].startswith("spare-")
        }
        self.unreachable: dict[str, str] = {}  # host -> why: its processes may still run

    def host(self, name: str) -> Host:
        if name not in self.hosts:
            self.hosts[name] = host_for(self.inv, name)
        return self.hosts[name]

    def idle_spare(self, record: dict[str, Any]) -> bool:
        """A warm spare's record whose process never became a learner (that one is stopped as one)."""
        key = (record["host"], record["pid"], record["start_ticks"])
        return record["target"].startswith("spare-") and key not in self._taken

    def refs(self, predicate: Any = None) -> list[tuple[dict[str, Any], ProcRef]]:
        return [(r, ProcRef(r["pid"], r["start_ticks"])) for r in self.procs if predicate is None or predicate(r)]

    def alive(self, predicate: Any = None) -> list[dict[str, Any]]:
        """Records of processes still alive (one round trip per host; unreachable = unknown)."""
        by_host: dict[str, list[tuple[dict[str, Any], ProcRef]]] = {}
        for record, ref in self.refs(predicate):
            by_host.setdefault(record["host"], []).append((record, ref))
        out: list[dict[str, Any]] = []
        for host, items in by_host.items():
            try:
                status = self.host(host).alive([ref for _, ref in items])
            except DldError as exc:
                if host not in self.unreachable:
                    self.run.event("host_unreachable", host, f"during down: {exc.line()}")
                self.unreachable[host] = exc.line()
                continue
            self.unreachable.pop(host, None)
            out.extend(record for record, ref in items if status.get(ref.pid))
        return out

    def signal(self, records: list[dict[str, Any]], sig: int) -> None:
        for record in records:
            try:
                self.host(record["host"]).signal(ProcRef(record["pid"], record["start_ticks"]), sig, group=True)
            except DldError as exc:
                self.run.event("signal_failed", record["target"], exc.line())

    def wait_gone(self, predicate: Any, timeout: float) -> list[dict[str, Any]]:
        """Wait up to `timeout` for the processes to exit by themselves; those still alive."""
        alive = self.alive(predicate)
        deadline = time.monotonic() + timeout
        while alive and time.monotonic() < deadline:
            time.sleep(0.3)
            alive = self.alive(predicate)
        return alive

    def stop(self, predicate: Any, grace: float) -> list[dict[str, Any]]:
        """SIGCONT + SIGTERM, wait up to `grace`, then SIGKILL; returns what had to be killed."""
        alive = self.alive(predicate)
        self.signal(alive, signal.SIGCONT)  # a paused process cannot handle SIGTERM
        self.signal(alive, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while alive and time.monotonic() < deadline:
            time.sleep(0.3)
            alive = self.alive(predicate)
        self.signal(alive, signal.SIGKILL)
        return alive

    def sweep_jobs(self) -> list[dict[str, Any]]:
        """Cancel, on every scheduler site, the run's learner jobs found by name: one submitted but
        never recorded (its supervisor died right after sbatch) would otherwise stay queued."""
        swept: list[dict[str, Any]] = []
        try:
            state = self.run.read_state()
        except RunError:
            return swept  # a corrupt state: the recorded jobs were stopped from procs.jsonl all the same
        for spec in (h for h in self.inv.hosts if h.site):
            targets = sorted(n for n, p in state.procs.items() if p.host == spec.name and p.learner)
            record = state.hosts.get(spec.name)
            run_dir = record.runtime.run_dir if record is not None else None
            host = self.host(spec.name)
            if not isinstance(host, SlurmHost) or not run_dir or not targets:
                continue
            try:
                ids = host.cancel_named(str(run_dir), targets)
            except DldError as exc:
                self.unreachable[spec.name] = exc.line()
                continue
            for job_id in ids:
                self.run.event("job_cancelled", spec.name, f"{spec.scheduler} job {job_id} of this run, found by name")
            swept += [{"target": f"job {i}", "host": spec.name, "pid": i} for i in ids]
        return swept

    def close(self) -> None:
        for host in self.hosts.values():
            host.close()


def _uncap_links(run: RunDir, fleet: RunProcesses, config: ResolvedConfig | None) -> None:
    """Take off every link cap of `chaos link` still on a host (its tc rules outlive the run)."""
    try:
        state = run.read_state()
    except RunError:
        return
    for fault in (f for f in state.faults if f.kind == "link" and not f.undone):
        try:
            if config is None or fault.target not in state.procs:
                raise ChaosError("the run's configuration or learner is gone")
            links.uncap(links.ends_of(state, config, fault.target, fleet.host))
        except DldError as exc:
            run.event("fault_undo_failed", fault.target, f"link at down: {exc.line()} (remove its tc class by hand)")
            continue
        run.event("fault_undo", fault.target, "link undone at down")


def _mark_stopping(run: RunDir) -> None:
    try:
        with run.update() as edit:
            edit.state = edit.state.with_status("stopping")
    except RunError as exc:
        run.event("state_corrupt", "run", f"{exc.line()}; stopping every recorded process anyway")


def _read_config(run: RunDir) -> ResolvedConfig | None:
    """The run's configuration, or None (an event says why): `down` stops the processes anyway."""
    try:
        return run.read_config()
    except RunError as exc:
        run.event("config_unreadable", "run", f"{exc.line()}; stopping the syncer without its control socket")
        return None


def _syncer_snapshot(run: RunDir, config: ResolvedConfig | None) -> Snapshot | None:
    if config is None:
        return None
    try:
        with SyncerControl.for_run(config, run.path) as ctl:
            return Snapshot.from_json(ctl.status(timeout=3.0))
    except DldError:
        return None


def _announce_ending(run: RunDir, config: ResolvedConfig | None) -> None:
    """Tell every shard of the syncer the run is ending, so the rounds that close while the learners
    stop one by one keep those already gone in the average (docs/algorithm.md, Fleet scale); a
    shard that is down, or too old to know the action, just misses the hint."""
    if config is not None:
        syncerctl.tell_every_shard(config, run.path, "ending", 3.0)


def _stop_shards(
    run: RunDir, fleet: RunProcesses, config: ResolvedConfig | None
) -> tuple[list[ShardStop], list[dict[str, Any]]]:
    """Shards S-1 .. 1 of a sharded syncer, each asked to close its rounds and shut down (it writes
    its final checkpoint as it exits: shard 0 assembles from it); (a row per shard, what had to be
    killed). Any shard process procs.jsonl names still alive afterwards (a config that cannot be
    read: all of them) is stopped by signal."""
    rows: list[ShardStop] = []
    killed: list[dict[str, Any]] = []
    for shard in range(config.syncer.shards - 1 if config is not None else 0, 0, -1):
        assert config is not None
        row, forced = _stop_shard(run, fleet, config, shard)
        rows.insert(0, row)
        killed += forced
    killed += fleet.stop(lambda r: (shards.shard_of(r["target"]) or 0) > 0, SYNCER_GRACE_S)
    return rows, killed


def _stop_shard(
    run: RunDir, fleet: RunProcesses, config: ResolvedConfig, shard: int
) -> tuple[ShardStop, list[dict[str, Any]]]:
    """One shard shut down (or skipped, if it is down) and waited for; (its row, what was killed)."""
    name = shards.proc_name(shard)

    def mine(record: dict[str, Any]) -> bool:
        return bool(record["target"] == name)

    row = ShardStop(shard)
    forced: list[dict[str, Any]] = []
    if not fleet.alive(mine):
        run.event("syncer_shard_down", name, "not running at down: its newest checkpoint goes into the final model")
    else:
        row = _shut_down_shard(run, config, shard)
        gone = row.state == "stopped" and not fleet.wait_gone(mine, SYNCER_GRACE_S)
        if not gone:  # it did not take the shutdown, or took longer than its grace: SIGTERM, then SIGKILL
            forced = fleet.stop(mine, SYNCER_GRACE_S)
            row.state = "killed" if forced else row.state
    if row.outer_steps is None:
        row.outer_steps = _checkpoint_step(run, config, shard)
    return row, forced


def _gather_shards(run: RunDir, fleet: RunProcesses, config: ResolvedConfig | None) -> None:
    """Shards on other hosts than shard 0's: their newest checkpoints into shard 0's run directory."""
    if config is None or not shardgather.to_gather(config):
        return
    try:
        state = run.read_state()
    except RunError as exc:
        run.event("shard_gather_failed", "syncer", f"no run state to find the shards' hosts: {exc.line()}")
        return
    shardgather.gather(run, config, state, fleet.host)


def _shut_down_shard(run: RunDir, config: ResolvedConfig, shard: int) -> ShardStop:
    """Close shard `shard`'s open rounds, read its outer steps, ask it to shut down (no export)."""
    try:
        with SyncerControl.for_run(config, run.path, shard) as ctl:
            ctl.control("flush", timeout=10.0)
            steps = Snapshot.from_json(ctl.status(timeout=3.0)).syncer.outer_steps
            ctl.control("shutdown", timeout=10.0)
            return ShardStop(shard, steps, "stopped")
    except DldError as exc:
        run.event("syncer_unreachable", shards.proc_name(shard), f"during down: {exc.line()}")
        return ShardStop(shard, None, "unreachable")


def _checkpoint_step(run: RunDir, config: ResolvedConfig, shard: int) -> int | None:
    """The outer step of shard `shard`'s newest checkpoint in this run directory (None: none here)."""
    if config.syncer.host_of(shard) != "local":
        return None
    try:
        names = [p.name for p in (shards.local_dir(run.path, shard) / "checkpoints").iterdir()]
    except OSError:
        return None
    newest = ckptname.newest(names)
    return newest.outer_step if newest else None


def _shard_zero(run: RunDir, config: ResolvedConfig, snap: Snapshot | None) -> ShardStop:
    """Shard 0's row of `down`'s summary: its outer steps from its last snapshot (if it answered)."""
    if snap is None:
        return ShardStop(0, _checkpoint_step(run, config, 0), "unreachable")
    return ShardStop(0, snap.syncer.outer_steps, "stopped")


def _final_syncer(run: RunDir, config: ResolvedConfig | None) -> tuple[Snapshot | None, str]:
    """Last snapshot, then close rounds, export and stop; ('', snapshot None) if it is down."""
    if config is None:
        return None, ""
    try:
        with SyncerControl.for_run(config, run.path) as ctl:
            snap = Snapshot.from_json(ctl.status(timeout=3.0))
            ctl.control("flush", timeout=10.0)
            detail = ctl.control("shutdown", timeout=60.0, export="final_model.pt")
            return snap, detail
    except DldError as exc:
        run.event("syncer_unreachable", "syncer", f"during down: {exc.line()}")
        return None, ""


def already_down(run: RunDir) -> dict[str, Any] | None:
    """What a second `down` reports for a run that is down already (nothing is touched), or None.

    A run is marked down only once every process of it is stopped, so nothing can still run.
    """
    try:
        state = run.read_state()
    except RunError:
        return None
    if state.status != "down":
        return None
    model = run.final_model if run.final_model.exists() else None
    return {
        "run": run.name,
        "dir": str(run.path),
        "already_down": True,
        "stopped_at": state.stopped_at,
        "final_model": str(model) if model else None,
        **export_mod.summary_files(run.path / EXPORT_DIR),
        "uptime_s": _run_age(state.created, state.stopped_at),
    }


def _run_age(created: float | None, stopped_at: float | None, now: float | None = None) -> float | None:
    """How long the run ran, `up` to `down` (not the age of a syncer restarted meanwhile): run
    created -> stopped, or -> `now` when it has no stop time (yet); None without a creation time."""
    end = stopped_at if stopped_at is not None else now
    return end - created if created is not None and end is not None else None


def down(run: RunDir, console: Console) -> dict[str, Any]:
    """Stop the whole run; returns a summary dict (also printed)."""
    _mark_stopping(run)
    fleet = RunProcesses(run)
    try:
        killed = fleet.stop(lambda r: r["target"] in ("supervisor", "watchdog"), 10.0)
        killed += fleet.stop(fleet.idle_spare, 5.0)  # warm spares that never became a learner
        config = _read_config(run)
        _uncap_links(run, fleet, config)  # before the learners' last pushes, and nothing left on a host
        before = _syncer_snapshot(run, config)
        _announce_ending(run, config)  # the learners' byes from here on keep them in the fleet's average
        console.print("stopping learners (they send their last fragments)...")
        killed += fleet.stop(lambda r: r["target"].startswith("learner-"), LEARNER_GRACE_S)
        killed += fleet.sweep_jobs()  # nothing of the run left queued on a scheduler
        rows, forced = _stop_shards(run, fleet, config)  # a sharded syncer's shards S-1 .. 1
        _gather_shards(run, fleet, config)  # shards on other hosts: their checkpoints to shard 0
        snap, exported = _final_syncer(run, config)
        killed += forced + fleet.stop(lambda r: r["target"] == "syncer", SYNCER_GRACE_S)
        exported = _bring_home(run, fleet, exported, config)
        _drain_exports(run)
        left = fleet.alive()
        if left:
            names = ", ".join(f"{r['target']} (pid {r['pid']} on {r['host']})" for r in left)
            raise OperationError(f"still running after down: {names}", hint="check those hosts by hand")
        if fleet.unreachable:
            hosts = "; ".join(f"{h}: {why}" for h, why in fleet.unreachable.items())
            raise OperationError(
                f"could not reach every host, its processes may still run: {hosts}",
                hint="run `dldctl down` again once the host answers",
            )
    finally:
        fleet.close()
    try:
        with run.update() as edit:
            procs = {n: _stopped(p) for n, p in edit.state.procs.items()}
            edit.state = replace(edit.state, status="down", stopped_at=time.time(), procs=procs)
    except RunError:
        pass
    run.event("down", "run", f"stopped; forced to kill {len(killed)} processes")
    if snap and before:  # learners report losses while they run: theirs, not the final score
        snap = replace(snap, loss=replace(snap.loss, train=before.loss.train, eval=before.loss.eval))
    out = summary(run, snap or before, exported, killed)
    if rows and config is not None:  # a sharded syncer: each shard's outer steps and how it stopped
        out["shards"] = [asdict(row) for row in (_shard_zero(run, config, snap), *rows)]
    out.update(export_mod.summary_files(run.path / EXPORT_DIR) if exported else {})  # the safetensors export
    try:
        state = run.read_state()
        out["uptime_s"] = _run_age(state.created, state.stopped_at)
    except RunError:
        pass
    return out


def _drain_exports(run: RunDir) -> None:
    """The run's last records to its TensorBoard/W&B exporters (the supervisor stopped first)."""
    from dldctl.supervise import sinks

    try:
        inv = run.read_inventory()
        if inv.metrics.tensorboard or inv.metrics.wandb:
            created = run.read_state().created or time.time()
            sinks.drain(inv, run.path, created, lambda kind, detail: run.event(kind, "supervisor", detail))
    except Exception as exc:  # an exporter never stands in the way of stopping a run
        run.event("metrics_export_failed", "supervisor", f"final records: {type(exc).__name__}: {exc}")


def _stopped(proc: Proc) -> Proc:
    """A process as `down` leaves it: stopped; the reason says whether `down` stopped it."""
    done = proc.status in (ProcStatus.STOPPED, ProcStatus.FINISHED)
    return replace(proc, status=ProcStatus.STOPPED, proc=None, reason=proc.reason if done else DOWN_REASON)


def _bring_home(run: RunDir, fleet: RunProcesses, exported: str, config: ResolvedConfig | None) -> str:
    """A remote syncer's last records and its final model (final_model.pt and the safetensors
    export), copied to the run directory; the export's config.json completed (dldctl/lifecycle/export.py).
    A sharded syncer's assembly can fail (a shard without a checkpoint: its event says why): no model then."""
    count = config.syncer.shards if config else 1
    exported = _fetch_remote(run, fleet, exported)
    if exported and count > 1 and not run.final_model.is_file():
        exported = ""
    if exported:
        problem = export_mod.finish(run.path / EXPORT_DIR)
        if problem:
            run.event("export_failed", "run", f"the safetensors export: {problem}")
    return exported


def _mirror_shards(run: RunDir, fleet: RunProcesses, state: RunState) -> None:
    """The last records of every syncer shard on another host, brought home."""
    offsets = dict(state.mirror)
    for name, runtime, which in mirror.remote_shards(state, run):
        try:
            offsets = mirror.mirror(fleet.host(name), runtime, run, offsets, which)
        except DldError as exc:
            run.event("fetch_failed", "syncer", f"final records from {name}: {exc.line()}")
    if offsets != dict(state.mirror):
        with run.update() as edit:
            edit.state = replace(edit.state, mirror=offsets)


def _fetch_remote(run: RunDir, fleet: RunProcesses, exported: str) -> str:
    try:
        state = run.read_state()
    except RunError:
        return exported
    _mirror_shards(run, fleet, state)
    where = mirror.remote_syncer(state)
    if where is None or where[1].run_dir == str(run.path):  # here already
        return exported
    host = fleet.host(where[0])
    try:
        if exported:
            host.get_file(f"{where[1].run_dir}/final_model.pt", run.final_model)
            exported = str(run.final_model)
            for name in (WEIGHTS, CONFIG):  # absent when the syncer host has no safetensors (an event says so)
                host.get_file(f"{where[1].run_dir}/{EXPORT_DIR}/{name}", run.path / EXPORT_DIR / name)
    except DldError as exc:
        run.event("fetch_failed", "syncer", f"final records/model from {where[0]}: {exc.line()}")
    return exported


def summary(run: RunDir, snap: Snapshot | None, exported: str, killed: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers a user wants after a run, raw (`down --json`; the command prints them for people)."""
    out: dict[str, Any] = {
        "run": run.name,
        "dir": str(run.path),
        "final_model": exported or None,
        "killed": [r["target"] for r in killed],
    }
    figures = final_figures(runs.last_sample(run), snap)  # where the run ended, as `runs` and the report say
    if figures is not None:
        out.update(
            outer_steps=figures.outer_steps,
            goodput=figures.goodput,
            tokens_trained=figures.tokens_trained,
            tokens_merged=figures.tokens_merged,
            loss_train=figures.loss.train,
            loss_eval=figures.loss.eval,
            loss_global=figures.loss.global_,
            guard_rollbacks=snap.guard.rollbacks if snap is not None and snap.guard is not None else 0,
            bytes_up=figures.bytes_up,
            bytes_down=figures.bytes_down,
            ddp_equivalent=figures.ddp_equivalent,
        )
    try:  # the run's age (as `dldctl runs` has it), never the snapshot's: that is a restarted syncer's
        state = run.read_state()
        out["uptime_s"] = _run_age(state.created, state.stopped_at, time.time())
    except RunError:
        out["uptime_s"] = None
    return out
