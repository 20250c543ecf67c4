"""The full `dldctl status --json` snapshot: the syncer's view joined with the supervisor's.

The syncer knows progress (steps, tokens, weights, heartbeats, goodput, bytes); the run state
knows processes (hosts, pids, restarts, faults); the events log knows what happened. When the
syncer does not answer, the snapshot still comes back, with `syncer.alive` false. A sharded
syncer's progress is shard 0's, as an unsharded one's; `shards` has a row per shard
(dldctl/observe/shardrows.py). So is `data`, the data ledger's progress (docs/data.md): only
shard 0 keeps the ledger (the other shards answer null), and a syncer that keeps none (or predates
it) leaves it null.

The state file is only as fresh as the supervisor that writes it: a process on this machine is
checked against its live pid (and start time), so a dead pid reads `dead` even while no
supervisor has noticed, and `supervisor` says whether one is alive and beating (dldctl/supervise/watchdog.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from dldctl.errors import DldError
from dldctl.observe import runs, shardrows
from dldctl.observe.snapshot_model import SCHEMA, VERSION, Snapshot
from dldctl.rundir import RunDir
from dldctl.runstate import Daemon, Fault, Proc, ProcStatus, RunState
from dldctl.supervise import reconcile, watchdog
from dldctl.syncerctl import SyncerControl
from syncer.common import jsonlread
from syncer.common.resolved import ResolvedConfig

EVENTS = 40
STARTING_S = 30.0


def syncer_status(run: RunDir, config: ResolvedConfig, timeout: float = 2.0) -> dict[str, Any] | None:
    """The syncer's own snapshot, or None if it does not answer."""
    try:
        with SyncerControl.for_run(config, run.path) as ctl:
            return ctl.status(timeout)
    except DldError:
        return None


def _syncer_down(run: RunDir, config: ResolvedConfig) -> dict[str, Any]:
    """What we can say with the syncer down: the last sample it wrote, marked stale."""
    last: dict[str, Any] = runs.last_sample(run) or {}
    settings = config.run
    ckpt = _last_checkpoint(run)  # may be newer than the last sample (the final checkpoint)
    return {
        "syncer": {
            "alive": False,
            "fragments": settings.fragments,
            "outer_steps": max(ckpt, last.get("outer_steps") or 0),
            "checkpoint_outer_step": ckpt,
            "rejected": {},
            "dropped_sends": 0,
        },
        "quorum": {
            "min": settings.quorum,
            "live": 0,
            "total": len(config.learners),
            "last_round_contributors": 0,
            "recent_contributors": [],
            "below_quorum": True,
        },
        "goodput": last.get("goodput", 0.0),
        "goodput_window": 0.0,
        "tokens": {"trained": last.get("tokens_trained", 0), "merged": last.get("tokens_merged", 0), "per_s": 0.0},
        "bytes": {
            "up": last.get("bytes_up", 0),
            "down": last.get("bytes_down", 0),
            "ddp_equivalent": last.get("ddp_equivalent", 0),
        },
        "loss": {
            "train": last.get("loss_train"),
            "eval": last.get("loss_eval"),
            "global": last.get("loss_global"),
            "global_off": last.get("global_off"),  # why the global model was not scored, as it last said
        },
        "data": _ledger_sample(last),
        "stale_since": last.get("t"),
        "learners": [],
        "stale_learners": last.get("learners") or {},
    }


# the data ledger's figures a metrics sample carries (syncer/status.py sample_record) -> `data` keys
LEDGER_SAMPLE = {
    "data_epoch": "epoch",
    "data_merged_share": "merged_share",
    "data_in_flight": "in_flight",
    "data_lost": "lost",
    "data_reissued": "reissued",
    "data_merged_tokens": "merged_tokens",
    "data_tokens_by_learner": "tokens_by_learner",
}


def _ledger_sample(last: Mapping[str, Any]) -> dict[str, Any] | None:
    """With the syncer down: the ledger's figures of its last sample (the others absent), or None
    when that sample has none (no ledger, or no sample)."""
    if last.get("data_epoch") is None:
        return None
    return {"order": "ledger", **{key: last[flat] for flat, key in LEDGER_SAMPLE.items() if flat in last}}


