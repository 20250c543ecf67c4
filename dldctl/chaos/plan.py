"""Chaos plans, pure: the monkey's Poisson schedule, experiment files, checks on snapshots.

No I/O and no clock: the RNG is passed in, experiment files are parsed from a dict, checks are
evaluated against a snapshot dict. The actions that carry a plan out live in inject.py.

A check is `<path> <op> <number>` (no eval): the path walks the `dldctl status --json` snapshot
(`goodput_window`, `quorum.live`, `tokens.merged`, `syncer.alive`, ...), op is one of
>= <= > < == !=; or `<path> rising` (larger at the end than at the start); or
`<path> <op> start [+|- N%]`, a bound relative to the first snapshot that must hold in every
snapshot (`loss.global <= start + 5%`: the global model never more than 5% worse than before the
faults, judged throughout the experiment, not only at its end).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dldctl.chaos import corruption
from dldctl.faults import linkcap
from dldctl.units import parse_duration

ACTIONS = ("kill", "pause", "slow", "partition", "link", "corrupt")
SIGNALS = ("KILL", "TERM")
_CHECK = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(>=|<=|==|!=|>|<)\s*(-?[\d.]+(?:e-?\d+)?|true|false)\s*$")
_RISING = re.compile(r"^\s*([A-Za-z_][\w.]*)\s+rising\s*$")
_RELATIVE = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(>=|<=|>|<)\s*start\s*(?:([+-])\s*([\d.]+)\s*%)?\s*$")


class PlanError(ValueError):
    """A chaos plan or check is malformed; the message names the field."""


@dataclass(frozen=True)
class Fault:
    """One fault: what, to whom, when (seconds from the start), for how long."""

    at: float
    action: str
    target: str
    duration: float = 0.0  # pause/slow/partition/link/corrupt; kill: the time it stays down (down_for)
    factor: float = 3.0  # slow; corrupt: scale's multiplier, bitflip's count
    signal: str = "KILL"  # kill
    rate: str = "1mbit"  # link: the cap (tc's units)
    mode: str = ""  # corrupt (dldctl/chaos/corruption.py)

    def describe(self) -> str:
        extra = {
            "kill": f"signal {self.signal}, down for {self.duration:g} s" if self.duration else f"signal {self.signal}",
            "pause": f"for {self.duration:g} s",
            "slow": f"x{self.factor:g} for {self.duration:g} s",
            "partition": f"for {self.duration:g} s",
            "link": f"{self.rate} for {self.duration:g} s",
            "corrupt": f"{self._corruption()} for {self.duration:g} s",
        }[self.action]
        return f"t+{self.at:7.1f}s {self.action:<9} {self.target:<10} {extra}"

    def _corruption(self) -> str:
        return f"{self.mode} x{self.factor:g}" if self.mode in corruption.DEFAULT_FACTOR else self.mode


@dataclass(frozen=True)
class Check:
    """A condition on a snapshot."""

    path: str
    op: str
    value: float = 0.0
    text: str = ""
    relative: float | None = None  # `<op> start +/- N%`: the bound is start x (1 + relative)

    @property
    def throughout(self) -> bool:
        """Checked in every snapshot, not only the first and the last."""
        return self.relative is not None

    def holds(self, snap: dict[str, Any], first: dict[str, Any] | None = None) -> bool:
        """Whether it holds now (`first`: the snapshot at the start, for `rising`)."""
        current = lookup(snap, self.path)
        if self.op == "rising":
            start = lookup(first or {}, self.path)
            return current is not None and start is not None and float(current) > float(start)
        if current is None:
            return False
        a, b = float(current), self.value
        if self.relative is not None:
            start = lookup(first or snap, self.path)
            if start is None:
                return False
            b = float(start) * (1.0 + self.relative)
        return {">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b, "==": a == b, "!=": a != b}[self.op]


def lookup(snap: dict[str, Any], path: str) -> Any:
    """Walk a dotted path in a snapshot; None if any part is missing."""
    node: Any = snap
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, bool):
        return float(node)
    return node if isinstance(node, (int, float)) else None


def parse_check(text: str) -> Check:
    """`goodput_window >= 0.8`, `quorum.live >= 3`, `tokens.merged rising`."""
    m = _RISING.match(text)
    if m:
        return Check(m.group(1), "rising", 0.0, text.strip())
    m = _RELATIVE.match(text)
    if m:
        sign = -1.0 if m.group(3) == "-" else 1.0
        return Check(m.group(1), m.group(2), 0.0, text.strip(), sign * float(m.group(4) or 0) / 100.0)
    m = _CHECK.match(text)
    if not m:
        raise PlanError(
            f"check {text!r} is not '<path> <op> <number>', '<path> rising' or "
            "'<path> <op> start + N%' (e.g. 'quorum.live >= 3', 'loss.global <= start + 5%')"
        )
    raw = m.group(3)
    value = 1.0 if raw == "true" else 0.0 if raw == "false" else float(raw)
    return Check(m.group(1), m.group(2), value, text.strip())


def monkey_schedule(
    rng: random.Random,
    *,
    mtbf_s: float,
    duration_s: float,
    targets: Sequence[str],
    actions: Sequence[str],
    fault_s: float = 10.0,
    slow_factor: float = 3.0,
    down_for_s: float = 0.0,
    link_rate: str = "1mbit",
) -> list[Fault]:
    """Faults at exponential gaps (a Poisson process of mean gap `mtbf_s`) over `duration_s`; a
    corrupt fault's mode is drawn from the same generator (only for a corrupt fault: a schedule
    without one is the same as before corrupt existed)."""
    if mtbf_s <= 0 or duration_s <= 0:
        raise PlanError("mtbf and duration must be > 0")
    if not targets or not actions:
        raise PlanError("the monkey needs at least one target and one action")
    bad = [a for a in actions if a not in ACTIONS]
    if bad:
        raise PlanError(f"unknown action {bad[0]!r}; use {', '.join(ACTIONS)}")
    out: list[Fault] = []
    t = rng.expovariate(1.0 / mtbf_s)
    while t < duration_s:
        action = rng.choice(list(actions))
        target = rng.choice(list(targets))
        duration = down_for_s if action == "kill" else fault_s
        if action == "corrupt":
            mode = rng.choice(corruption.MODES)
            fault = Fault(round(t, 3), action, target, duration, corruption.factor_of(mode, None), mode=mode)
        else:
            fault = Fault(round(t, 3), action, target, duration, slow_factor, rate=link_rate)
        out.append(fault)
        t += rng.expovariate(1.0 / mtbf_s)
    return out


@dataclass(frozen=True)
class Experiment:
    """A declarative chaos experiment."""

    name: str
    duration: float
    faults: tuple[Fault, ...]
    steady: tuple[Check, ...] = ()
    aborts: tuple[Check, ...] = ()
    settle_s: float = 20.0  # after the last fault, time to recover before the final check
    sample_every: float = 1.0
    heal_on_abort: bool = True
    path: str = ""


def _fault(entry: Any, i: int) -> Fault:
    if not isinstance(entry, dict):
        raise PlanError(f"[[fault]] #{i + 1} must be a table")
    known = {"at", "action", "target", "duration", "factor", "signal", "down_for", "rate", "mode"}
    extra = set(entry) - known
    if extra:
        raise PlanError(f"[[fault]] #{i + 1}: unknown key {sorted(extra)[0]!r} (known: {', '.join(sorted(known))})")
    for key in ("at", "action", "target"):
        if key not in entry:
            raise PlanError(f"[[fault]] #{i + 1}: missing {key!r}")
    action = entry["action"]
    if action not in ACTIONS:
        raise PlanError(f"[[fault]] #{i + 1}: action {action!r} is not one of {', '.join(ACTIONS)}")
    signal = str(entry.get("signal", "KILL")).upper()
    if signal not in SIGNALS:
        raise PlanError(f"[[fault]] #{i + 1}: signal must be KILL or TERM")
    where = f"[[fault]] #{i + 1}"
    key = "down_for" if "down_for" in entry else "duration"
    duration = seconds(entry.get(key, 0.0 if action == "kill" else 10.0), f"{where} {key}")
    if action != "kill" and duration <= 0:
        raise PlanError(f"{where}: {action} needs duration > 0")
    factor = number(entry.get("factor", 3.0), f"{where} factor")
    if action == "slow" and factor <= 1.0:
        raise PlanError(f"{where} factor: a slow fault needs factor > 1 (how many times slower), got {factor:g}")
    rate = str(entry.get("rate", "1mbit"))
    if action == "link":
        try:
            linkcap.parse_rate(rate)
        except linkcap.LinkCapError as exc:
            raise PlanError(f"{where} rate: {exc}") from None
    mode = _mode(entry, action, where)
    if mode:
        factor = _corrupt_factor(mode, entry.get("factor"), where)
    at = seconds(entry["at"], f"{where} at")
    return Fault(at, action, str(entry["target"]), duration, factor, signal, rate, mode)


def _mode(entry: dict[str, Any], action: str, where: str) -> str:
    """A corrupt fault's mode ("" for the other actions, which take none)."""
    if action != "corrupt":
        if "mode" in entry:
            raise PlanError(f"{where} mode: only a corrupt fault has a mode; leave it out of a {action} fault")
        return ""
    if "mode" not in entry:
        raise PlanError(f"{where}: a corrupt fault needs mode = one of {', '.join(corruption.MODES)}")
    try:
        corruption.check_mode(str(entry["mode"]))
    except ValueError as exc:
        raise PlanError(f"{where} mode: {exc}") from None
    return str(entry["mode"])


