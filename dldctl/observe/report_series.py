"""What each `dldctl report` plot draws, built from a run's records (pure: no I/O, no matplotlib).

Honest plots: no data is not zero, and a restarted syncer is not the same counter.

- Pieces: the samples are cut into pieces of continuous measurement. A cut falls where the time
  between two samples is more than `GAP_INTERVALS` typical sample intervals, where the syncer
  (re)started between them (a `syncer_start` or `syncer_death` event), or where a cumulative
  counter went back (a restarted syncer's counters start again, or a checkpoint rollback).
  Lines are broken (a NaN point) between pieces, so nothing is drawn across a gap.
- Unknown is not zero: a learner the syncer does not know (absent, or in a state such as
  "unreachable" that the restarted syncer gives every learner before it hears from it) has no
  throughput in that sample, and a sample in which the syncer knows no learner has no live count
  and no fleet throughput: NaN, not 0.
- Rates (bytes/s, data-parallel bytes/s) are differences of counters between two samples of one
  piece: never across a gap or a counter reset.
- The headline ratio (data-parallel-equivalent bytes per byte moved) is the syncer's own
  cumulative counters' ratio at each sample, broken at cuts like every other line.
- Loss against tokens merged is split into segments where tokens merged or outer steps go back
  (a syncer resumed from an older checkpoint) or at a rollback event; a marker shows each one.
- Fault marks: a vertical line per fault, death and unreachable host, labelled with its kind and
  target ("kill learner-1", "syncer died"), on rows chosen so close labels do not overlap.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

NAN = math.nan
GAP_INTERVALS = 3.0  # a silence longer than this many sample intervals is a gap
DEFAULT_INTERVAL_S = 2.0  # the syncer's sample period (syncer/server.py SAMPLE_EVERY_S)
COUNTERS = ("tokens_trained", "tokens_merged", "bytes_up", "bytes_down", "ddp_equivalent", "outer_steps")
CUT_EVENTS = ("syncer_start", "syncer_death")  # the syncer's counters and fleet view start again
UNKNOWN_STATES = frozenset({"unknown", "unreachable", "lost"})  # the syncer has not heard from it
ROLLBACK_EVENTS = ("rollback",)  # plus a quality_guard event that says "rolled back"
CLAIMED_S = 10.0  # a death this soon after a chaos kill of the same target is that kill's
FAULT_ACTIONS = (  # words of a fault_inject detail -> the action (dldctl/chaos/inject.py wrote it)
    ("kill", "kill"),
    ("sigstop", "pause"),
    ("pause", "pause"),
    ("slower", "slow"),
    ("slow", "slow"),
    ("cut off", "partition"),
    ("partition", "partition"),
)


@dataclass(frozen=True)
class Line:
    """One plotted line: x and y of equal length, NaN in y where the line is broken."""

    label: str
    x: list[float]
    y: list[float]
    undone: bool = False  # work a later rollback undid (drawn faded)


@dataclass(frozen=True)
class Mark:
    """A point of interest: a fault line (time) or a rollback marker (tokens merged, loss)."""

    x: float
    label: str
    kind: str
    y: float = NAN
    row: int = 0  # the label's row, 0 at the top: close labels go on different rows


def number(value: Any) -> float | None:
    """A finite int/float as a float; anything else (None, bool, NaN, text) as None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# ---------------------------------------------------------------- pieces of continuous measurement


def sample_interval(samples: Sequence[dict]) -> float:
    """The typical time between two samples (the median; the syncer's period if fewer than two)."""
    steps = [b["t"] - a["t"] for a, b in itertools.pairwise(samples) if b["t"] > a["t"]]
    return statistics.median(steps) if steps else DEFAULT_INTERVAL_S


def _went_back(prev: dict, cur: dict) -> bool:
    for key in COUNTERS:
        a, b = number(prev.get(key)), number(cur.get(key))
        if a is not None and b is not None and b < a:
            return True
    return False


def cut_times(events: Iterable[dict]) -> list[float]:
    """When the syncer (re)started or died: its counters and its view of the fleet start again."""
    return sorted(e["t"] for e in events if e.get("kind") in CUT_EVENTS)


def blind(samples: Sequence[dict], events: Iterable[dict] = ()) -> list[bool]:
    """For each sample, whether its syncer had not yet heard from any learner since it (re)started:
    its fleet figures are no measurement (every learner "unreachable", 0 tokens/s, 0 live), and its
    counters are the checkpoint's, which the learners' first reports then catch up at once."""
    cuts = iter(cut_times(events))
    cut = next(cuts, math.inf)
    heard, out = False, []
    for sample in samples:
        while cut <= sample["t"]:
            heard, cut = False, next(cuts, math.inf)
        heard = heard or knows_fleet(sample)
        out.append(not heard)
    return out


