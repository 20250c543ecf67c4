"""Benchmark: do dldctl's default settings train without divergence at every H and fleet size?

For each H in {8, 16, 32, 64} and M in {2, 4, 8} learners, the built-in model (gpt-tiny here, as
in the other fleet benchmarks) trains on the built-in local host for the same window of D
seconds with every setting at its default (only H, the model and the eval cadence set). The
syncer scores the global model every 8 outer steps on the fixed held-out batches; a run
**diverged** when a score is non-finite or its final score is more than 10% above its best one
(a healthy run ends at or near its best). Also reported: the final score, the quality guard's
trips, and the warnings `up --dry-run` prints for the combination (RunSettings.risks).

    .venv/bin/python bench/safe_defaults.py            # D = 75 s, 12 fleets, ~30 min on 2 cores
    .venv/bin/python bench/safe_defaults.py --quick    # D = 30 s, H in {8, 64}, M in {2, 4}
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.fleet import BenchRun, Plan, local_host, read_jsonl, run_diloco
from syncer.common.settings import RunSettings

DIVERGED = 0.10  # final score this far above the run's best


def _extra(parser: Any) -> None:
    parser.add_argument("--duration", type=float, default=None, help="window D in seconds (default 75, quick 30)")


def _scores(fleet: BenchRun) -> list[dict[str, Any]]:
    assert fleet.run_dir is not None
    return [m for m in read_jsonl(fleet.run_dir / "metrics.jsonl") if m.get("kind") == "global_eval"]


def run(H: int, M: int, duration: float) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "model": "gpt-tiny",
        "seq_len": 32,
        "batch_size": 8,
        "H": H,
        "fragments": 4,
        "eval_every": 100000,
        "global_eval_every": 8,
        "insecure": True,
    }
    res = run_diloco(
        Plan(
            f"s-H{H}-M{M}",
            settings,
            [local_host("here", M)],
            M,
            duration_s=duration,
            inspect=_scores,
            timeout_s=duration + 600,
        )
    )
    losses = [m["loss"] for m in res["inspect"]]
    finite = [x for x in losses if math.isfinite(x)]
    final, best = (losses[-1], min(finite)) if finite else (None, None)
    diverged = (len(finite) < len(losses)) or final is None or best is None or final > best * (1 + DIVERGED)
    risks = RunSettings(**{**settings, "quorum": 1}).risks()
    return {
        "H": H,
        "learners": M,
        "scores": len(losses),
        "first": losses[0] if losses else None,
        "best": best,
        "final": final,
        "eval loss (final model)": res["eval_loss"],
        "diverged": diverged,
        "guard trips": sum(1 for m in res["inspect"] if not m.get("good", True)),
        "contrib/round": res["mean_contributors"],
        "warnings": "; ".join(risks) or "-",
    }


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("safe_defaults", __doc__, _extra, argv)
    duration = args.duration or (30.0 if args.quick else 75.0)
    grid = [(H, M) for H in ((8, 64) if args.quick else (8, 16, 32, 64)) for M in ((2, 4) if args.quick else (2, 4, 8))]
    rows = []
    for H, M in grid:
        rows.append(run(H, M, duration))
        print(rows[-1], flush=True)
    common.print_table(
        f"Default settings, gpt-tiny, {duration:g} s per fleet: divergence = a non-finite score or the "
        f"final one > {100 * DIVERGED:g}% above the best",
        rows,
    )
    bad = [f"H={r['H']} M={r['learners']}" for r in rows if r["diverged"]]
    print("every combination trained without divergence" if not bad else f"diverged: {', '.join(bad)}")
    common.write_json(
        args.out,
        {"benchmark": "safe_defaults", "quick": args.quick, "duration_s": duration, "rows": rows, "diverged": bad},
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
