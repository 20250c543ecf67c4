"""Benchmark: round composition, homogeneous and heterogeneous fleets (issues 9 and 17).

Four learners train gpt-tiny for the same window of D seconds (from the moment all four train),
with dldctl's default outer optimizer (plain averaging: outer lr 1, momentum 0), in these configurations:

- **homogeneous, defaults**: four learners of one speed, dldctl's defaults (quorum 1, the
  syncer's round clock, `grace_gamma = 0.5`, rebase). Target: at least 3.5 contributors per
  round on average with a blocked share under 2%;
- and, on a heterogeneous fleet (two fast learners and two throttled ones, `throttle = 2.0`: each
  step sleeps as long as it computed, so they run at about half speed):
- **defaults**; **defaults, no grace** (`grace_gamma = 0`: a called round waits tau fleet steps);
- **own clocks** (`round_clock = "learner"`, the rule before: each learner pushes on its own step
  counter; a round closes with one contribution after ALGORITHM.md's adaptive grace window);
- **quorum 4 (all)**, overlap on: every round waits for every learner.

Reported for each: goodput over the window (as in bench/goodput.py, from the syncer's samples),
tokens merged per second, the eval loss of the final global model (`bench.evaluate`), and from
the syncer's `round` records in `metrics.jsonl`: contributors per round (mean and histogram), the
share of rounds with a slow learner in them, the grace window granted and how much of it was used,
and each learner's share of the merged tokens. The comparison is at equal wall time, not equal
tokens: a heterogeneous fleet is about not letting the slow learners hold the fast ones back.

    .venv/bin/python bench/heterogeneous.py            # full: D = 90 s, ~10 min on 2 cores
    .venv/bin/python bench/heterogeneous.py --quick    # D = 30 s, ~4.5 min
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.fleet import OuterOptimizer, Plan, diloco_run, local_host, run_diloco
from syncer.common.settings import RunSettings

LEARNERS = 4
SLOW = {"learner-2", "learner-3"}  # inventory order: host "fast" (2 learners), then host "slow" (2)


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=None, help="window D in seconds (default 90, quick 30)")
    parser.add_argument("--H", type=int, default=32)


HOMOGENEOUS = [local_host("here", LEARNERS)]
HETEROGENEOUS = [local_host("fast", 2), local_host("slow", 2, throttle=2.0)]


def configs(H: int) -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """(name, [run] table, hosts) of every configuration."""
    outer: OuterOptimizer = {"outer_lr": RunSettings.outer_lr, "outer_momentum": RunSettings.outer_momentum}
    return [
        ("homogeneous, defaults", diloco_run(H, **outer), HOMOGENEOUS),
        ("heterogeneous, defaults", diloco_run(H, **outer), HETEROGENEOUS),
        ("heterogeneous, defaults, no grace", diloco_run(H, grace_gamma=0.0, **outer), HETEROGENEOUS),
        (
            "heterogeneous, own clocks (before)",
            diloco_run(H, round_clock="learner", rebase=False, **outer),
            HETEROGENEOUS,
        ),
        ("heterogeneous, quorum 4 (all)", diloco_run(H, quorum=LEARNERS, **outer), HETEROGENEOUS),
    ]


def round_stats(rounds: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """Contributors per round, slow-learner participation, grace, per-learner token shares (window only)."""
    inside = [r for r in rounds if start <= r["t"] <= end]
    counts = [len(r["contributors"]) for r in inside]
    shares: collections.Counter = collections.Counter()
    for r in inside:
        for lid, w in r["weights"].items():
            shares[lid] += w * r["tokens"]
    total = sum(shares.values()) or 1.0
    return {
        "rounds": len(inside),
        "mean_contributors": statistics.fmean(counts) if counts else 0.0,
        "histogram": dict(sorted(collections.Counter(counts).items())),
        "with_slow": sum(1 for r in inside if SLOW & set(r["contributors"])) / max(1, len(inside)),
        "grace_s_mean": statistics.fmean(r["grace_s"] for r in inside) if inside else 0.0,
        "grace_used_s_mean": statistics.fmean(r["grace_used_s"] for r in inside) if inside else 0.0,
        "wait_quorum_s_mean": statistics.fmean(r["wait_quorum_s"] for r in inside) if inside else 0.0,
        "share": {lid: shares[lid] / total for lid in sorted(shares)},
    }


def row(name: str, res: dict[str, Any]) -> dict[str, Any]:
    st = res["round_stats"]
    return {
        "config": name,
        "goodput": res["window"]["goodput"],
        "tokens merged/s": res["window"]["tokens_merged_per_s"],
        "eval loss": res["eval_loss"],
        "rounds": st["rounds"],
        "contrib/round": st["mean_contributors"],
        "merged/trained": res["tokens_merged"] / max(1, res["tokens_trained"]),
        "blocked": res.get("blocked_share"),
        "rounds with a slow learner": st["with_slow"],
        "grace ms": 1e3 * st["grace_s_mean"],
        "grace used ms": 1e3 * st["grace_used_s_mean"],
        "slow share of merge weight": sum(v for k, v in st["share"].items() if k in SLOW),
        "contributors histogram": " ".join(f"{k}:{v}" for k, v in st["histogram"].items()),
    }


def plot(results: dict[str, Any], path: Path) -> None:
    """Histogram of contributors per round for each configuration."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 3.6))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    width = 0.8 / max(1, len(results))
    for i, (name, res) in enumerate(results.items()):
        hist = res["round_stats"]["histogram"]
        n = sum(hist.values()) or 1
        xs = [k + (i - (len(results) - 1) / 2) * width for k in range(1, LEARNERS + 1)]
        ax.bar(xs, [hist.get(k, 0) / n for k in range(1, LEARNERS + 1)], width, label=name)
    ax.set_xticks(range(1, LEARNERS + 1))
    ax.set_xlabel("contributors per merge round")
    ax.set_ylabel("share of rounds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("heterogeneous", __doc__, _extra, argv)
    duration = args.duration or (30.0 if args.quick else 90.0)
    results: dict[str, Any] = {}
    for i, (name, run, hosts) in enumerate(configs(args.H)):
        res = run_diloco(
            Plan(
                f"het{i}-q{run['quorum']}",
                run,
                hosts,
                LEARNERS,
                duration_s=duration,
                inspect=lambda fleet: fleet.rounds(),
            )
        )
        res["round_stats"] = round_stats(res.pop("inspect"), res["training_started"], res["training_ended"])
        results[name] = res
    rows = [row(name, res) for name, res in results.items()]
    common.print_table(
        f"Round composition: 4 learners (heterogeneous: 2 fast + 2 throttled x2), gpt-tiny, H={args.H}, "
        f"{duration:g} s window",
        rows,
    )
    homo = rows[0]
    met = homo["contrib/round"] >= 3.5 and (homo["blocked"] or 0.0) < 0.02
    print(
        f"homogeneous fleet at the defaults: {homo['contrib/round']:.2f} contributors per round, blocked "
        f"{100 * (homo['blocked'] or 0.0):.1f}% (target >= 3.5 and < 2%: {'MET' if met else 'MISSED'})"
    )
    png = args.out.with_suffix(".png")
    plot(results, png)
    common.write_json(
        args.out,
        {
            "benchmark": "heterogeneous",
            "quick": args.quick,
            "duration_s": duration,
            "rows": rows,
            "runs": results,
            "plot": common.shown(png),
            "homogeneous_met": met,
        },
    )
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
