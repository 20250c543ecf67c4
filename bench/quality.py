"""Benchmark: eval loss at equal tokens, data-parallel vs synchronous vs Decoupled DiLoCo at
dldctl's defaults (issues 9 and 17).

The strategies train the same model on the same data with the same per-worker batch, inner
optimizer (AdamW, cosine learning rate to 10% at the budget, `--set` to change) and token budget
(4 workers x `steps` x batch x seq_len); every DiLoCo fleet, the synchronous one too, uses
dldctl's default outer optimizer (Nesterov 0.6 / 0.8: the synchronous fleet's best measured, 1.622
against 1.692 with DiLoCo's 0.7 / 0.9 at H = 32, three seeds, BENCHMARKS.md):

- **data-parallel**: torchrun + gloo, 4 workers, `steps` steps of the 4 x batch global batch
  (`bench.ddp_baseline.run_ddp`);
- **synchronous DiLoCo**: the same 4 learners with `quorum = 4`, `overlap = false` (every learner
  waits for every merge of its fragment), `steps` inner steps each;
- **Decoupled DiLoCo at dldctl's defaults**: nothing set but the workload and H: quorum 1,
  overlap, the grace window, the syncer's round clock, rebase, the backlog bound;
- **the same under a chaos monkey**: `dldctl chaos monkey --actions kill,pause,slow,partition`
  injects faults (mean 15 s apart, 5 s each, seeded); a killed learner restarts and trains a fresh
  `steps` budget, so this run is stopped once the fleet has trained the same token budget (read
  from the syncer's 2 s samples: it may overshoot by one sample);
- with `--tuned`, also the previous benchmark's tuned fleet (quorum 4, rebase, max_lag 2), with
  and without the monkey; with `--legacy`, the defaults before the syncer called the rounds
  (each learner on its own step counter, overwrite).

Each Decoupled row also gives the round composition: contributors per round, the share of
trained tokens that reached the global model (merged/trained) and the learners' blocked share.
The budget is 8,000 steps per learner (8.2 M tokens): at 1,500 steps even synchronous DiLoCo is
5-7% above data-parallel on this model (BENCHMARKS.md). The Decoupled fleets are not
deterministic (merge order and timing): `--repeats N` runs each N times and reports the mean eval
loss and its range; data-parallel (gloo, fixed seeds) and the synchronous fleet repeat themselves.
Every run's *final global model* (`final_model.pt`, DP: its final checkpoint) is scored by one
function (`bench.evaluate.eval_loss`) on the learners' 16 held-out eval batches. Targets for the
defaults: within 1% of synchronous DiLoCo and 3% of data-parallel without failures, within 5% of
data-parallel under the monkey.

    .venv/bin/python bench/quality.py            # full: 8000 steps per learner, one run of each fleet, ~12 min
    .venv/bin/python bench/quality.py --quick    # 400 steps, ~2 min
    .venv/bin/python bench/quality.py --steps 2000 --repeats 3 --legacy   # ~10 min
    .venv/bin/python bench/quality.py --H 64 --set lr_schedule=cosine,model=gpt-small   # another H and model
    .venv/bin/python bench/quality.py --H 16 --chaos-only --set lr_schedule=cosine,model=gpt-small   # DP + monkey
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.common import overrides
from bench.dprun import run_dp
from bench.evaluate import relative_gap
from bench.fleet import OuterOptimizer, Plan, diloco_run, local_host, run_diloco
from bench.fleet_summary import tokens_per_step

LEARNERS = 4
TARGET_SYNC, TARGET_CLEAN, TARGET_CHAOS = 0.01, 0.03, 0.05


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=None, help="inner steps per learner (default 8000, quick 400)")
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1, help="chaos monkey seed")
    parser.add_argument("--mtbf", type=float, default=15.0, help="chaos monkey: mean seconds between faults")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each DiLoCo fleet")
    parser.add_argument(
        "--tuned",
        action="store_true",
        help="also the previous benchmark's tuned fleet (quorum 4, rebase, max_lag 2), with and without the monkey",
    )
    parser.add_argument(
        "--legacy",
        action="store_true",
        help="also the defaults before the syncer called the rounds (own clocks, overwrite)",
    )
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="KEY=VALUE,...",
        help="also run a fleet with these [run] overrides, e.g. H=64,outer_lr=0.7 (repeatable)",
    )
    parser.add_argument("--extra-only", action="store_true", help="DP and the --extra fleets only (a tuning sweep)")
    parser.add_argument(
        "--chaos-only",
        action="store_true",
        help="DP and the defaults under the chaos monkey only (the 5%% cell at another H or model)",
    )
    common.add_set_option(
        parser,
        "[run] overrides for every strategy, data-parallel included (default: lr_schedule=cosine)",
        default=["lr_schedule=cosine"],
    )


TUNED = {"rebase": True, "quorum": LEARNERS, "max_lag": 2}
TUNED_NAME = f"Decoupled DiLoCo, quorum {LEARNERS}, rebase, max_lag 2"
DEFAULTS_NAME = "Decoupled DiLoCo, dldctl defaults"
SYNC_NAME = "synchronous DiLoCo"


# the outer optimizer of the defaults before 2026-12-04 (DiLoCo's), kept for --legacy
LEGACY_OUTER: OuterOptimizer = {"outer_lr": 0.7, "outer_momentum": 0.9}
# the defaults before the syncer called the rounds: each learner on its own clock, overwrite
LEGACY = {"round_clock": "learner", "rebase": False, "max_backlog": 0.0, **LEGACY_OUTER}


def plans(args: argparse.Namespace, steps: int) -> list[tuple[str, Plan]]:
    """(strategy, plan) of the DiLoCo fleets: synchronous, the defaults with and without the
    monkey, then (--tuned) the tuned fleet of the previous benchmark, (--legacy) the defaults of
    before the round clock, and the --extra fleets."""
    hosts = [local_host("here", LEARNERS)]
    base = overrides(args.set)  # diloco_run: dldctl's default outer optimizer
    sync = diloco_run(args.H, quorum=LEARNERS, overlap=False, steps=steps, **base)
    dec = diloco_run(args.H, steps=steps, **base)
    budget = LEARNERS * steps * tokens_per_step(dec)

    def monkey(fleet: Any, start: float, stop: Any) -> dict[str, Any]:
        return fleet.monkey(args.mtbf, 3600, args.seed, "kill,pause,slow,partition", stop, fault_duration=5.0)

    def pair(name: str, tag: str, run: dict[str, Any]) -> list[tuple[str, Plan]]:
        return [
            (name, Plan(f"q-{tag}", run, hosts, LEARNERS)),
            (
                f"{name} + chaos monkey",
                Plan(f"q-{tag}-chaos", run, hosts, LEARNERS, budget_tokens=budget, chaos=monkey),
            ),
        ]

    extras = [
        (f"DiLoCo {spec}", Plan(f"q-x{i}", {**dec, **overrides(spec)}, hosts, LEARNERS))
        for i, spec in enumerate(args.extra)
    ]
    if args.extra_only:
        return extras
    if args.chaos_only:
        return [pair(DEFAULTS_NAME, "dec", dec)[1], *extras]
    out = [(SYNC_NAME, Plan("q-sync", sync, hosts, LEARNERS)), *pair(DEFAULTS_NAME, "dec", dec)]
    if args.tuned:
        out += pair(TUNED_NAME, "tuned", {**dec, **TUNED})
    if args.legacy:
        out.append(
            (
                "Decoupled DiLoCo, earlier defaults (own clocks, overwrite)",
                Plan("q-legacy", {**dec, **LEGACY}, hosts, LEARNERS),
            )
        )
    return out + extras


def row(strategy: str, tokens: int, loss: float, dp_loss: float | None, extra: dict[str, Any]) -> dict[str, Any]:
    return {"strategy": strategy, "tokens": tokens, "eval loss": loss, "vs DP": relative_gap(loss, dp_loss), **extra}


def diloco_row(strategy: str, runs: list[dict[str, Any]], dp_loss: float | None) -> dict[str, Any]:
    """Means over the repeats (eval loss also as min-max)."""
    mean = lambda f: statistics.fmean(f(r) for r in runs)
    losses = [r["eval_loss"] for r in runs]
    return row(
        strategy,
        round(mean(lambda r: r["tokens_trained"])),
        statistics.fmean(losses),
        dp_loss,
        {
            "eval min-max": f"{min(losses):.3f}-{max(losses):.3f}" if len(runs) > 1 else "-",
            "merged/trained": mean(lambda r: r["tokens_merged"] / max(1, r["tokens_trained"])),
            "contrib/round": mean(lambda r: r["mean_contributors"] or 0.0),
            "blocked": mean(lambda r: r.get("blocked_share") or 0.0),
            "faults": mean(lambda r: r["event_counts"].get("fault_inject", 0)),
            "train_s": mean(lambda r: r["train_s"]),
            "runs": len(runs),
        },
    )


def verdict(rows: list[dict[str, Any]], budget: int) -> dict[str, Any]:
    """The targets, for dldctl's defaults: within 1% of synchronous DiLoCo and 3% of data-parallel
    without failures, within 5% of data-parallel under the chaos monkey (a chaos run that trained
    more than 5% over the token budget is said to have, next to its result)."""
    by = {r["strategy"]: r for r in rows}
    clean, chaos, sync = by[DEFAULTS_NAME], by[f"{DEFAULTS_NAME} + chaos monkey"], by[SYNC_NAME]
    vs_sync = relative_gap(clean["eval loss"], sync["eval loss"])
    if vs_sync is None:  # the rows' losses are floats: only a zero reference loss gets here
        raise ValueError(f"no gap to synchronous DiLoCo: its eval loss is {sync['eval loss']!r}")
    ok = {
        "vs_sync": vs_sync <= TARGET_SYNC,
        "clean": clean["vs DP"] <= TARGET_CLEAN,
        "chaos": chaos["vs DP"] <= TARGET_CHAOS,
    }
    word = {True: "MET", False: "MISSED"}
    text = (
        f"dldctl defaults, no failures: {100 * vs_sync:+.1f}% vs synchronous DiLoCo (target <= +1%: "
        f"{word[ok['vs_sync']]}), {100 * clean['vs DP']:+.1f}% vs DP (target <= +3%: {word[ok['clean']]}); "
        f"chaos monkey: {100 * chaos['vs DP']:+.1f}% vs DP (target <= +5%: {word[ok['chaos']]})"
    )
    over = chaos["tokens"] / budget - 1.0
    if over > 0.05:
        text += f"; that chaos run trained {100 * over:.0f}% more tokens than the budget"
    return {
        "vs_sync_met": ok["vs_sync"],
        "clean_met": ok["clean"],
        "chaos_met": ok["chaos"],
        "vs_sync": vs_sync,
        "text": text,
    }


def chaos_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """`--chaos-only`: the defaults under the chaos monkey within 5% of data-parallel."""
    gap = next(r for r in rows if r["strategy"] == f"{DEFAULTS_NAME} + chaos monkey")["vs DP"]
    met = gap <= TARGET_CHAOS
    text = f"chaos monkey: {100 * gap:+.1f}% vs DP (target <= +5%: {'MET' if met else 'MISSED'})"
    return {"chaos_met": met, "text": text}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 1.6 + 0.5 * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    dp = rows[0]["eval loss"]
    rows = [r for r in rows if r["eval loss"] is not None]
    if not rows:
        return
    palette = ["tab:orange", "tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray"]
    ax.barh(
        [r["strategy"] for r in rows][::-1],
        [r["eval loss"] for r in rows][::-1],
        color=[palette[i % len(palette)] for i in range(len(rows))][::-1],
    )
    if dp is not None:
        ax.axvline(dp * 1.03, color="k", ls=":", label="DP + 3%")
        ax.axvline(dp * 1.05, color="k", ls="--", label="DP + 5%")
        ax.legend(fontsize=8)
    ax.set_xlim(min(r["eval loss"] for r in rows) * 0.9, max(r["eval loss"] for r in rows) * 1.05)
    ax.set_xlabel("eval loss of the final model (equal tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("quality", __doc__, _extra, argv)
    steps = args.steps or (400 if args.quick else 8000)
    todo = plans(args, steps)
    settings = diloco_run(args.H, steps=steps, **overrides(args.set))
    budget = LEARNERS * steps * tokens_per_step(settings)
    dp = run_dp(settings, LEARNERS, budget_tokens=budget, checkpoint_every_s=600)
    dp_loss = dp["eval_loss_shared"]
    if dp_loss is None:  # the DiLoCo fleets still run: their rows lose only the "vs DP" column
        tail = dp.get("log_tail", "").strip().splitlines()[-1:] or ["(empty log)"]
        print(f"data-parallel baseline failed (exit {dp.get('returncode')}): {tail[0]}", file=sys.stderr)
    rows = [
        row(
            "data-parallel (gloo)",
            dp["tokens"],
            dp_loss,
            dp_loss,
            {
                "eval min-max": "-",
                "merged/trained": 1.0,
                "contrib/round": float(LEARNERS),
                "blocked": None,
                "faults": 0,
                "train_s": dp.get("train_window_s") or dp["wall_s"],
                "runs": 1,
            },
        )
    ]
    runs: dict[str, Any] = {"data-parallel": dp}
    for strategy, plan in todo:
        runs[strategy] = [run_diloco(plan) for _ in range(max(1, args.repeats))]
        rows.append(diloco_row(strategy, runs[strategy], dp_loss))
    common.print_table(
        f"Quality at equal tokens: {LEARNERS} learners/workers, {settings['model']} "
        f"seq {settings['seq_len']} batch {settings['batch_size']}, "
        f"{steps} steps each, H={args.H}",
        rows,
    )
    if args.extra_only:
        result = {"text": "tuning sweep: no verdict"}
    elif args.chaos_only and dp_loss is not None:
        result = chaos_verdict(rows)
    elif dp_loss is None:
        result = {"text": "no verdict: the data-parallel baseline has no eval loss (see its log_tail)"}
    else:
        result = verdict(rows, budget)
    print(result["text"])
    png = args.out.with_suffix(".png")
    common.write_json(
        args.out,
        {
            "benchmark": "quality",
            "quick": args.quick,
            "steps_per_learner": steps,
            "budget_tokens": budget,
            "settings": settings,
            "rows": rows,
            "verdict": result,
            "runs": runs,
            "plot": common.shown(png),
        },
    )
    try:  # after the results are on disk: a plot never costs a run's numbers
        plot(rows, png)
    except Exception as exc:  # any of matplotlib's errors: the table and JSON stand
        print(f"no plot ({type(exc).__name__}: {exc})", file=sys.stderr)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