def pieces(samples: Sequence[dict], events: Iterable[dict] = ()) -> list[list[dict]]:
    """The samples cut at every gap, syncer (re)start and counter reset, without the samples of a
    syncer that had heard from no learner yet (see `blind` and the module docstring)."""
    events = list(events)
    gap = GAP_INTERVALS * sample_interval(samples)
    cuts = cut_times(events)
    out: list[list[dict]] = []
    prev: dict | None = None
    for cur, unseen in zip(samples, blind(samples, events)):
        if unseen:
            prev = None  # a cut: nothing is drawn or differenced across this sample
            continue
        restarted = prev is not None and any(prev["t"] < c <= cur["t"] for c in cuts)
        if prev is None or cur["t"] - prev["t"] > gap or restarted or _went_back(prev, cur):
            out.append([])
        out[-1].append(cur)
        prev = cur
    return out


def _joined(parts: Iterable[list[tuple[float, float]]]) -> tuple[list[float], list[float]]:
    """Points of several pieces as one x/y pair, a NaN point after each piece but the last (a break;
    at the piece's last x, so that a step drawn "post" does not reach into the gap either)."""
    xs: list[float] = []
    ys: list[float] = []
    for part in parts:
        if not part:
            continue
        if xs:
            xs.append(xs[-1])
            ys.append(NAN)
        xs += [x for x, _ in part]
        ys += [y for _, y in part]
    return xs, ys


def piece_line(label: str, parts: Sequence[list[dict]], value: Callable[[dict], float | None], t0: float) -> Line:
    """`value` of every sample against time since t0; NaN where it is unknown, a break between pieces."""
    points = [[(s["t"] - t0, NAN if (v := value(s)) is None else v) for s in part] for part in parts]
    return Line(label, *_joined(points))


# ---------------------------------------------------------------- what the syncer knew


def learner_row(sample: dict, lid: str) -> dict | None:
    """A learner's row of a sample if the syncer knew that learner then (else None: no data)."""
    rows = sample.get("learners")
    row = rows.get(lid) if isinstance(rows, dict) else None
    if not isinstance(row, dict) or row.get("state") in UNKNOWN_STATES:
        return None
    return row


def knows_fleet(sample: dict) -> bool:
    """Whether the syncer knew any learner in this sample (a restarted one knows none at first)."""
    rows = sample.get("learners")
    return isinstance(rows, dict) and any(learner_row(sample, lid) is not None for lid in rows)


def learner_ids(samples: Iterable[dict]) -> list[str]:
    """Every learner any sample names, sorted."""
    return sorted({lid for s in samples if isinstance(s.get("learners"), dict) for lid in s["learners"]})


def fleet_value(key: str) -> Callable[[dict], float | None]:
    """A sample's fleet-wide figure that only means something while the syncer knows its fleet."""
    return lambda s: number(s.get(key)) if knows_fleet(s) else None


def throughput_lines(samples: Sequence[dict], events: Iterable[dict], t0: float) -> list[Line]:
    """Tokens/s of each learner, then the fleet's total ("total"), broken where unknown."""
    parts = pieces(samples, events)
    lines = []
    for lid in learner_ids(samples):

        def rate(s: dict, lid: str = lid) -> float | None:
            row = learner_row(s, lid)
            return None if row is None else number(row.get("tokens_per_s"))

        lines.append(piece_line(lid, parts, rate, t0))
    if any(number(s.get("tokens_per_s")) is not None for s in samples):
        lines.append(piece_line("total", parts, fleet_value("tokens_per_s"), t0))
    return lines


def quorum_lines(samples: Sequence[dict], events: Iterable[dict], t0: float) -> list[Line]:
    """Live learners (NaN while the syncer knew none) and the minimum quorum, broken at gaps."""
    parts = pieces(samples, events)
    live = piece_line("live", parts, fleet_value("quorum_live"), t0)
    least = piece_line("minimum quorum", parts, lambda s: number(s.get("quorum_min")), t0)
    return [line for line in (live, least) if any(not math.isnan(y) for y in line.y)]


# ---------------------------------------------------------------- counters: rates, totals, ratios


