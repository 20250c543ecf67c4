"""What a run measured, as the constants `dldctl simulate ... --from-run` plans with.

`measure(records)` is pure (the run's events, samples, rounds, scores and settings in; a `Pilot`
out); `read(run_dir)` gathers the records. Everything is taken over the run's **window**: from the
first syncer sample in which every declared learner has trained (start-up and the first join are
not a fault's cost) to the last sample before the fleet was stopped.

- goodput: the syncer's own accounting over the window (merged compute seconds, from its
  cumulative goodput, over the provisioned learner seconds), as bench/fleet_summary.py reads it;
- each fault injected in the window on a learner: its kind (the event's `action`, or the words
  of its detail for runs older than that field), and what it cost: a kill until the new process
  rejoined (with the restart and the first merged contribution after it, reported), a pause or
  a slow-down until it was undone (a slow-down's at 1 - 1/factor of it), other kinds nothing;
- work lost: what the fleet trained and never merged grew by over the window (the gap between
  the syncer's trained and merged tokens), shared by the kills, in each victim's own seconds;
- the wire: bytes per push and per reply (one learner's), the compute time of a step (its wall
  time less the share blocked on the wire), H, fragments, max_lag (how long a learner waits for
  a reply), and the learners' blocked share.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dldctl.observe import pilotspares
from dldctl.observe.pilotrecords import FaultSeen, Records, first_time
from dldctl.observe.report_series import fault_kind
from dldctl.rundir import RunDir
from dldctl.sim.pilot import KILLS, FaultCost, GoodputPilot, WirePilot
from syncer.common import jsonlread

DEFAULT_SLOW_FACTOR = 3.0  # `dldctl chaos slow`'s default
TIMED = ("pause", "slow")  # faults whose cost is their duration


@dataclass
class Pilot:
    """What a run measured: the goodput and wire records, and what they rest on."""

    name: str
    window: tuple[float, float]
    goodput: GoodputPilot
    wire: WirePilot
    faults: list[FaultSeen]
    step_s: dict[str, tuple[float, float, float]]  # learner -> (p10, median, p90) wall s per step
    bytes_per_token: tuple[float, float]  # up, down
    lost_tokens: float
    checkpoints: int
    compression: str
    spares_from: str  # where the spares' start-up came from
    notes: list[str] = field(default_factory=list)


def _number(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def window(samples: Sequence[dict[str, Any]], learners: int) -> tuple[float, float] | None:
    """(first sample with every declared learner training, last sample); None if never."""
    for s in samples:
        rows = (s.get("learners") or {}).values()
        if sum(1 for r in rows if (_number(r.get("step")) or 0) > 0) >= learners:
            return float(s["t"]), float(samples[-1]["t"])
    return None


def _at(samples: Sequence[dict[str, Any]], t: float) -> dict[str, Any]:
    """The last sample at or before `t` (the first one if none)."""
    best = samples[0]
    for s in samples:
        if s["t"] <= t:
            best = s
    return best


def window_goodput(samples: Sequence[dict[str, Any]], t0: float, learners: int, a: float, b: float) -> float:
    """(merged seconds at b - at a) / (learners x (b - a)), merged seconds from the syncer's goodput."""

    def merged(s: dict[str, Any]) -> float:
        return (_number(s.get("goodput")) or 0.0) * learners * (s["t"] - t0)

    sa, sb = _at(samples, a), _at(samples, b)
    span = sb["t"] - sa["t"]
    return max(0.0, min(1.0, (merged(sb) - merged(sa)) / (learners * span))) if span > 0 else 0.0


def _is(event: dict[str, Any], kind: str, target: str) -> bool:
    return event.get("kind") == kind and event.get("target") == target