def _last_checkpoint(run: RunDir) -> int:
    """The outer step of the newest checkpoint: from the file names in the local run directory,
    else from the last `checkpoint` event's `outer_step` (a syncer on another host); 0 if neither."""
    try:
        names = [p.name for p in run.checkpoints.iterdir()]
    except OSError:
        names = []
    newest = shardrows.newest_checkpoint(names, [] if names else jsonlread.tail(run.events, 500))
    return newest[0] if newest else 0


def learner_state(
    proc: Proc, syncer_row: dict[str, Any] | None, faults: list[Fault], pid_alive: bool | None = None
) -> str:
    """One state word from the process status, active faults and the syncer's view. `pid_alive` is
    what its pid says now (None: not checked, a remote host): a dead pid is `dead`, whatever a
    stale record says."""
    status = proc.status
    if pid_alive is False and status in (ProcStatus.RUNNING, ProcStatus.UNREACHABLE):
        return "dead"
    if status is ProcStatus.RUNNING and proc.job is not None and proc.job.state in ("PENDING", "CONFIGURING"):
        return "queued"  # a scheduler's job waiting for its nodes: it counts against goodput as a dead one
    if status is ProcStatus.DEAD:
        return "restarting" if proc.next_start else "dead"
    if status in (ProcStatus.STOPPED, ProcStatus.FINISHED):  # the syncer refused it: it will not come back alone
        return "refused" if (proc.reason or "").startswith("refused") else "stopped"
    if status in (ProcStatus.PENDING, ProcStatus.STARTING):
        return "starting"
    if status is ProcStatus.UNREACHABLE:
        return "dead"
    active = {f.kind for f in faults if not f.undone}
    for kind, word in (("pause", "paused"), ("partition", "partitioned"), ("slow", "slow"), ("link", "degraded")):
        if kind in active:
            return word
    recently = time.time() - float(proc.started_at or 0) < STARTING_S
    if syncer_row is None:  # the syncer is down (or has not heard of it): the process is up
        return "starting" if recently else "running"
    reported = syncer_row.get("state")
    if reported in ("joining", "running", "slow", "quarantined"):
        return reported
    if reported == "unreachable":  # alive but not heard: just (re)started, or cut off
        return "starting" if recently else "partitioned"
    return "running"


def take(run: RunDir, now: float | None = None) -> Snapshot:
    """The typed snapshot (observe/snapshot_model.py), whatever is or is not running."""
    return Snapshot.from_json(_gather(run, now))


def collect(run: RunDir, now: float | None = None) -> dict[str, Any]:
    """The snapshot as `status --json` prints it (and the live view reads it): the typed
    snapshot's JSON, so every reader gets the same versioned shape."""
    return take(run, now).to_json()


def _gather(run: RunDir, now: float | None = None) -> dict[str, Any]:
    """The snapshot of ARCHITECTURE.md (extended) as gathered, before it is typed."""
    now = time.time() if now is None else now
    config = run.read_config()
    state = run.read_state()
    answered = syncer_status(run, config)  # shard 0: the fleet, quorum, goodput and throughput
    alive = _local_pids_alive(run, state.procs)
    shard_rows = shardrows.rows(run, config, state, answered, alive, now)  # before `snap` changes them
    snap = answered or _syncer_down(run, config)
    snap.setdefault("data", None)  # a syncer from before the data ledger: the same as no ledger
    snap["schema"] = SCHEMA
    snap["version"] = VERSION
    snap["run"] = run.name
    snap["now"] = now
    ended = state.stopped_at if state.status == "down" else None
    created = state.created if state.created is not None else now
    snap["uptime_s"] = float(ended or now) - float(created)  # a run that is down: how long it ran
    snap["status"] = runs.state_word(state.status, run.live())  # "crashed": meant to be up, supervisor gone
    snap["insecure"] = config.run.insecure
    procs = state.procs
    syncer_proc = procs.get("syncer")
    snap["syncer"]["bind"] = snap["syncer"].get("address")
    snap["syncer"]["address"] = config.syncer.address  # what learners dial
    snap["syncer"]["restarts"] = syncer_proc.restarts if syncer_proc else 0
    if not snap["syncer"].get("alive"):
        snap["syncer"]["pid"] = syncer_proc.proc.pid if syncer_proc and syncer_proc.proc else None
    snap["learners"] = _learner_rows(
        procs, snap.get("learners", []), list(state.faults), config, snap.pop("stale_learners", {}), alive
    )
    snap["supervisor"] = supervisor_status(run, state, now)
    snap["faults"] = [f.to_json() for f in state.faults if not f.undone]
    # hosts with a warm spare ready (a crashed run's died with it, or wait for a supervisor that is gone)
    snap["spares"] = [] if snap["status"] == "crashed" else sorted(state.spares)
    for row in snap["learners"] if snap["status"] == "crashed" else []:
        row["state"] = "dead" if row.get("state") == "restarting" else row.get("state")  # nobody restarts it
    snap["shards"] = shard_rows  # one per syncer shard (dldctl/observe/shardrows.py); one row unsharded
    snap["events"] = jsonlread.tail(run.events, EVENTS)
    return snap


