"""The verdict and per-fault report of a chaos experiment, as a pure function of what was seen.

Inputs are the snapshots sampled during the experiment (`dldctl status --json` form), the
events of the run, and when each fault was injected. For every fault: when the syncer (or the
supervisor) noticed it, when the target was back, the work it lost, and the goodput during and
after. The experiment passes when its steady-state checks hold before the first fault and again
after the system has settled, and no abort condition fired.
"""

from __future__ import annotations

from typing import Any

from dldctl import shards
from dldctl.chaos.plan import Experiment, FaultReport, Result, lookup

DETECT = {
    "kill": ("death", "learner_lost", "syncer_death"),
    "pause": ("learner_lost",),
    "partition": ("learner_lost",),
    "slow": (),
    "link": (),
    # the syncer refused one of its pushes: malformed or non-finite (reject), or judged out by its
    # screen (contribution_rejected, then quarantined: syncer/screening.py)
    "corrupt": ("reject", "contribution_rejected", "quarantined"),
}
# recovery = the syncer hears the learner again; a fault too short to be noticed by the syncer
# (no detection event) counts as back when it is undone
BACK = {
    "kill": ("rejoin", "learner_back", "syncer_resume", "syncer_start"),
    "pause": ("learner_back",),
    "partition": ("learner_back",),
    "slow": ("fault_undo",),
    "link": ("fault_undo",),
    "corrupt": ("fault_undo",),
}
AFTER_S = 30.0


def _first_event(events: list[dict[str, Any]], kinds: tuple[str, ...], target: str, since: float) -> float | None:
    for e in events:
        if e.get("t", 0) >= since and e.get("kind") in kinds and e.get("target") == target:
            return float(e["t"])
    return None


def _row(snap: dict[str, Any], target: str) -> dict[str, Any] | None:
    return next((r for r in snap.get("learners", []) if r.get("id") == target), None)


def _slow_seen(samples: list[dict[str, Any]], target: str, since: float) -> float | None:
    for s in samples:
        row = _row(s, target)
        if s.get("now", 0) >= since and row and (row.get("state") == "slow" or row.get("straggler")):
            return float(s["now"])
    return None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _goodput(samples: list[dict[str, Any]], start: float, end: float) -> float | None:
    return _mean(
        [
            float(s["goodput_window"])
            for s in samples
            if start <= s.get("now", 0) <= end and isinstance(s.get("goodput_window"), (int, float))
        ]
    )


def _work_lost(samples: list[dict[str, Any]], target: str, at: float) -> int | None:
    before = [s for s in samples if s.get("now", 0) <= at]
    row = _row(before[-1], target) if before else None
    if not row or "merged_tokens" not in row:
        return None
    return max(0, int(row.get("tokens", 0) - row["merged_tokens"]))


def fault_report(
    exp: Experiment,
    i: int,
    injected: float | None,
    samples: list[dict[str, Any]],
    events: list[dict[str, Any]],
    end: float,
) -> FaultReport:
    fault = exp.faults[i]
    rep = FaultReport(fault, injected)
    if injected is None:
        return rep
    target = fault.target
    rep.detected_at = (
        _slow_seen(samples, target, injected)
        if fault.action == "slow"
        else _first_event(events, DETECT[fault.action], target, injected)
    )
    back = BACK[fault.action]
    if shards.shard_of(target):  # shard N's own events are in its directory: the supervisor's restart says it
        back += ("restart",)
    rep.back_at = _first_event(events, back, target, rep.detected_at or injected)
    if rep.detected_at is None and fault.action in ("pause", "partition"):
        rep.back_at = _first_event(events, ("fault_undo",), target, injected)
    if fault.action == "kill" and shards.shard_of(target) is None:
        rep.work_lost_tokens = _work_lost(samples, target, injected)
    rep.goodput_during = _goodput(samples, injected, rep.back_at or end)
    if rep.back_at is not None:
        rep.goodput_after = _goodput(samples, rep.back_at, rep.back_at + AFTER_S)
    return rep


def evaluate(
    exp: Experiment,
    samples: list[dict[str, Any]],
    events: list[dict[str, Any]],
    injected: list[float | None],
    aborted: str | None = None,
) -> Result:
    """Pass/fail with reasons, and the per-fault reports."""
    result = Result(passed=True, aborted=aborted)
    if not samples:
        return Result(False, ["no snapshot could be taken"], aborted=aborted)
    first, last = samples[0], samples[-1]
    for check in exp.steady:
        if check.op != "rising" and not check.holds(first):
            result.passed = False
            result.reasons.append(f"steady state did not hold before the faults: {check.text}")
        if not check.holds(last, first):
            result.passed = False
            result.reasons.append(f"steady state not restored at the end: {check.text}")
    for check in exp.steady:
        broken = next(
            (
                snap
                for snap in samples
                if check.throughout and lookup(snap, check.path) is not None and not check.holds(snap, first)
            ),
            None,
        )  # unknown in between (syncer away): not judged
        if broken is not None:
            result.passed = False
            start, value = lookup(first, check.path), lookup(broken, check.path)
            result.reasons.append(
                f"steady state broken during the experiment: {check.text} "
                f"({value} at t={float(broken.get('now', 0)) - float(first.get('now', 0)):.0f} s, "
                f"{start} at the start)"
            )
    if aborted:
        result.passed = False
        result.reasons.append(f"aborted: {aborted}")
    end = float(last.get("now", 0))
    result.faults = [fault_report(exp, i, t, samples, events, end) for i, t in enumerate(injected)]
    for rep in result.faults:
        if rep.injected_at is None:
            result.passed = False
            result.reasons.append(f"not injected: {rep.fault.describe().strip()}")
    return result


def markdown(exp: Experiment, result: Result) -> str:
    """A human-readable report."""
    lines = [f"# chaos experiment: {exp.name}", "", f"**verdict: {'PASS' if result.passed else 'FAIL'}**", ""]
    lines += [f"- {r}" for r in result.reasons] + ([""] if result.reasons else [])
    lines += [
        "| fault | detected after | back after | work lost (tokens) | goodput during | goodput after |",
        "|---|---|---|---|---|---|",
    ]
    for rep in result.faults:
        d = rep.to_dict()
        fmt = lambda v, suffix="": (
            "-" if v is None else (f"{v:.2f}{suffix}" if isinstance(v, float) else f"{v}{suffix}")
        )
        lines.append(
            f"| {d['fault']} | {fmt(d['detected_after_s'], ' s')} | {fmt(d['back_after_s'], ' s')} | "
            f"{fmt(d['work_lost_tokens'])} | {fmt(d['goodput_during'])} | {fmt(d['goodput_after'])} |"
        )
    return "\n".join(lines) + "\n"
