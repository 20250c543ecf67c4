"""The supervisor's decisions, as a pure function of the run state, what it observed, and `now`.

Each process (the syncer, every learner) has an entry in `state["procs"]`:
    {"kind": "syncer"|"learner", "host": str, "status": str, "proc": {"pid", "start_ticks"}|null,
     "restarts": int, "fast_deaths": int, "started_at": float|null, "next_start": float|null,
     "hold_until": float|null, "chaos_kill": bool}
status: pending -> starting -> running -> dead -> (restart) starting -> ...; also unreachable
(its host does not answer), finished (a learner that spent its budget), stopped (removed/down).

`decide` returns the actions to carry out (start a process, undo an expired fault) and the
events to record; the supervisor does the I/O. Deaths caused by chaos do not count towards
the crash-loop backoff.

The supervisor is watched too (dldctl/supervise/watchdog.py): `supervisor_health` is the rule by which the
watchdog restarts it and `dldctl status` reports it, and `resume` is what a restarted supervisor
makes of the processes its predecessor was in the middle of starting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Action:
    kind: str  # "start" | "undo"
    target: str
    fault: dict | None = None


def backoff_delay(fast_deaths: int, base: float, cap: float) -> float:
    """restart_delay x 2^(consecutive fast deaths), capped."""
    return min(cap, base * (2 ** max(0, fast_deaths)))


def decide(
    state: dict[str, Any], seen: dict[str, Observation], now: float, base_delay: float, cap: float
) -> tuple[list[Action], list[tuple[str, str, str]]]:
    """Update `state` in place; return (actions, events as (kind, target, detail))."""
    actions: list[Action] = []
    events: list[tuple[str, str, str]] = []
    for name, entry in sorted(state["procs"].items()):
        _one(name, entry, seen.get(name), now, base_delay, cap, actions, events)
    for fault in state.get("faults", []):
        if not fault.get("undone") and fault.get("until", 0) <= now and fault["kind"] != "kill":
            actions.append(Action("undo", fault["target"], fault))
    return actions, events


def _one(
    name: str,
    e: dict[str, Any],
    obs: Observation | None,
    now: float,
    base: float,
    cap: float,
    actions: list[Action],
    events: list[tuple[str, str, str]],
) -> None:
    status = e["status"]
    if status in ("stopped", "finished", "starting"):
        return
    if status == "pending":
        e["status"] = "starting"
        actions.append(Action("start", name))
        return
    if obs is not None and obs.alive is None:
        if status != "unreachable":
            events.append(("host_unreachable", name, f"host {e['host']} does not answer; will retry"))
            e["status"] = "unreachable"
        return
    if status in ("running", "unreachable") and obs is not None and obs.alive is False:
        _died(name, e, obs, now, base, cap, events)
        return
    if status == "unreachable" and obs is not None and obs.alive:
        e["status"] = "running"
        events.append(("host_back", name, f"host {e['host']} answers again; process still alive"))
        return
    if status == "dead" and now >= (e.get("next_start") or 0):
        e["status"] = "starting"
        actions.append(Action("start", name))


def _died(
    name: str,
    e: dict[str, Any],
    obs: Observation,
    now: float,
    base: float,
    cap: float,
    events: list[tuple[str, str, str]],
) -> None:
    e["proc"] = None
    if obs.finished == "finished":
        e["status"] = "finished"
        events.append(("finished", name, "spent its step/duration budget"))
        return
    if obs.finished and e["kind"] == "syncer":  # restarting cannot help: it would refuse again
        e["status"] = "stopped"
        events.append(
            (
                "refused",
                name,
                f"{obs.finished}; not restarted (merges stop; the learners keep "
                "training): restore a checkpoint or set on_no_checkpoint, then start it again",
            )
        )
        return
    if obs.finished:
        e["status"] = "stopped"
        events.append(("refused", name, f"{obs.finished}; not restarted (fix the cause, then `dldctl learner add`)"))
        return
    lived = now - (e["started_at"] if e.get("started_at") is not None else now)
    killed = bool(e.get("chaos_kill"))  # killed on purpose: its log says nothing about why
    if killed:
        e["chaos_kill"] = False
    elif lived < FAST_DEATH_S:
        e["fast_deaths"] = e.get("fast_deaths", 0) + 1
    else:
        e["fast_deaths"] = 0
    delay = backoff_delay(e.get("fast_deaths", 0), base, cap)
    e["next_start"] = max(now + delay, e.get("hold_until") or 0.0)
    e["status"] = "dead"
    kind = "syncer_death" if e["kind"] == "syncer" else "death"
    said = f"; its log ends: {obs.last_words}" if obs.last_words and not killed else ""
    events.append((kind, name, f"process gone after {lived:.1f} s; restart in {e['next_start'] - now:.1f} s{said}"))


def started(e: dict[str, Any], proc: dict[str, int], now: float) -> str:
    """Record a successful start; returns the event kind ('start' or 'restart')."""
    first = e.get("started_at") is None
    e.update(status="running", proc=proc, started_at=now, next_start=None, hold_until=None)
    if not first:
        e["restarts"] = e.get("restarts", 0) + 1
    return "start" if first else "restart"


def start_failed(e: dict[str, Any], now: float, base: float, cap: float) -> float:
    """Record a failed start; returns the delay before the next attempt."""
    e["fast_deaths"] = e.get("fast_deaths", 0) + 1
    delay = backoff_delay(e["fast_deaths"], base, cap)
    e.update(status="dead", proc=None, next_start=now + delay)
    return delay


def new_proc(kind: str, host: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "host": host,
        "status": "pending",
        "proc": None,
        "restarts": 0,
        "fast_deaths": 0,
        "started_at": None,
        "next_start": None,
        "hold_until": None,
        "chaos_kill": False,
    }


def resume(state: dict[str, Any], records: list[dict[str, Any]], now: float) -> list[tuple[str, str, str]]:
    """A new supervisor's first look: a process its dead predecessor left `starting` is adopted if
    procs.jsonl recorded its start (the previous one died before writing the state), else started
    again. Returns the events; updates `state` in place."""
    latest: dict[str, dict[str, Any]] = {}
    for rec in records:
        latest[rec.get("target", "")] = rec
    events: list[tuple[str, str, str]] = []
    for name, e in sorted(state["procs"].items()):
        if e["status"] != "starting":
            continue
        record = latest.get(name)
        if record is not None and float(record.get("t", 0)) > float(e.get("started_at") or 0):
            kind = started(e, {"pid": int(record["pid"]), "start_ticks": int(record["start_ticks"])}, now)
            events.append(
                (
                    kind,
                    name,
                    f"pid {record['pid']} on {e['host']} (adopted: the supervisor "
                    "that started it died before recording it)",
                )
            )
        else:
            e["status"] = "pending"
    return events


def supervisor_health(
    record: dict[str, Any] | None, alive: bool, beat: float | None, now: float, run_status: str | None
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


def last_heard(record: dict[str, Any] | None, beat: float | None) -> float | None:
    """When the supervisor was last known to work: its last heartbeat or its start, whichever is later."""
    times = [t for t in (beat, (record or {}).get("started")) if isinstance(t, (int, float))]
    return max(times) if times else None