def moved(sample: dict) -> float | None:
    """Bytes up + down so far (by the syncer that wrote the sample)."""
    up, down = number(sample.get("bytes_up")), number(sample.get("bytes_down"))
    return None if up is None or down is None else up + down


def ddp_bytes(sample: dict) -> float | None:
    """What data-parallel training would have moved for the same steps, so far."""
    return number(sample.get("ddp_equivalent"))


def rate_line(label: str, parts: Sequence[list[dict]], counter: Callable[[dict], float | None], t0: float) -> Line:
    """Per-second increase of a counter between successive samples of one piece (at the later one)."""
    points = []
    for part in parts:
        run = []
        for prev, cur in itertools.pairwise(part):
            a, b, dt = counter(prev), counter(cur), cur["t"] - prev["t"]
            run.append((cur["t"] - t0, (b - a) / dt if a is not None and b is not None and dt > 0 else NAN))
        points.append(run)
    return Line(label, *_joined(points))


def bandwidth_lines(samples: Sequence[dict], events: Iterable[dict], t0: float) -> list[Line]:
    """Bytes/s moved (up + down) and the data-parallel equivalent's bytes/s, never across a cut."""
    parts = pieces(samples, events)
    lines = [
        rate_line("Decoupled DiLoCo (up + down)", parts, moved, t0),
        rate_line("data-parallel equivalent", parts, ddp_bytes, t0),
    ]
    return [line for line in lines if any(not math.isnan(y) for y in line.y)]


def ratio_line(samples: Sequence[dict], events: Iterable[dict], t0: float) -> Line:
    """Data-parallel-equivalent bytes per byte moved so far, over time (the headline ratio): the
    syncer's own counters (a resumed syncer restores them from its checkpoint), broken at cuts."""

    def ratio(s: dict) -> float | None:
        ours, ddp = moved(s), ddp_bytes(s)
        return ddp / ours if ours and ddp else None  # before the first step there is no ratio

    return piece_line("data-parallel bytes / bytes moved", pieces(samples, events), ratio, t0)


def no_data_spans(samples: Sequence[dict], events: Iterable[dict]) -> list[tuple[float, float]]:
    """(from, to) wall times between two pieces of measurement: a gap, a restart or a reset."""
    parts = pieces(samples, events)
    return [(a[-1]["t"], b[0]["t"]) for a, b in itertools.pairwise(parts)]


def goodput_lines(samples: Sequence[dict], events: Iterable[dict], t0: float) -> list[Line]:
    """Goodput (whole run, last 60 s) in percent, broken at gaps and syncer restarts."""
    parts = pieces(samples, events)
    lines = []
    for key, label in (("goodput", "whole run"), ("goodput_window", "last 60 s")):

        def pct(s: dict, key: str = key) -> float | None:
            v = number(s.get(key))
            return None if v is None else 100 * v

        lines.append(piece_line(label, parts, pct, t0))
    return [line for line in lines if any(not math.isnan(y) for y in line.y)]


# ---------------------------------------------------------------- loss: segments and rollbacks


def _rollback_events(events: Iterable[dict]) -> list[dict]:
    return [
        e
        for e in events
        if e.get("kind") in ROLLBACK_EVENTS
        or (e.get("kind") == "quality_guard" and "rolled back" in str(e.get("detail", "")))
    ]


def loss_segments(samples: Sequence[dict], events: Iterable[dict]) -> list[list[dict]]:
    """The samples that have tokens merged, cut where tokens merged or outer steps go back, or at a
    rollback event between two samples: each segment's x (tokens merged) only moves forward."""
    rows = [s for s in samples if number(s.get("tokens_merged")) is not None]
    marks = [e["t"] for e in _rollback_events(events)]
    out: list[list[dict]] = [rows[:1]] if rows else []
    for prev, cur in itertools.pairwise(rows):
        back = any(
            (b := number(cur.get(k))) is not None and (a := number(prev.get(k))) is not None and b < a
            for k in ("tokens_merged", "outer_steps")
        )
        if back or any(prev["t"] < m <= cur["t"] for m in marks):
            out.append([])
        out[-1].append(cur)
    return out


LOSS_KEYS = (("loss_train", "train"), ("loss_eval", "eval"), ("loss_global", "global model (syncer)"))


def _loss_points(seg: list[dict], key: str) -> list[tuple[float, float]]:
    pts = [(number(s["tokens_merged"]), number(s.get(key))) for s in seg]
    return [(x, y) for x, y in pts if x is not None and y is not None]