def supervisor_status(run: RunDir, state: RunState, now: float) -> dict[str, Any]:
    """The `supervisor` object: its liveness (pid, heartbeat) and its watchdog's."""
    record, dog = state.supervisor, state.watchdog
    beat = watchdog.last_beat(run)
    alive = watchdog.alive(record)
    heard = reconcile.last_heard(record, beat)
    return {
        "alive": alive,
        "state": reconcile.supervisor_health(record, alive, beat, now, state.status),
        "pid": record.pid if record else None,
        "restarts": record.restarts if record else 0,
        "heartbeat_age_s": max(0.0, now - heard) if heard is not None else None,
        "watchdog": {"alive": watchdog.alive(dog), "pid": dog.pid if dog else None, "restarts": _restarts(dog)},
    }


def _restarts(record: Daemon | None) -> int:
    return record.restarts if record else 0


def _local_pids_alive(run: RunDir, procs: Mapping[str, Proc]) -> dict[str, bool]:
    """name -> whether its recorded pid lives, for the running processes on this machine's hosts
    (address "local", or a host the inventory does not name, as the supervisor sees them)."""
    try:
        remote = {
            h.name
            for h in run.read_inventory().hosts
            if not h.local or h.site  # a site's records are job ids, not pids
        }
    except DldError:
        return {}  # cannot tell which hosts are this machine: check none
    return {
        name: watchdog.alive(proc.proc)
        for name, proc in procs.items()
        if proc.host not in remote
        and proc.proc is not None
        and proc.status in (ProcStatus.RUNNING, ProcStatus.UNREACHABLE)
    }


def _learner_rows(
    procs: Mapping[str, Proc],
    syncer_rows: list[dict[str, Any]],
    faults: list[Fault],
    config: ResolvedConfig,
    stale: dict[str, Any],
    alive: dict[str, bool],
) -> list[dict[str, Any]]:
    """One row per learner process; with the syncer down, step/tokens/loss from its last sample."""
    by_id = {row["id"]: row for row in syncer_rows}
    devices = {e.id: e.device for e in config.learners}
    rows = []
    for lid, proc in sorted(procs.items(), key=lambda kv: _order(kv[0])):
        if not proc.learner:
            continue
        srow = by_id.get(lid)
        mine = [f for f in faults if f.target == lid]
        state = learner_state(proc, srow, mine, alive.get(lid))
        row: dict[str, Any] = {
            "id": lid,
            "host": proc.host,
            "device": devices.get(lid, "cpu"),
            "state": state,
            "pid": None
            if state in ("stopped", "refused") or alive.get(lid) is False or proc.proc is None or proc.job
            else proc.proc.pid,
            "step": 0,
            "tokens": 0,
            "tokens_per_s": 0.0,
            "restarts": proc.restarts,
            "weight": 0.0,
            "heartbeat_age_s": None,
            "blocked_frac": 0.0,
            "straggler": False,
        }
        if proc.job is not None:  # a scheduler's job: its id, state and why it waits
            row["job"] = dict(proc.job.to_json(), says=proc.job.describe())
        if srow:
            for key in (
                "step",
                "tokens",
                "merged_tokens",
                "tokens_per_s",
                "weight",
                "heartbeat_age_s",
                "blocked_frac",
                "straggler",
                "loss",
                "eval_loss",
                "replica",
                "joins",
            ):
                if key in srow:
                    row[key] = srow[key]
        elif isinstance(stale.get(lid), dict):
            row.update({k: stale[lid][k] for k in ("step", "tokens", "loss") if stale[lid].get(k) is not None})
        rows.append(row)
    return rows


def _order(lid: str) -> tuple[int, str]:
    tail = lid.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else 1 << 30, lid)
