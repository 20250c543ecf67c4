"""The bad-learner classes of bench/integrity.py (issue 51): one learner of the fleet keeps running
and is wrong, for `--bad-for` seconds (60) and for the rest of the run, through
`dldctl chaos corrupt` (docs/chaos.md): a non-finite loss; its weights scaled x1e6 and x10; its
outer gradients' sign flipped; replaced by noise of the same norm; a few exponent bits flipped
(silent data corruption). Judged, beside integrity's columns (final vs the clean run at equal
merged tokens, worst score after the fault against the last before):

- **quarantined s / rejected first**: seconds from the fault to the bad learner's `quarantined`
  event, and how many of its contributions were rejected by then (from the event); a non-finite
  loss is caught by the learner itself (it reloads), not by the syncer;
- **others quarantined**: quarantines of any other learner (false positives): 0;
- **healthy worst**: the healthy learners' train loss (the EMA each learner reports in the
  samples, about one a second; smoothed again over `SMOOTH` samples: one batch is 256 tokens) at
  its worst after the fault, against its mean over the `SMOOTH` samples before: at most 5% above;
- **rate vs without**: the global loss's drop per second over the fault's window (`at` to
  `at + duration`: the slope of a line through the scores in it, by time since training
  started), against the same fleet without the bad learner (one learner fewer, no fault) over
  the same window: at least 90%;
- **final vs without** (bench/integrity.py): the final model against that fleet without the bad
  learner at equal merged tokens, and **without vs clean**, that fleet's own final against the
  clean run's: what losing a learner costs by itself. A `_rest` class is held to the fleet
  without it (2%): shutting the bad learner out is the best any defence can do, and at a
  constant inner lr a smaller fleet's plateau is higher (its averaged outer gradient noisier).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from typing import Any

BAD = "learner-1"
REST_S = 100_000.0  # "for the rest of the run": longer than any run
TARGET_HEALTHY, TARGET_RATE = 0.05, 0.9
SMOOTH = 5
MIN_POINTS = 10  # scores in a fault window before its rate is measured
MODES: dict[str, tuple[str, str | None]] = {  # class -> (mode, factor)
    "nan": ("nan", None),
    "scale1e6": ("scale", "1e6"),
    "scale10": ("scale", "10"),
    "signflip": ("signflip", None),
    "noise": ("noise", None),
    "bitflip": ("bitflip", None),
}


def corrupt(mode: str, factor: str | None, seconds: float) -> Callable[[Any, threading.Event, float], str]:
    """The fault: `dldctl chaos corrupt learner-1` for `seconds` (the class's duration). A
    command that fails raises: the run is then reported with the error, never judged as if the
    learner had gone bad."""

    def fault(fleet: Any, stop: threading.Event, _d: float) -> str:
        args = ["chaos", "corrupt", BAD, "--mode", mode, "--duration", f"{seconds:g}s"]
        args += ["--factor", factor] if factor else []
        proc = fleet.dl(*args, check=False, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"dldctl {' '.join(args)} -> {proc.returncode}: {proc.stderr.strip()[-500:]}")
        return f"dldctl {' '.join(args)} -> 0"

    return fault


def classes(seconds: float) -> dict[str, tuple[Any, float, dict[str, Any]]]:
    """integrity's table entries: bad_<kind>_<seconds>s and bad_<kind>_rest for every kind."""
    out: dict[str, tuple[Any, float, dict[str, Any]]] = {}
    for kind, (mode, factor) in MODES.items():
        out[f"bad_{kind}_{seconds:g}s"] = (corrupt(mode, factor, seconds), seconds, {})
        # the rest of the run: the window is as long as the timed class's, the fault never ends
        out[f"bad_{kind}_rest"] = (corrupt(mode, factor, REST_S), seconds, {})
    return out


def columns(name: str, res: dict[str, Any], seconds: float, without: dict[str, Any] | None) -> dict[str, Any]:
    """The bad-learner columns of one run (see the module docstring)."""
    inspect = res.get("inspect") or {}
    t_fault = (res.get("chaos") or {}).get("t") or res["training_started"]
    events = inspect.get("events", [])
    mine = [e for e in events if e["kind"] == "quarantined" and e["target"] == BAD and e["t"] >= t_fault]
    first = mine[0] if mine else None
    rejected = re.search(r"(\d+) of its contributions rejected", first["detail"]) if first else None
    out: dict[str, Any] = {
        "quarantined s": None if first is None else round(first["t"] - t_fault, 1),
        "rejected first": int(rejected.group(1)) if rejected else None,
        "others quarantined": sum(1 for e in events if e["kind"] == "quarantined" and e["target"] != BAD),
        "healthy worst": healthy_worst(inspect.get("learner_loss", []), t_fault),
        "rate vs without": None,
    }
    if without is not None:
        window = (res["training_started"], t_fault, t_fault + seconds)
        out["rate vs without"] = rate_ratio(res, without, window)
    caught = "nan" in name or first is not None  # a learner catches its own non-finite loss
    out["bad met"] = bool(
        (res.get("chaos") or {}).get("t") is not None  # the fault was injected
        and caught
        and out["others quarantined"] == 0
        and (out["healthy worst"] is None or out["healthy worst"] <= TARGET_HEALTHY)
        and (out["rate vs without"] is None or out["rate vs without"] >= TARGET_RATE)
    )
    return out


def healthy_worst(samples: list[list[Any]], t_fault: float) -> float | None:
    """The healthy learners' worst train loss after the fault against their last before (relative)."""
    worst = None
    healthy = {lid for _, losses in samples for lid in losses if lid != BAD}
    for lid in healthy:
        series = [(t, losses.get(lid)) for t, losses in samples if _finite(losses.get(lid))]
        before = [loss for t, loss in series if t < t_fault][-SMOOTH:]
        after = [loss for t, loss in series if t >= t_fault]
        runs = [sum(after[i : i + SMOOTH]) / SMOOTH for i in range(len(after) - SMOOTH + 1)]
        if before and runs:
            rise = max(runs) / (sum(before) / len(before)) - 1
            worst = rise if worst is None else max(worst, rise)
    return worst


def rate_ratio(res: dict[str, Any], without: dict[str, Any], window: tuple[float, float, float]) -> float | None:
    """The global loss's drop over the fault window (seconds since training started), against the
    fleet without the bad learner over the same seconds."""
    start, t0, t1 = window
    a, b = t0 - start, t1 - start
    ours = _drop(res, a, b)
    theirs = _drop(without, a, b)
    return None if ours is None or not theirs else ours / theirs


def _drop(res: dict[str, Any], a: float, b: float) -> float | None:
    """How much the global loss fell from `a` to `b` seconds after training started: the slope of
    a least-squares line through the scores in between, times b - a. (The difference of two
    interpolated scores moved the ratio by +-50% run to run: one score's noise, about 1%, is as
    large as a minute's drop late in the run; a line through the window's ~150 scores is not.)"""
    scores = (res.get("inspect") or {}).get("scores", [])
    pts = [(m.get("taken_at", m["t"]) - res["training_started"], m["loss"]) for m in scores]
    pts = [(x, y) for x, y in pts if a <= x <= b and _finite(y)]
    if len(pts) < MIN_POINTS:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    if var <= 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in pts) / var
    return -slope * (b - a)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