def faults_seen(rec: Records, start: float, end: float) -> list[FaultSeen]:
    """Every fault injected on a learner inside the window, with what followed it."""
    out = []
    for e in rec.events:
        if e.get("kind") != "fault_inject" or not start <= e["t"] <= end:
            continue
        target = str(e.get("target", ""))
        if not target.startswith("learner"):
            continue
        f = FaultSeen(fault_kind(e), target, float(e["t"]))
        if f.kind in KILLS:
            restart = next((r for r in rec.events if _is(r, "restart", target) and r["t"] >= f.t), None)
            f.restart_s = None if restart is None else restart["t"] - f.t
            f.spare = restart is not None and bool(restart.get("spare", "(warm spare)" in str(restart.get("detail"))))
            back = first_time(rec.events, ("rejoin", "join"), target, f.t)
            f.rejoin_s = _since(f.t, back)
            after = back if back is not None else f.t
            merged = [r["t"] for r in rec.rounds if r["t"] >= after and target in (r.get("contributors") or ())]
            f.contributing_s = _since(f.t, min(merged) if merged else None)
        else:
            f.undone_s = _since(f.t, first_time(rec.events, ("fault_undo",), target, f.t))
        out.append(f)
    return out


def _since(t: float, later: float | None) -> float | None:
    return None if later is None else later - t


def step_seconds(rec: Records, start: float, end: float) -> dict[str, tuple[float, float, float]]:
    """Each learner's wall seconds per step over the window: (p10, median, p90) of its samples."""
    per_step = rec.settings.batch_size * rec.settings.seq_len
    rates: dict[str, list[float]] = {}
    for s in rec.samples:
        if start <= s["t"] <= end:
            for lid, row in (s.get("learners") or {}).items():
                tps = _number(row.get("tokens_per_s"))
                if tps and row.get("state") == "running":
                    rates.setdefault(lid, []).append(per_step / tps)
    out = {}
    for lid, values in sorted(rates.items()):
        q = statistics.quantiles(values, n=10) if len(values) >= 2 else [values[0]] * 9
        out[lid] = (q[0], statistics.median(values), q[-1])
    return out


def lost_tokens(samples: Sequence[dict[str, Any]], start: float, end: float) -> float:
    """How much the fleet's trained-but-unmerged tokens grew over the window (never below 0)."""

    def gap(s: dict[str, Any]) -> float:
        return (_number(s.get("tokens_trained")) or 0.0) - (_number(s.get("tokens_merged")) or 0.0)

    return max(0.0, gap(_at(samples, end)) - gap(_at(samples, start)))


def _tokens_per_s(samples: Sequence[dict[str, Any]], lid: str, start: float, end: float) -> float | None:
    values = [
        v
        for s in samples
        if start <= s["t"] <= end
        for v in [_number(((s.get("learners") or {}).get(lid) or {}).get("tokens_per_s"))]
        if v
    ]
    return statistics.median(values) if values else None


def costs(rec: Records, seen: list[FaultSeen], start: float, end: float, lost: float) -> list[str]:
    """Set each fault's cost; returns notes on what could not be measured."""
    notes = []
    kills = [f for f in seen if f.kind in KILLS]
    quick = pilotspares.quick_takeover(kills)
    for f in seen:
        inject = next(e for e in rec.events if e.get("kind") == "fault_inject" and e["t"] == f.t)
        if f.kind in KILLS:
            down = f.rejoin_s if f.rejoin_s is not None else end - f.t
            tps = _tokens_per_s(rec.samples, f.target, start, end)
            lost_s = lost / len(kills) / tps if tps else 0.0
            gone = f.restart_s if f.restart_s is not None else down
            ready = f.spare and not pilotspares.waited(f, quick)
            f.cost = FaultCost(f.kind, down, lost_s, spare_ready=ready, gone_s=min(gone, down))
        elif f.kind in TIMED:
            span = f.undone_s if f.undone_s is not None else _number(inject.get("duration_s")) or 0.0
            share = 1.0 if f.kind == "pause" else 1.0 - 1.0 / (_number(inject.get("factor")) or DEFAULT_SLOW_FACTOR)
            f.cost = FaultCost(f.kind, span * share)
        else:
            f.cost = FaultCost(f.kind, 0.0)
            notes.append(f"a {f.kind} fault's cost is not modelled: counted as none")
    return sorted(set(notes))