def _corrupt_factor(mode: str, given: Any, where: str) -> float:
    try:
        return corruption.factor_of(mode, None if given is None else number(given, f"{where} factor"))
    except ValueError as exc:
        if isinstance(exc, PlanError):
            raise
        raise PlanError(f"{where} factor: {exc}") from None


def seconds(value: Any, where: str) -> float:
    """A duration in seconds from a number or a string such as "30s", "5m", "800ms" (>= 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise PlanError(f'{where}: must be seconds or a duration such as "30s", got {value!r}')
    try:
        out = parse_duration(value) if isinstance(value, str) else float(value)
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}") from None
    if not 0.0 <= out < float("inf"):
        raise PlanError(f"{where}: must be >= 0 seconds, got {value!r}")
    return out


def number(value: Any, where: str) -> float:
    """A plain finite number, or a PlanError naming where it was wanted."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise PlanError(f"{where}: must be a number, got {value!r}")
    return float(value)


def _only(table: Any, known: set[str], where: str) -> None:
    if not isinstance(table, dict):
        raise PlanError(f"{where} must be a table")
    extra = set(table) - known
    if extra:
        raise PlanError(f"{where}: unknown key {sorted(extra)[0]!r} (known: {', '.join(sorted(known))})")


def _check_entry(entry: Any, table: str, i: int) -> Check:
    _only(entry, {"check"}, f"[[{table}]] #{i + 1}")
    if "check" not in entry:
        raise PlanError(f'[[{table}]] #{i + 1}: missing check = "<path> <op> <number>"')
    return parse_check(str(entry["check"]))


