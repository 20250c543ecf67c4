"""The supervisor's decisions, as a pure function of the run state, what it observed, and `now`.

Each process (the syncer, every learner) is a `Proc` in `state.procs` (dldctl/runstate.py), with a
`ProcStatus`: pending -> starting -> running -> dead -> (restart) starting -> ...; also unreachable
(its host does not answer), finished (a learner that spent its budget), stopped (removed/down).
The records are frozen: every function here returns the new record or state.

`decide` returns the actions to carry out (start a process, undo an expired fault) and the
events to record; the supervisor does the I/O. Deaths caused by chaos do not count towards
the crash-loop backoff.

The supervisor is watched too (dldctl/supervise/watchdog.py): `supervisor_health` is the rule by which the
watchdog restarts it and `dldctl status` reports it, and `resume` is what a restarted supervisor
makes of the processes its predecessor was in the middle of starting.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dldctl.hosts.slurmjobs import JobInfo
from dldctl.runstate import Daemon, Fault, PidRecord, Proc, ProcStatus, RunState
from dldctl.runstate import new_proc as new_proc

FAST_DEATH_S = 30.0
STALE_S = 15.0  # no supervisor heartbeat for this long: status warns (its loop is slow or stuck)
HUNG_S = 120.0  # ... for this long: the watchdog kills and restarts it (an SSH call never blocks this long)
LIVE = ("starting", "up")


@dataclass(frozen=True)
class Observation:
    """What the supervisor saw of one process: alive, dead, or unknown (host unreachable)."""

    alive: bool | None
    finished: str | None = None  # "finished" (budget spent) or "refused: why": do not restart
    last_words: str = ""  # a dead process's last log line (its error, when it crashed)
    job: JobInfo | None = None  # on a scheduler site: what the scheduler says of its job now
    job_id: int | None = None  # ... and which job was looked up (None: not a scheduler's job)
    ooms: int = 0  # a dead process: what the kernel's OOM killer killed on its host since the last look


@dataclass(frozen=True)
class Action:
    kind: str  # "start" | "undo"
    target: str
    fault: Fault | None = None


def backoff_delay(fast_deaths: int, base: float, cap: float) -> float:
    """restart_delay x 2^(consecutive fast deaths), capped."""
    return min(cap, base * (2 ** max(0, fast_deaths)))


def decide(
    state: RunState, seen: dict[str, Observation], now: float, base_delay: float, cap: float
) -> tuple[RunState, list[Action], list[tuple[str, str, str]]]:
    """Returns (the new state, actions, events as (kind, target, detail))."""
    actions: list[Action] = []
    events: list[tuple[str, str, str]] = []
    procs = dict(state.procs)
    for name, entry in sorted(state.procs.items()):
        procs[name] = _one(name, entry, seen.get(name), now, base_delay, cap, actions, events)
    for fault in state.faults:
        if not fault.undone and fault.until <= now and fault.kind != "kill":
            actions.append(Action("undo", fault.target, fault))
    return replace(state, procs=procs), actions, events


def _one(
    name: str,
    e: Proc,
    obs: Observation | None,
    now: float,
    base: float,
    cap: float,
    actions: list[Action],
    events: list[tuple[str, str, str]],
) -> Proc:
    status = e.status
    if obs is not None and obs.job_id is not None and e.proc is not None and e.proc.pid == obs.job_id:
        e = replace(e, job=obs.job or _gone(obs.job_id, e.job))
    if status in (ProcStatus.STOPPED, ProcStatus.FINISHED, ProcStatus.STARTING):
        return e
    if status is ProcStatus.PENDING:
        actions.append(Action("start", name))
        return replace(e, status=ProcStatus.STARTING)
    if obs is not None and obs.alive is None:
        if status is not ProcStatus.UNREACHABLE:
            events.append(("host_unreachable", name, f"host {e.host} does not answer; will retry"))
            return replace(e, status=ProcStatus.UNREACHABLE)
        return e
    if status in (ProcStatus.RUNNING, ProcStatus.UNREACHABLE) and obs is not None and obs.alive is False:
        return _died(name, e, obs, now, base, cap, events)
    if status is ProcStatus.UNREACHABLE and obs is not None and obs.alive:
        events.append(("host_back", name, f"host {e.host} answers again; process still alive"))
        return replace(e, status=ProcStatus.RUNNING)
    if status is ProcStatus.DEAD and now >= (e.next_start or 0):
        actions.append(Action("start", name))
        return replace(e, status=ProcStatus.STARTING)
    return e


def _died(
    name: str,
    e: Proc,
    obs: Observation,
    now: float,
    base: float,
    cap: float,
    events: list[tuple[str, str, str]],
) -> Proc:
    e = replace(e, proc=None)
    if obs.finished == "finished":
        events.append(("finished", name, "spent its step/duration budget"))
        return replace(e, status=ProcStatus.FINISHED)
    if obs.finished and e.kind == "syncer":  # restarting cannot help: it would refuse again
        events.append(
            (
                "refused",
                name,
                f"{obs.finished}; not restarted (merges stop; the learners keep "
                "training): restore a checkpoint or set on_no_checkpoint, then start it again",
            )
        )
        return replace(e, status=ProcStatus.STOPPED, reason=obs.finished)
    if obs.finished:
        events.append(("refused", name, f"{obs.finished}; not restarted (fix the cause, then `dldctl learner add`)"))
        return replace(e, status=ProcStatus.STOPPED, reason=obs.finished)  # status: `refused`
    lived = now - (e.started_at if e.started_at is not None else now)
    killed = e.chaos_kill  # killed on purpose: its log says nothing about why
    by = e.killed_by
    if killed:
        e = replace(e, chaos_kill=False, killed_by=None)
    else:
        e = replace(e, fast_deaths=e.fast_deaths + 1 if lived < FAST_DEATH_S else 0)
    delay = backoff_delay(e.fast_deaths, base, cap)
    e = replace(e, next_start=max(now + delay, e.hold_until or 0.0), status=ProcStatus.DEAD)
    kind = "syncer_death" if e.kind == "syncer" else "death"
    said = f"; its log ends: {obs.last_words}" if obs.last_words and not killed else ""
    restart_in = (e.next_start or now) - now
    gone = f"job {e.job.job_id} ended {e.job.describe()}" if e.job is not None else "process gone"
    cause = death_cause(e, killed, restart_in, 0 if killed else obs.ooms, by)
    events.append((kind, name, f"{gone} after {lived:.1f} s{cause}{said}"))
    return e


def _gone(job_id: int, last: JobInfo | None) -> JobInfo:
    """A job the scheduler no longer lists: it ended long enough ago to be forgotten."""
    reason = f"last seen {last.state}" if last is not None and last.job_id == job_id else "no longer listed"
    return JobInfo(job_id, "ENDED", reason)


CHAOS = "`dldctl chaos`"  # who killed a process on purpose, unless its record names another (the live view)


def death_cause(e: Proc, killed: bool, restart_in: float, ooms: int = 0, by: str | None = None) -> str:
    """Why it died as far as the supervisor knows (`ooms`: processes the kernel's OOM killer
    killed on its host meanwhile; `by`: who killed it on purpose, `dldctl chaos` unless said),
    and when it restarts (the backoff said)."""
    why = f" (killed by {by or CHAOS})" if killed else ""
    if ooms:
        fix = "its shards on other hosts" if e.kind == "syncer" else "fewer learners or a smaller batch_size there"
        why = (
            f" (out of memory? the kernel's OOM killer killed {ooms} process{'es' if ooms > 1 else ''} "
            f"on host {e.host} meanwhile: {fix}; docs/troubleshooting.md)"
        )
    backoff = (
        f"; died within {FAST_DEATH_S:.0f} s of its start {e.fast_deaths} time(s) in a row: backing off"
        if e.fast_deaths
        else ""
    )
    return f"{why}{backoff}; restart {e.restarts + 1} in {restart_in:.1f} s"


def started(e: Proc, proc: PidRecord, now: float, job: JobInfo | None = None) -> tuple[Proc, str]:
    """Record a successful start (a submitted `job` on a scheduler site); returns the new record
    and the event kind ('start' or 'restart')."""
    first = e.started_at is None
    e = replace(e, status=ProcStatus.RUNNING, proc=proc, started_at=now, next_start=None, hold_until=None, job=job)
    if not first:
        e = replace(e, restarts=e.restarts + 1)
    return e, "start" if first else "restart"


def start_failed(e: Proc, now: float, base: float, cap: float) -> tuple[Proc, float]:
    """Record a failed start; returns the new record and the delay before the next attempt."""
    fast = e.fast_deaths + 1
    delay = backoff_delay(fast, base, cap)
    return replace(e, fast_deaths=fast, status=ProcStatus.DEAD, proc=None, next_start=now + delay), delay


def resume(state: RunState, records: list[dict[str, Any]], now: float) -> tuple[RunState, list[tuple[str, str, str]]]:
    """A new supervisor's first look: a process its dead predecessor left `starting` is adopted if
    procs.jsonl recorded its start (the previous one died before writing the state), else started
    again. Returns the new state and the events."""
    latest: dict[str, dict[str, Any]] = {}
    for rec in records:
        latest[rec.get("target", "")] = rec
    events: list[tuple[str, str, str]] = []
    for name, e in sorted(state.procs.items()):
        if e.status is not ProcStatus.STARTING:
            continue
        record = latest.get(name)
        if record is not None and float(record.get("t", 0)) > float(e.started_at or 0):
            ref = PidRecord(int(record["pid"]), int(record["start_ticks"]))
            e, kind = started(e, ref, now)
            events.append(
                (
                    kind,
                    name,
                    f"pid {record['pid']} on {e.host} (adopted: the supervisor "
                    "that started it died before recording it)",
                )
            )
        else:
            e = replace(e, status=ProcStatus.PENDING)
        state = state.with_proc(name, e)
    return state, events


def supervisor_health(
    record: Daemon | None, alive: bool, beat: float | None, now: float, run_status: str | None
) -> str:
    """One word for the supervisor: `ok`; `stale` (alive, no heartbeat for STALE_S); `hung` (for
    HUNG_S: the watchdog restarts it); `missing` (its pid is dead or none was recorded: the watchdog
    restarts it); `stopped` (the run is not up, so none should run). `beat` is its last heartbeat,
    None if it never beat (its start time counts as one)."""
    if run_status not in LIVE:
        return "stopped"
    if not record or not alive:
        return "missing"
    heard = last_heard(record, beat)
    age = now - heard if heard is not None else 0.0
    return "hung" if age > HUNG_S else "stale" if age > STALE_S else "ok"


def last_heard(record: Daemon | None, beat: float | None) -> float | None:
    """When the supervisor was last known to work: its last heartbeat or its start, whichever is later."""
    times = [t for t in (beat, record.started if record else None) if isinstance(t, (int, float))]
    return max(times) if times else None
