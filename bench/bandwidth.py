"""Benchmark: bytes on the wire per token trained, Decoupled DiLoCo vs data-parallel (issue 9, item 1).

For each case (compression none / bf16 / int8 / int4 at H = 32, and int4 at several H), a
fleet of 4 local learners (gpt-tiny, seq 32, batch 8, quorum 1, 4 fragments) trains the same
number of steps per learner; the syncer counts every frame it receives (`bytes.up`) and sends
(`bytes.down`), joins, heartbeats and state fetches included. Reported per token trained:

- total = (up + down) / tokens trained, over the whole run (`dldctl down --json`);
- steady = the same ratio between two syncer samples once every learner trains (no join fetches);
- closed form, upstream only: bytes(params) x bits/32 / H / tokens per step (ALGORITHM.md), with
  bits = 32, 16, 8.25, 4.25 (an fp32 absmax scale per 128 values), before zstd.

Baseline, same run: data-parallel with `torch.distributed` gloo under torchrun (4 workers, the same
model, data, per-worker batch and inner optimizer, the same total tokens): the gradient bytes its
ranks hand to all-reduce, counted, times the ring's 2(N-1)/N, sent and received (as our up + down);
and its closed form 2 x 2(N-1)/N x 4 x params per worker step. Ratio = DP bytes per token / ours.
Each case's final global model and the DP model are scored by `bench.evaluate` on the same
held-out batches. Target: >= 400x less than DP with int4, at an eval loss within 3% of DP.

    .venv/bin/python bench/bandwidth.py            # full: 7 fleets + DP, ~8 min on 2 cores
    .venv/bin/python bench/bandwidth.py --quick    # int4 and none at H = 32 + DP, ~2 min
    .venv/bin/python bench/bandwidth.py --extra-only --set lr_schedule=cosine --extra quorum=4,rebase=true,max_lag=2
        # only the --extra fleets (int4, H = --ref-h, each KEY=VALUE on top) + DP; --set applies to all
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.dprun import run_dp
from bench.evaluate import relative_gap
from bench.fleet import Plan, diloco_run, local_host, run_diloco
from bench.fleet_summary import tokens_per_step
from workload.gpt import param_shapes

LEARNERS = 4
BITS = {"none": 32.0, "bf16": 16.0, "int8": 8.25, "int4": 4.25, "2bit": 2.25, "topk": (64 * 18 + 32) / 4096}
TARGET_RATIO, TARGET_GAP = 400.0, 0.03


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=None, help="inner steps per learner (default 1500, quick 400)")
    parser.add_argument("--ref-h", type=int, default=32, help="H of the compression sweep")
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="KEY=VALUE,...",
        help="one more int4 fleet at H = --ref-h with these settings on top (repeatable)",
    )
    parser.add_argument("--extra-only", action="store_true", help="DP and the --extra fleets only")
    common.add_set_option(parser, "settings for every fleet and DP")


def fleets(args: argparse.Namespace, steps: int) -> list[tuple[str, dict[str, Any]]]:
    """(label, [run] table) of every fleet: the sweep unless --extra-only, then each --extra."""
    base = common.overrides(args.set)
    out = (
        []
        if args.extra_only
        else [("defaults", diloco_run(h, compression=c, steps=steps, **base)) for c, h in cases(args.quick, args.ref_h)]
    )
    return out + [
        (spec, {**diloco_run(args.ref_h, steps=steps, **base), **common.overrides(spec)}) for spec in args.extra
    ]


def cases(quick: bool, ref_h: int) -> list[tuple[str, int]]:
    """(compression, H) of every fleet run."""
    if quick:
        return [("int4", ref_h), ("none", ref_h)]
    sweep = [(c, ref_h) for c in ("none", "bf16", "int8", "int4")]
    return sweep + [("int4", h) for h in (16, 64, 128) if h != ref_h]


def n_params(model: str, seq_len: int) -> int:
    from math import prod

    return sum(prod(shape) for name, shape in param_shapes(model, block_size=seq_len) if name != "lm_head.weight")


def dp_closed_form(params: int, workers: int, tok_per_worker_step: int) -> float:
    """Ring all-reduce of fp32 gradients, sent + received, per token trained."""
    return 2 * 2 * (workers - 1) / workers * 4 * params / tok_per_worker_step


def row(label: str, res: dict[str, Any], params: int, dp: dict[str, Any]) -> dict[str, Any]:
    run = res["run"]
    closed_up = params * BITS[run["compression"]] / 8 / run["H"] / tokens_per_step(run)
    dp_bpt = dp["bytes_per_token"]
    return {
        "fleet": label,
        "compression": run["compression"],
        "H": run["H"],
        "tokens": res["tokens_trained"],
        "up B/tok": res["up_per_token"],
        "down B/tok": res["down_per_token"],
        "total B/tok": res["bytes_per_token"],
        "steady B/tok": res["steady_bytes_per_token"] or float("nan"),
        "closed up B/tok": closed_up,
        "DP B/tok": dp_bpt,
        "x less than DP": dp_bpt / res["bytes_per_token"],
        "contrib/round": res["mean_contributors"] or 0.0,
        "eval": res["eval_loss"],
        "vs DP": relative_gap(res["eval_loss"], dp["eval_loss"]),
    }


def _label(r: dict[str, Any]) -> str:
    return f"{r['compression']} H={r['H']}" + ("" if r["fleet"] == "defaults" else f" {r['fleet']}")


def plot(rows: list[dict[str, Any]], dp: dict[str, Any], path: Path) -> None:
    """Bytes per token (log scale) per case next to DP; eval loss against bytes per token."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax, ax2 = fig.subplots(1, 2)
    labels = ["DP (gloo)"] + [_label(r) for r in rows]
    values = [dp["bytes_per_token"]] + [r["total B/tok"] for r in rows]
    ax.bar(range(len(values)), values, color=["tab:red"] + ["tab:blue"] * len(rows))
    ax.set_yscale("log")
    ax.set_xticks(range(len(values)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("bytes on the wire per token (up + down)")
    ax.set_title("Wire bytes per token trained")
    for r in rows:
        ax2.scatter(r["total B/tok"], r["eval"], color="tab:blue")
        ax2.annotate(_label(r), (r["total B/tok"], r["eval"]), fontsize=7)
    ax2.scatter(dp["bytes_per_token"], dp["eval_loss"], color="tab:red", label="DP")
    ax2.axhline(dp["eval_loss"] * (1 + TARGET_GAP), color="tab:red", ls=":", label="DP + 3%")
    ax2.set_xscale("log")
    ax2.set_xlabel("bytes per token")
    ax2.set_ylabel("eval loss (final global model)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("bandwidth", __doc__, _extra, argv)
    steps = args.steps or (400 if args.quick else 1500)
    todo = fleets(args, steps)
    shared = diloco_run(args.ref_h, steps=steps, **common.overrides(args.set))
    params, dp, dp_raw = dp_baseline(shared, steps)
    results = run_fleets([run for _, run in todo], "bw")
    rows = [row(label, r, params, dp) for (label, _), r in zip(todo, results)]
    common.print_table(
        f"Bandwidth: {LEARNERS} learners, gpt-tiny ({params} params), {steps} steps each, "
        f"DP {dp['bytes_per_token']:.0f} B/token measured, {dp['closed_form']:.0f} closed form, "
        f"DP eval {dp['eval_loss']:.4f}",
        rows,
    )
    verdict = targets(rows)
    print(verdict["text"])
    png = args.out.with_suffix(".png")
    plot(rows, dp, png)
    common.write_json(
        args.out,
        {
            "benchmark": "bandwidth",
            "quick": args.quick,
            "steps_per_learner": steps,
            "set": common.overrides(args.set),
            "learners": LEARNERS,
            "params": params,
            "dp": dp,
            "dp_run": dp_raw,
            "rows": rows,
            "runs": results,
            "verdict": verdict,
            "plot": common.shown(png),
        },
    )
    print(f"wrote {args.out} and {png}")
    return 0


def dp_baseline(shared: dict[str, Any], steps: int) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(parameters, DP's bytes per token and eval loss, its whole run): data-parallel on the
    tokens LEARNERS learners train in `steps` steps each, same model, data and batch."""
    params = n_params(shared["model"], shared["seq_len"])
    budget = LEARNERS * steps * tokens_per_step(shared)
    dp_raw = run_dp(shared, LEARNERS, budget_tokens=budget, checkpoint_every_s=600)
    dp = {
        "bytes_per_token": 2 * (dp_raw["wire_bytes_per_token"] or 0.0),
        "eval_loss": dp_raw["eval_loss_shared"],
        "closed_form": dp_closed_form(params, LEARNERS, tokens_per_step(shared)),
        "tokens": dp_raw["tokens"],
    }
    return params, dp, dp_raw


def run_fleets(runs: list[dict[str, Any]], prefix: str, timeout_s: float = 900) -> list[dict[str, Any]]:
    """Each [run] table as a local fleet of LEARNERS learners, one after the other."""
    return [
        run_diloco(
            Plan(
                f"{prefix}{i}-{run['compression']}-h{run['H']}",
                run,
                [local_host("here", LEARNERS)],
                LEARNERS,
                timeout_s=timeout_s,
            )
        )
        for i, run in enumerate(runs)
    ]


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The best int4 case that is within 3% of DP, and whether it is >= 400x below DP."""
    int4 = [r for r in rows if r["compression"] == "int4"]
    ok = [r for r in int4 if r["vs DP"] is not None and r["vs DP"] <= TARGET_GAP]
    best = max(ok or int4, key=lambda r: r["x less than DP"]) if int4 else None
    met = bool(best and best in ok and best["x less than DP"] >= TARGET_RATIO)
    text = (
        "no int4 case"
        if best is None
        else f"int4 H={best['H']} ({best['fleet']}): {best['x less than DP']:.0f}x less than DP "
        f"at eval {best['eval']:.4f} "
        f"({100 * best['vs DP']:+.1f}% vs DP): target {'MET' if met else 'MISSED'} "
        f"(>= {TARGET_RATIO:.0f}x within {100 * TARGET_GAP:.0f}%)"
    )
    return {"met": met, "best": best, "text": text}


if __name__ == "__main__":
    sys.exit(main())
