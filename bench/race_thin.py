"""Benchmark: the race where int4 runs out: bench/race.py's 4 sites at 1 Mbit/s per site.

Four ways to train the same model on the same data across 4 network-namespace sites whose links
are capped at 1 Mbit/s each, both directions, the syncer's egress to all sites sharing one more
1 Mbit/s cap (as bench/race.py):

- data-parallel (torchrun, gloo, every step's fp32 gradients all-reduced across the links);
- synchronous DiLoCo with int4 (`quorum = 4`, `overlap = false`);
- Decoupled DiLoCo at dldctl's defaults (int4);
- Decoupled DiLoCo with `link = "thin"` (topk with error feedback, plain averaging).

A DiLoCo fleet joins at 100 Mbit/s (a join carries the full state, which at 1 Mbit/s outlasts
`up --wait`), and every link, the syncer's aggregate cap included, drops to 1 Mbit/s once it
trains: its window starts then. Data-parallel runs at 1 Mbit/s from the start (its rendezvous is
a few bytes) and scores the model after every step.

Measured per way: the eval loss over the window, the time to data-parallel's final loss, the time
to the loss synchronous DiLoCo ends its window at (the issue's comparison: thin against
synchronous int4, >= 2x sooner), bytes each site's link carried, the busiest link's utilisation and
the learners' share of time blocked on communication (target for the thin codec: < 2%).

    .venv/bin/python bench/race_thin.py             # 120 s windows (~20 min): BENCHMARKS.md
    .venv/bin/python bench/race_thin.py --window 60 # a quicker look
    .venv/bin/python bench/race_thin.py --ways "synchronous DiLoCo,Decoupled DiLoCo thin" --thin-set H=16 \
        --out bench/results/race_thin_h16.json       # the thin way with settings on top, next to synchronous
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import race
from bench.sites import Sites

RATE = "1mbit"
JOIN_RATE = "100mbit"
STRATEGIES = (*race.STRATEGIES, race.THIN)


def thinned_fleet(sites: Sites, strategy: str, wall_s: float, work: Path) -> dict[str, Any]:
    """One DiLoCo fleet: joined at JOIN_RATE, every link and the aggregate cap at RATE once it trains."""
    for h in sites.hosts:  # as the previous fleet left them: back to the joining rate
        sites.set_rate(h, JOIN_RATE)
    sites.set_operator_rate(JOIN_RATE)

    def thin() -> None:
        for h in sites.hosts:
            sites.set_rate(h, RATE)
        sites.set_operator_rate(RATE)

    return {**race.run_fleet(sites, strategy, wall_s, work, on_start=thin), "joined_at": JOIN_RATE}


def time_to(curve: list[tuple[float, float]], target: float | None) -> float | None:
    return race.time_to(curve, target) if target is not None else None


def rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per way: times to data-parallel's final loss and to synchronous DiLoCo's."""
    dp_final = race.final_loss(runs.get(STRATEGIES[0], {}).get("curve", []))
    sync_final = race.final_loss(runs.get(STRATEGIES[1], {}).get("curve", []))
    out = []
    for strategy, res in runs.items():
        out.append(
            {
                "strategy": strategy,
                "eval loss at window end": race.final_loss(res["curve"]),
                "time to DP's final loss s": time_to(res["curve"], dp_final),
                "time to sync's final loss s": time_to(res["curve"], sync_final),
                "GB moved": res["bytes_total"] / 1e9,
                "peak util": res["peak_util"],
                "mean util": res["mean_util"],
                "blocked": res["blocked_share"],
            }
        )
    return out


def verdict(table: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's two targets for the thin codec, with the measured numbers."""
    by = {r["strategy"]: r for r in table}
    thin = next((r for r in table if r["strategy"].startswith(race.THIN)), {})
    sync = by.get(STRATEGIES[1], {})
    key = "time to sync's final loss s"
    sooner = sync[key] / thin[key] if thin.get(key) and sync.get(key) else None
    return {
        "thin: blocked (target < 0.02)": thin.get("blocked"),
        "thin: x sooner than synchronous int4 to its final loss (target >= 2)": sooner,
    }


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy, res in runs.items():
        ax.plot([t for t, _ in res["curve"]], [loss for _, loss in res["curve"]], label=strategy, marker=".")
    ax.set_title(f"{RATE} per site, 4 sites")
    ax.set_xlabel("wall-clock s (from the first step at 1 Mbit/s)")
    ax.set_ylabel("held-out eval loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=120.0, help="seconds of training per way")
    parser.add_argument("--out", type=Path, default=race.RESULTS / "race_thin.json")
    parser.add_argument("--ways", default=",".join(STRATEGIES), help="comma-separated, of: " + ", ".join(STRATEGIES))
    parser.add_argument("--thin-set", default="", metavar="KEY=VALUE ...", help="settings on top for the thin way")
    args = parser.parse_args(argv)
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = [w for w in ways if w not in STRATEGIES]
    if unknown:
        parser.error(f"--ways: unknown {', '.join(unknown)} (choose from {', '.join(STRATEGIES)})")
    ways = [f"{w} {args.thin_set}".strip() if w == race.THIN else w for w in ways]
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"dld-race-thin-{os.getpid()}"
    runs: dict[str, dict[str, Any]] = {}
    try:
        with Sites(work / "sites", race.SITES, rate=JOIN_RATE, operator_rate=JOIN_RATE, prefix="dlt") as sites:
            for strategy in (w for w in ways if w != STRATEGIES[0]):
                runs[strategy] = thinned_fleet(sites, strategy, args.window, work)
                print(f"{strategy}: done", flush=True)
        if STRATEGIES[0] in ways:  # ~40 s a step at 1 Mbit/s, after DDP's first broadcast of the model
            with Sites(work / "dp-sites", race.SITES, rate=RATE, prefix="dlt") as sites, race.forwarding():
                runs[STRATEGIES[0]] = race.run_dp(sites, args.window, work, eval_every=1, first_step_s=600)
            print(f"{STRATEGIES[0]}: done", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = rows(runs)
    race.print_table(table)
    result = {"window_s": args.window, "rate": RATE, "settings": race.SETTINGS, "rows": table, "runs": runs}
    result["verdict"] = verdict(table)
    print(json.dumps(result["verdict"], indent=1))
    args.out.write_text(json.dumps(result, indent=1))
    plot(runs, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
