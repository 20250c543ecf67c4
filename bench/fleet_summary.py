"""What a fleet run's records add up to: the numbers `bench.fleet.run_diloco` reports.

From the syncer's `sample` records (every 2 s), its `round` records and the run's events:
goodput over a time window (`window_goodput`: merged_s(t) = goodput(t) * M * (t - t0), see
bench/fleet.py), the learners' blocked share, whether a token budget is reached
(`budget_reached`, which `Plan.budget_tokens` stops on), and the whole run's summary
(`summarize_run`: tokens, bytes per token, goodput, rounds, event counts).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for the annotations only: bench.fleet imports this module
    from bench.fleet import BenchRun, Plan

# a token budget is called reached STOP_LEAD_S of training early (sample lag + down), at the rate
# of the last RATE_WINDOW_S of samples
STOP_LEAD_S, RATE_WINDOW_S = 2.5, 6.0


def tokens_per_step(run: dict[str, Any]) -> int:
    """Tokens one learner trains per step under a `[run]` table: batch_size x seq_len."""
    return int(run["batch_size"]) * int(run["seq_len"])


def syncer_start(events: list[dict[str, Any]]) -> float | None:
    """Unix time of the first `syncer_start` event (the syncer's accounting starts there)."""
    starts = [e["t"] for e in events if e.get("kind") == "syncer_start"]
    return min(starts) if starts else None


def merged_seconds(sample: dict[str, Any], t0: float, learners: int) -> float:
    """merged_s at a sample: the syncer's goodput times its provisioned time M * (t - t0)."""
    return float(sample["goodput"]) * learners * max(0.0, float(sample["t"]) - t0)


def window(samples: list[dict[str, Any]], start: float, end: float) -> tuple[dict, dict] | None:
    """The first sample at or after `start` and the last at or before `end` (None if < 2)."""
    inside = [s for s in samples if start <= s["t"] <= end]
    return (inside[0], inside[-1]) if len(inside) >= 2 and inside[-1]["t"] > inside[0]["t"] else None


def window_goodput(samples: list[dict[str, Any]], t0: float, learners: int, start: float, end: float) -> dict[str, Any]:
    """Goodput, tokens merged/s and trained/s between two samples inside [start, end]."""
    pair = window(samples, start, end)
    if pair is None:
        return {"goodput": None, "tokens_merged_per_s": None, "tokens_trained_per_s": None, "window_s": 0.0}
    a, b = pair
    dt = b["t"] - a["t"]
    merged = merged_seconds(b, t0, learners) - merged_seconds(a, t0, learners)
    return {
        "goodput": merged / (learners * dt),
        "window_s": dt,
        "window": [a["t"], b["t"]],
        "tokens_merged_per_s": (b["tokens_merged"] - a["tokens_merged"]) / dt,
        "tokens_trained_per_s": (b["tokens_trained"] - a["tokens_trained"]) / dt,
    }


def blocked_share(samples: list[dict[str, Any]]) -> float | None:
    """The learners' mean share of their loop time spent blocked (the last sample that has one)."""
    for sample in reversed(samples):
        values = [row.get("blocked_frac") for row in (sample.get("learners") or {}).values()]
        values = [v for v in values if isinstance(v, (int, float))]
        if values:
            return sum(values) / len(values)
    return None


def finished_learners(fleet: BenchRun, learners: int) -> int:
    """How many learners finished their step budget (never restarted): their `finished` mark in
    the run directory, or, for one on another host (its mark is there), the syncer's `leave`."""
    assert fleet.run_dir is not None
    marked = {
        f"learner-{i}" for i in range(learners) if (fleet.run_dir / "learners" / f"learner-{i}" / "finished").exists()
    }
    left = {e.get("target") for e in fleet.events("leave") if "finished its budget" in str(e.get("detail", ""))}
    return len(marked | (left & {f"learner-{i}" for i in range(learners)}))


def budget_reached(samples: list[dict[str, Any]], budget: int) -> bool:
    """`budget` tokens trained, counting STOP_LEAD_S more at the rate of the last RATE_WINDOW_S of
    samples (the learners' own tokens/s ignores waits, pauses, restarts: chaos runs ended short)."""
    last = samples[-1]
    ref = next((s for s in reversed(samples) if last["t"] - s["t"] >= RATE_WINDOW_S), None)
    rate = (
        (last["tokens_trained"] - ref["tokens_trained"]) / (last["t"] - ref["t"])
        if ref is not None
        else float(last.get("tokens_per_s") or 0.0)
    )
    return last["tokens_trained"] + STOP_LEAD_S * max(0.0, rate) >= budget


def summarize_run(fleet: BenchRun, plan: Plan, summary: dict[str, Any], start: float, end: float) -> dict[str, Any]:
    """Tokens, bytes (total and in the training window), goodput (syncer's and windowed), rounds."""
    samples, rounds, events = fleet.samples(), fleet.rounds(), fleet.events()
    t0 = syncer_start(events) or start
    tokens = reported = int(summary.get("tokens_trained") or 0)
    steps = int(plan.run.get("steps") or 0)
    exact = (
        steps
        and not any(e.get("kind") == "death" for e in events)
        and finished_learners(fleet, plan.learners) == plan.learners
    )
    if exact:  # every learner ran exactly `steps` steps; the syncer misses each one's last heartbeat
        tokens = plan.learners * steps * tokens_per_step(plan.run)
    wire = int(summary.get("bytes_up") or 0) + int(summary.get("bytes_down") or 0)
    win = window_goodput(samples, t0, plan.learners, start, end)
    steady = window(samples, start, end)
    steady_bpt = None
    if steady is not None:
        a, b = steady
        dtok = b["tokens_trained"] - a["tokens_trained"]
        dbytes = (b["bytes_up"] + b["bytes_down"]) - (a["bytes_up"] + a["bytes_down"])
        steady_bpt = dbytes / dtok if dtok else None
    contributors = [len(r["contributors"]) for r in rounds]
    return {
        "name": plan.name,
        "run": plan.run,
        "learners": plan.learners,
        "summary": summary,
        "training_started": start,
        "training_ended": end,
        "train_s": end - start,
        "tokens_trained": tokens,
        "tokens_trained_syncer": reported,
        "tokens_exact": bool(exact),
        "tokens_merged": int(summary.get("tokens_merged") or 0),
        "bytes_up": summary.get("bytes_up"),
        "bytes_down": summary.get("bytes_down"),
        "bytes_per_token": wire / tokens if tokens else None,
        "up_per_token": (summary.get("bytes_up") or 0) / tokens if tokens else None,
        "down_per_token": (summary.get("bytes_down") or 0) / tokens if tokens else None,
        "steady_bytes_per_token": steady_bpt,
        "goodput_syncer": summary.get("goodput"),
        "window": win,
        "rounds": len(rounds),
        "mean_contributors": sum(contributors) / len(contributors) if contributors else None,
        "contributors_hist": {str(k): v for k, v in sorted(collections.Counter(contributors).items())},
        "blocked_share": blocked_share(samples),
        "event_counts": dict(collections.Counter(e.get("kind") for e in events)),
    }
