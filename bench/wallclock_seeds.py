"""Several `bench/wallclock.py` runs read together: is "the defaults end lowest" robust to the seed?

One wall-time run ends on one checkpoint of a model that, at a constant learning rate, still moves
by about 1% from one checkpoint to the next, so one run's winner can be the seed's. This reads the
JSON of several runs (each with its baselines inside it, same machine, same kill schedule) and
reports, per strategy and run, two numbers:

- **final**: the held-out loss of the model at the window's end (what `wallclock.py` reports);
- **end mean**: the mean held-out loss of every evaluation in the window's last `--tail` seconds
  (syncer checkpoints for the DiLoCo fleets, one every 10 merges; data-parallel's and torchft's
  own evaluations, fewer), which averages out the checkpoint-to-checkpoint wobble;

and, across runs, each strategy's mean of both and the defaults' paired ratio to it (the defaults
over the strategy, run by run; below 1 is better) with the number of runs the defaults won.

    .venv/bin/python bench/wallclock_seeds.py bench/results/wallclock_full_lr1e-3.json \\
        bench/results/wallclock_full_lr1e-3_seed2.json --out bench/results/wallclock_seeds_lr1e-3.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import mean
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common

DEFAULTS = "Decoupled DiLoCo, dldctl defaults"


def end_mean(res: dict[str, Any], duration: float, tail: float) -> float | None:
    """The mean held-out loss of the evaluations in [duration - tail, duration + tail / 2]
    (data-parallel's and torchft's last evaluation can land a little after the window)."""
    losses = [
        float(c["eval_loss"])
        for c in res.get("curve") or []
        if c.get("eval_loss") is not None and duration - tail <= float(c["t"]) <= duration + tail / 2
    ]
    return mean(losses) if losses else None


def per_run(result: dict[str, Any], tail: float) -> dict[str, dict[str, float | None]]:
    """{strategy: {"final", "end mean"}} for one wallclock.py result (the rows' strategies)."""
    duration = float(result["duration_s"])
    return {
        row["strategy"]: {
            "final": row["eval loss"],
            "end mean": end_mean(result["runs"][row["strategy"]], duration, tail),
        }
        for row in result["rows"]
    }


def paired(runs: list[dict[str, dict[str, float | None]]], strategy: str, key: str) -> list[float]:
    """The defaults' value over `strategy`'s, run by run, where both exist."""
    out = []
    for r in runs:
        mine, theirs = r.get(DEFAULTS, {}).get(key), r.get(strategy, {}).get(key)
        if mine is not None and theirs:
            out.append(mine / theirs)
    return out


def summary_rows(runs: list[dict[str, dict[str, float | None]]]) -> list[dict[str, Any]]:
    """One row per strategy: mean final and end mean, the defaults' paired ratio and wins."""
    strategies = list(dict.fromkeys(s for r in runs for s in r))
    rows = []
    for s in strategies:
        row: dict[str, Any] = {"strategy": s}
        for key in ("final", "end mean"):
            values = [v for r in runs if (v := r.get(s, {}).get(key)) is not None]
            row[f"{key} (mean)"] = mean(values) if values else None
            ratios = paired(runs, s, key) if s != DEFAULTS else []
            row[f"defaults / it, {key}"] = mean(ratios) if ratios else None
            row[f"defaults won, {key}"] = f"{sum(x < 1 for x in ratios)}/{len(ratios)}" if ratios else None
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench/wallclock.py result JSON files")
    parser.add_argument("--tail", type=float, default=12.0, help="seconds at the window's end to average")
    parser.add_argument("--out", type=Path, default=Path("bench/results/wallclock_seeds.json"))
    args = parser.parse_args(argv)
    try:
        results = [json.loads(p.read_text()) for p in args.results]
        runs = [per_run(r, args.tail) for r in results]
    except (OSError, ValueError, KeyError) as exc:
        why = f"wallclock_seeds: cannot read the results ({exc!r}); pass bench/wallclock.py JSON files"
        raise SystemExit(why) from None
    for path, run in zip(args.results, runs):
        common.print_table(f"{path.name}", [{"strategy": s, **v} for s, v in run.items()])
    rows = summary_rows(runs)
    common.print_table(f"{len(runs)} runs: means, and the defaults' paired ratio (< 1: the defaults lower)", rows)
    common.write_json(
        args.out,
        {
            "benchmark": "wallclock_seeds",
            "tail_s": args.tail,
            "inputs": [str(p) for p in args.results],
            "settings": [r["settings"] for r in results],
            "seeds": [r["seed"] for r in results],
            "per_run": runs,
            "rows": rows,
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