def loss_lines(segments: Sequence[list[dict]]) -> dict[str, list[Line]]:
    """Per loss key, the lines of each segment (x = tokens merged; points without that loss left
    out); the part of a segment past the point the next one rolled back to is a separate line,
    `undone`, so the plot can fade the work the rollback threw away."""
    out: dict[str, list[Line]] = {}
    starts = [number(seg[0]["tokens_merged"]) if seg else None for seg in segments[1:]] + [None]
    for key, label in LOSS_KEYS:
        lines = []
        for seg, back_to in zip(segments, starts):
            pts = _loss_points(seg, key)
            kept = [p for p in pts if back_to is None or p[0] <= back_to]
            lost = [p for p in pts if back_to is not None and p[0] > back_to]
            if lost and kept:
                lost = [kept[-1], *lost]  # joined to what stayed
            for part, undone in ((kept, False), (lost, True)):
                if part:
                    lines.append(Line(label, [x for x, _ in part], [y for _, y in part], undone))
        if lines:
            out[key] = lines
    return out


def rollback_marks(segments: Sequence[list[dict]]) -> list[Mark]:
    """A marker where each segment after the first starts (x: the tokens merged it went back to;
    y: the segment's first loss), labelled with how far the run went back, and to where."""
    marks = []
    for before, after in itertools.pairwise(segments):
        if not before or not after:
            continue
        a, b = before[-1], after[0]
        lost = (number(a.get("tokens_merged")) or 0.0) - (number(b.get("tokens_merged")) or 0.0)
        step = b.get("outer_steps")
        to = f" to outer step {step}" if number(step) is not None else ""
        what = f", {lost:,.0f} merged tokens undone" if lost > 0 else ""
        loss = next((y for s in after for k, _ in LOSS_KEYS if (y := number(s.get(k))) is not None), NAN)
        marks.append(Mark(number(b["tokens_merged"]) or 0.0, f"rollback{to}{what}", "rollback", loss))
    return marks


# ---------------------------------------------------------------- fault marks


def fault_action(detail: str) -> str:
    """The action a `fault_inject` detail names ("kill -KILL pid 5 ..." -> "kill")."""
    text = detail.lower().removeprefix("chaos ")
    for word, action in FAULT_ACTIONS:
        if word in text:
            return action
    return text.split()[0] if text.split() else "fault"


def fault_kind(event: dict) -> str:
    """A `fault_inject` event's action: its `action` field, or the words of its detail (older runs)."""
    action = event.get("action")
    return str(action) if action else fault_action(str(event.get("detail", "")))


def _claimed(event: dict, kills: list[dict]) -> bool:
    return any(k["target"] == event.get("target") and 0 <= event["t"] - k["t"] <= CLAIMED_S for k in kills)


def fault_marks(events: Iterable[dict], t0: float) -> list[Mark]:
    """A labelled line per fault injected, death, syncer death and unreachable host; a death that
    follows a chaos kill of the same target is drawn unlabelled (the kill already says it)."""
    events = list(events)
    kills = [e for e in events if e.get("kind") == "fault_inject" and fault_kind(e) == "kill"]
    marks = []
    for e in events:
        kind, target = e.get("kind"), str(e.get("target", "?"))
        if kind == "fault_inject":
            label = f"{fault_kind(e)} {target}"
        elif kind in ("death", "syncer_death"):
            label = "" if _claimed(e, kills) else f"{target} died"
        elif kind == "host_unreachable":
            label = f"{target} unreachable"
        else:
            continue
        marks.append(Mark(e["t"] - t0, label, str(kind)))
    return label_rows(marks)


def label_rows(marks: Sequence[Mark], min_gap: float | None = None, rows: int = 4) -> list[Mark]:
    """The marks with a row for each label: the first row whose last label is at least `min_gap`
    away in x (default: 1/12 of the marks' span plus one); past `rows` rows, the least recent."""
    labelled = sorted((m for m in marks if m.label), key=lambda m: m.x)
    span = labelled[-1].x - labelled[0].x if labelled else 0.0
    gap = min_gap if min_gap is not None else (span + 1.0) / 12
    last = [-math.inf] * rows
    out = []
    for m in sorted(marks, key=lambda m: m.x):
        if not m.label:
            out.append(m)
            continue
        free = [r for r in range(rows) if m.x - last[r] >= gap]
        row = free[0] if free else min(range(rows), key=lambda r: last[r])
        last[row] = m.x
        out.append(Mark(m.x, m.label, m.kind, m.y, row))
    return out