def parse_experiment(data: dict[str, Any], path: str = "") -> Experiment:
    """An Experiment from a TOML document (see docs/chaos.md for the format)."""
    known = {"experiment", "steady_state", "fault", "abort", "rollback"}
    extra = set(data) - known
    if extra:
        raise PlanError(f"unknown table [{sorted(extra)[0]}] (known: {', '.join(sorted(known))})")
    head = data.get("experiment", {})
    _only(head, {"name", "duration", "settle", "sample_every"}, "[experiment]")
    _only(data.get("rollback", {}), {"heal"}, "[rollback]")
    faults = tuple(sorted((_fault(e, i) for i, e in enumerate(data.get("fault", []))), key=lambda f: f.at))
    if not faults:
        raise PlanError("an experiment needs at least one [[fault]]")
    steady = tuple(_check_entry(e, "steady_state", i) for i, e in enumerate(data.get("steady_state", [])))
    aborts = tuple(_check_entry(e, "abort", i) for i, e in enumerate(data.get("abort", [])))
    settle = seconds(head.get("settle", 20.0), "[experiment] settle")
    duration = seconds(head.get("duration", max(f.at + f.duration for f in faults) + settle), "[experiment] duration")
    every = seconds(head.get("sample_every", 1.0), "[experiment] sample_every")
    if every <= 0:
        raise PlanError("[experiment] sample_every: must be > 0 seconds")
    return Experiment(
        str(head.get("name", "experiment")),
        duration,
        faults,
        steady,
        aborts,
        settle,
        every,
        bool(data.get("rollback", {}).get("heal", True)),
        path,
    )


@dataclass
class FaultReport:
    """What happened to one fault, from the events and the snapshots."""

    fault: Fault
    injected_at: float | None = None
    detected_at: float | None = None
    back_at: float | None = None
    work_lost_tokens: int | None = None
    goodput_during: float | None = None
    goodput_after: float | None = None

    def to_dict(self) -> dict[str, Any]:
        rel = lambda t: None if t is None or self.injected_at is None else round(t - self.injected_at, 2)
        return {
            "fault": self.fault.describe().strip(),
            "action": self.fault.action,
            "target": self.fault.target,
            "injected_at": self.injected_at,
            "detected_after_s": rel(self.detected_at),
            "back_after_s": rel(self.back_at),
            "work_lost_tokens": self.work_lost_tokens,
            "goodput_during": self.goodput_during,
            "goodput_after": self.goodput_after,
        }


@dataclass
class Result:
    """The verdict of an experiment."""

    passed: bool
    reasons: list[str] = field(default_factory=list)
    faults: list[FaultReport] = field(default_factory=list)
    aborted: str | None = None
    files: list[str] = field(default_factory=list)  # the report files written (chaos/<name>-<time>.json, .md)
