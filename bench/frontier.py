"""Benchmark: the thin-link frontier, wire bytes per token against held-out loss (issue 52).

At dldctl's defaults, fleets of 4 local learners train the same steps each, for every codec at
H = 32 and 64 (none, int4, 2bit and topk, the last two with error feedback) and int4 at H = 16
and 128 (today's bandwidth at the default codec). The syncer counts every frame it receives (up)
and sends (down), joins, heartbeats and state fetches included (bench/bandwidth.py's `row`).

Baseline, same run: data-parallel (torchrun, gloo, 4 workers) on the same tokens, its ring
all-reduce bytes sent plus received. Each final global model and the DP model are scored by
`bench.evaluate` on the same held-out batches.

Targets: a setting at >= 1,000x fewer bytes per token than DP within 2% of its loss, and one at
>= 3,000x within 4%.

    .venv/bin/python bench/frontier.py                       # gpt-small, 8,000 steps: hours on 2 cores
    .venv/bin/python bench/frontier.py --set model=gpt-tiny  # the BENCHMARKS.md run, ~40 min
    .venv/bin/python bench/frontier.py --quick               # int4 and topk at H = 32, gpt-tiny, 400 steps
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.bandwidth import LEARNERS, dp_baseline, row, run_fleets
from bench.fleet import diloco_run

CASES = [(c, h) for h in (32, 64) for c in ("none", "int4", "2bit", "topk")] + [("int4", 16), ("int4", 128)]
QUICK_CASES = [("int4", 32), ("topk", 32)]
TARGETS = ((1000.0, 0.02), (3000.0, 0.04))  # (x fewer bytes per token than DP, within this of its loss)


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=None, help="inner steps per learner (default 8000, quick 400)")
    parser.add_argument("--cases", default="", help="only these, e.g. topk:32,2bit:64 (default: all)")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="KEY=VALUE,...", help="every case again with these on top"
    )
    common.add_set_option(parser, "settings for every fleet and DP (e.g. model=gpt-tiny)")


def cases(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(compression, H) of each fleet."""
    if args.cases:
        return [(c, int(h)) for c, h in (item.split(":") for item in args.cases.split(","))]
    return QUICK_CASES if args.quick else CASES


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per target, the setting with the most bytes saved within its loss gap, and whether it reaches the ratio."""
    out: dict[str, Any] = {"targets": []}
    for ratio, gap in TARGETS:
        ok = [r for r in rows if r["vs DP"] is not None and r["vs DP"] <= gap]
        best = max(ok, key=lambda r: r["x less than DP"]) if ok else None
        met = bool(best and best["x less than DP"] >= ratio)
        where = (
            f"{best['compression']} H={best['H']}: {best['x less than DP']:.0f}x at {100 * best['vs DP']:+.1f}%"
            if best
            else "none"
        )
        out["targets"].append({"ratio": ratio, "gap": gap, "best": best, "met": met})
        out.setdefault("text", []).append(
            f">= {ratio:,.0f}x within {100 * gap:.0f}% of DP: {'MET' if met else 'MISSED'} (best in the gap: {where})"
        )
    default = next((r for r in rows if r["compression"] == "int4" and r["H"] == 32), None)
    if default:
        out["default"] = (
            f"the default (int4, H=32 here): {default['x less than DP']:.0f}x at {100 * default['vs DP']:+.1f}%"
        )
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Loss gap to DP against bytes saved, one point per setting, the target boxes shaded."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    colors = {"none": "tab:gray", "int4": "tab:blue", "2bit": "tab:orange", "topk": "tab:green"}
    for r in rows:
        ax.scatter(r["x less than DP"], 100 * r["vs DP"], color=colors.get(r["compression"], "k"))
        label = f"{r['compression']} H={r['H']}" + ("" if r["fleet"] == "defaults" else f" {r['fleet']}")
        ax.annotate(label, (r["x less than DP"], 100 * r["vs DP"]), fontsize=7)
    for ratio, gap in TARGETS:
        ax.plot([ratio, ratio], [-100, 100 * gap], color="tab:red", ls=":")
        ax.plot([ratio, 1e5], [100 * gap, 100 * gap], color="tab:red", ls=":")
    ax.set_xscale("log")
    ax.set_ylim(min(-1.0, *(100 * r["vs DP"] for r in rows)) - 1, max(5.0, *(100 * r["vs DP"] for r in rows)) + 1)
    ax.set_xlabel("x fewer wire bytes per token than data-parallel (up + down)")
    ax.set_ylabel("held-out loss vs data-parallel, %")
    ax.set_title("The thin-link frontier (targets dotted: >= 1,000x within 2%, >= 3,000x within 4%)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("frontier", __doc__, _extra, argv)
    steps = args.steps or (400 if args.quick else 8000)
    base = {"model": "gpt-tiny" if args.quick else "gpt-small", **common.overrides(args.set)}
    variants: list[tuple[str, dict[str, Any]]] = [("defaults", {})]
    variants += [(v, common.overrides(v)) for v in args.variant]
    todo = [(label, c, h, extra) for label, extra in variants for c, h in cases(args)]
    runs = [diloco_run(h, compression=c, steps=steps, **{**base, **extra}) for _, c, h, extra in todo]
    params, dp, dp_raw = dp_baseline(diloco_run(32, steps=steps, **base), steps)
    results = run_fleets(runs, "fr", timeout_s=max(900.0, steps * 0.6))
    rows = [row(label, r, params, dp) for (label, *_), r in zip(todo, results)]
    common.print_table(
        f"Frontier: {LEARNERS} learners, {base['model']} ({params} params), {steps} steps each, "
        f"DP {dp['bytes_per_token']:.0f} B/token, DP eval {dp['eval_loss']:.4f}",
        rows,
    )
    result = verdict(rows)
    print("\n".join(result["text"] + [result.get("default", "")]))
    png = args.out.with_suffix(".png")
    plot(rows, png)
    common.write_json(
        args.out,
        {
            "benchmark": "frontier",
            "quick": args.quick,
            "steps_per_learner": steps,
            "set": base,
            "learners": LEARNERS,
            "params": params,
            "dp": dp,
            "dp_run": dp_raw,
            "rows": rows,
            "runs": results,
            "verdict": result,
            "plot": common.shown(png),
        },
    )
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
