"""Alerts, the pure part: which records become alerts, the rate limit, and the JSON an alert
carries. No I/O: the clock comes in as an argument; the [alerts] table is dldctl/alertspec.py,
sending (a command, a webhook) dldctl/supervise/alertsend.py.

An event kind in `on` alerts on each such events.jsonl record. Two kinds are derived here:
`crash_loop` (a process died `crash_loop_deaths` times within `crash_loop_window_s`; deaths a
`dldctl chaos kill` caused do not count, as in the supervisor's restart backoff) and
`below_quorum` (fewer live learners than the quorum for longer than `below_quorum_s`, from the
syncer's quorum_lost/quorum_regained events and its metrics samples; not before the fleet first
reached its quorum, so a slow start is no alert). An alert held back by the rate limit is counted,
and the next one of that kind and target says how many were.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from dldctl.alertspec import DERIVED, AlertsSpec

DEATHS = ("death", "syncer_death")
STALE_S = 900.0  # a record older than this when read (a backlog) updates the state but alerts no one


# -- alerts and their payload ----------------------------------------------------------------


@dataclass(frozen=True)
class Alert:
    """One alert: the event (or derived condition) that caused it."""

    kind: str
    target: str
    detail: str
    t: float  # when it happened (the event's time)
    suppressed: int = 0  # alerts of this kind and target held back by the rate limit since the last one
    event: dict[str, Any] | None = None  # the events.jsonl record, if one caused it


def text(alert: Alert, run: str) -> str:
    """A one-line summary, for chat webhooks (Slack and Mattermost show `text`) and logs."""
    more = f" (+{alert.suppressed} similar held back)" if alert.suppressed else ""
    return f"dldctl run {run}: {alert.kind} {alert.target}: {alert.detail}{more}"


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat(timespec="seconds")


def payload(alert: Alert, run: str, run_dir: str = "") -> dict[str, Any]:
    """The JSON a command reads on stdin and a webhook receives."""
    return {
        "source": "dldctl",
        "run": run,
        "run_dir": run_dir,
        "kind": alert.kind,
        "target": alert.target,
        "detail": alert.detail,
        "t": alert.t,
        "time": iso(alert.t),
        "suppressed": alert.suppressed,
        "text": text(alert, run),
        "event": alert.event,
    }


def env_vars(alert: Alert, run: str, run_dir: str = "") -> dict[str, str]:
    """The DLDCTL_ALERT_* variables a command gets (besides the JSON on stdin)."""
    return {
        "DLDCTL_ALERT_KIND": alert.kind,
        "DLDCTL_ALERT_TARGET": alert.target,
        "DLDCTL_ALERT_DETAIL": alert.detail,
        "DLDCTL_ALERT_RUN": run,
        "DLDCTL_ALERT_RUN_DIR": run_dir,
        "DLDCTL_ALERT_TIME": iso(alert.t),
        "DLDCTL_ALERT_SUPPRESSED": str(alert.suppressed),
        "DLDCTL_ALERT_TEXT": text(alert, run),
    }


# -- rules -----------------------------------------------------------------------------------


class RateLimit:
    """At most one alert per (kind, target) every `min_interval_s`; the rest are counted."""

    def __init__(self, min_interval_s: float) -> None:
        self.min_interval_s = min_interval_s
        self.last: dict[tuple[str, str], float] = {}
        self.held: dict[tuple[str, str], int] = {}

    def admit(self, alert: Alert, now: float) -> Alert | None:
        """The alert to send (with the count held back before it), or None if held back."""
        key = (alert.kind, alert.target)
        last = self.last.get(key)
        if last is not None and now - last < self.min_interval_s:
            self.held[key] = self.held.get(key, 0) + 1
            return None
        self.last[key] = now
        return replace(alert, suppressed=self.held.pop(key, 0))


@dataclass
class BelowQuorum:
    """The below-quorum timer: an episode starts when the live learners fall under the quorum
    (after the fleet first reached it) and ends when they are back; `due` fires once per episode."""

    after_s: float
    reached: bool = False  # the fleet has had its quorum once
    since: float | None = None  # the episode's start
    fired: bool = False
    latest: str = ""  # the latest "N live learners, minimum quorum Q"

    def on_event(self, record: dict[str, Any]) -> None:
        kind, t = record.get("kind"), _t(record)
        if kind in ("quorum_reached", "quorum_regained"):  # a fleet's first quorum, or its quorum back
            self._above(t)
        elif kind == "quorum_lost":
            self.latest = str(record.get("detail", ""))
            self._below(t)

    def on_sample(self, record: dict[str, Any]) -> None:
        live, least = record.get("quorum_live"), record.get("quorum_min")
        if not isinstance(live, int) or not isinstance(least, int):
            return
        self.latest = f"{live} live learners, minimum quorum {least}"
        if live >= least:
            self._above(_t(record))
        elif self.reached:
            self._below(_t(record))

    def _above(self, t: float) -> None:
        if self.since is not None and t < self.since:
            return  # an older record than the one that started the episode
        self.reached, self.since, self.fired = True, None, False

    def _below(self, t: float) -> None:
        if self.since is None:
            self.reached, self.since, self.fired = True, t, False

    def due(self, now: float) -> Alert | None:
        if self.since is None or self.fired or now - self.since < self.after_s:
            return None
        self.fired = True
        detail = f"below quorum for {now - self.since:.0f} s (since {iso(self.since)}): {self.latest}"
        return Alert("below_quorum", "syncer", detail, now)


@dataclass
class CrashLoop:
    """Deaths per process within a window; chaos kills (a `fault_inject` kill just before) do not count."""

    deaths: int
    window_s: float
    seen: dict[str, list[float]] = field(default_factory=dict)
    chaos: set[str] = field(default_factory=set)

    def on_event(self, record: dict[str, Any]) -> Alert | None:
        kind, target = record.get("kind"), str(record.get("target", ""))
        if kind == "fault_inject" and str(record.get("detail", "")).startswith("kill"):
            self.chaos.add(target)
            return None
        if kind not in DEATHS:
            return None
        if target in self.chaos:
            self.chaos.discard(target)
            return None
        t = _t(record)
        times = [x for x in self.seen.get(target, []) if t - x <= self.window_s] + [t]
        if len(times) < self.deaths:
            self.seen[target] = times
            return None
        self.seen.pop(target, None)  # a new loop needs as many deaths again
        detail = f"{len(times)} deaths in {t - times[0]:.0f} s; the last: {record.get('detail', '')}"
        return Alert("crash_loop", target, detail, t, event=record)


class Rules:
    """The whole rule set of one run: records and ticks in, alerts (already rate-limited) out."""

    def __init__(self, spec: AlertsSpec) -> None:
        self.on = frozenset(spec.on)
        self.limit = RateLimit(spec.min_interval_s)
        self.quorum = BelowQuorum(spec.below_quorum_s)
        self.loops = CrashLoop(spec.crash_loop_deaths, spec.crash_loop_window_s)

    def events(self, records: list[dict[str, Any]], now: float) -> list[Alert]:
        out: list[Alert] = []
        for record in records:
            self.quorum.on_event(record)
            looped = self.loops.on_event(record)
            fresh = now - _t(record) <= STALE_S
            kind = str(record.get("kind", ""))
            if fresh and kind in self.on and kind not in DERIVED:
                alert = Alert(kind, str(record.get("target", "")), str(record.get("detail", "")), _t(record))
                out.append(replace(alert, event=record))
            if fresh and looped is not None and "crash_loop" in self.on:
                out.append(looped)
        return self._admit(out, now)

    def metrics(self, records: list[dict[str, Any]], now: float) -> list[Alert]:
        for record in records:
            if record.get("kind") == "sample":
                self.quorum.on_sample(record)
        return self.tick(now)

    def tick(self, now: float) -> list[Alert]:
        due = self.quorum.due(now)
        return self._admit([due], now) if due is not None and "below_quorum" in self.on else []

    def _admit(self, alerts: list[Alert], now: float) -> list[Alert]:
        return [a for a in (self.limit.admit(x, now) for x in alerts) if a is not None]


def _t(record: dict[str, Any]) -> float:
    t = record.get("t")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0