def wire_pilot(rec: Records, start: float, end: float, target: float | None) -> WirePilot:
    """Bytes per push and per reply, a step's compute time and the blocked share, over the window."""
    rounds = [r for r in rec.rounds if start <= r["t"] <= end]
    pushes = sum(len(r.get("contributors") or ()) for r in rounds)
    replies = sum(int(r.get("live") or 0) for r in rounds)
    up = sum(_number(r.get("bytes_in")) or 0.0 for r in rounds) / pushes if pushes else 0.0
    down = sum(_number(r.get("bytes_out")) or 0.0 for r in rounds) / replies if replies else 0.0
    last = (_at(rec.samples, end).get("learners") or {}).values()
    blocked_each = [b for b in (_number(r.get("blocked_frac")) for r in last) if b is not None]
    blocked = statistics.mean(blocked_each) if blocked_each else 0.0
    steps = [m for _, m, _ in step_seconds(rec, start, end).values()]
    step = statistics.median(steps) * (1.0 - blocked) if steps else 1.0
    s = rec.settings
    reach = None if target is None else time_to_loss(rec, start, end, target)
    lag = s.max_lag if s.overlap else s.H // s.fragments  # synchronous: every reply before the next step
    return WirePilot(rec.learners, step, s.H, s.fragments, lag, up, down, blocked, reach)


def time_to_loss(rec: Records, start: float, end: float, target: float) -> float | None:
    """Training time to `target`: the merged tokens of the global model's first score at or below
    it, over the fleet's merged tokens per second in the window (None: never reached). Counted in
    tokens, so the start-up (joins, a warm spare's import beside the first steps) is not in it."""
    tokens = [_number(e.get("tokens_merged")) for e in rec.evals if (_number(e.get("loss")) or math.inf) <= target]
    reached = [t for t in tokens if t is not None]
    a, b = _at(rec.samples, start), _at(rec.samples, end)
    merged = (_number(b.get("tokens_merged")) or 0.0) - (_number(a.get("tokens_merged")) or 0.0)
    rate = merged / (b["t"] - a["t"]) if b["t"] > a["t"] else 0.0
    return min(reached) / rate if reached and rate > 0 else None


def measure(rec: Records, target_loss: float | None = None) -> Pilot:
    """The run's constants over its window; ValueError (one line) when it has none."""
    if not rec.samples:
        raise ValueError(f"run {rec.name} has no syncer samples (metrics.jsonl): it never trained")
    span = window(rec.samples, rec.learners)
    if span is None or span[1] - span[0] <= 0:
        raise ValueError(f"run {rec.name}: its {rec.learners} learners never all trained at once; nothing to measure")
    start, end = span
    t0 = next((e["t"] for e in rec.events if e.get("kind") == "syncer_start"), rec.samples[0]["t"])
    seen = faults_seen(rec, start, end)
    lost = lost_tokens(rec.samples, start, end)
    notes = costs(rec, seen, start, end, lost)
    spares, spares_from = pilotspares.spare_model(rec, [f for f in seen if f.kind in KILLS])
    good = GoodputPilot(
        rec.learners,
        end - start,
        window_goodput(rec.samples, t0, rec.learners, start, end),
        tuple(f.cost for f in seen if f.cost is not None),
        spares,
    )
    a, b = _at(rec.samples, start), _at(rec.samples, end)
    tokens = (_number(b.get("tokens_trained")) or 0.0) - (_number(a.get("tokens_trained")) or 0.0)
    per = [
        ((_number(b.get(k)) or 0.0) - (_number(a.get(k)) or 0.0)) / tokens if tokens > 0 else 0.0
        for k in ("bytes_up", "bytes_down")
    ]
    return Pilot(
        rec.name,
        span,
        good,
        wire_pilot(rec, start, end, target_loss),
        seen,
        step_seconds(rec, start, end),
        (per[0], per[1]),
        lost,
        sum(1 for e in rec.events if e.get("kind") == "checkpoint" and start <= e["t"] <= end),
        rec.settings.compression,
        spares_from,
        notes,
    )


def read(run: RunDir) -> Records:
    """A run's records from its directory (events, the syncer's metrics, its settings)."""
    cfg = run.read_config()
    events = list(jsonlread.read(run.events))
    metrics = list(jsonlread.read(run.metrics))
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for m in metrics:
        if isinstance(m.get("t"), (int, float)):
            by_kind.setdefault(str(m.get("kind")), []).append(m)
    return Records(
        [e for e in events if isinstance(e.get("t"), (int, float))],
        by_kind.get("sample", []),
        by_kind.get("round", []),
        by_kind.get("global_eval", []),
        cfg.run,
        len(cfg.learners),
        run.path.name,
        {e.id: e.host for e in cfg.learners},
    )
