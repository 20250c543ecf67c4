"""Benchmark: goodput under failure, Decoupled vs synchronous DiLoCo vs data-parallel with restarts
(issue 9, item 3).

The same fleet (4 learners / 4 workers, gpt-tiny, seq 32, batch 8, one thread each) trains for
the same window of D seconds under the same seeded failure schedule,
`bench.ddp_baseline.failure_schedule(D, 20, seed)` (a Poisson process: a process killed on
average every 20 s), with the same seeded choice of victim (`random.Random(seed)`, as `run_ddp`
draws ranks):

- **Decoupled DiLoCo** (quorum 1, overlap; H = 32 as in bench/quality.py, overwriting replies
  (the default) and with `rebase = true` (a reply lands on top of the steps trained since the
  push, so none is lost), and in full mode also rebasing at H = 128):
  `dldctl chaos kill learner-<i> --signal KILL --force` at each time; the supervisor restarts the
  learner after `restart_delay_s = 0.5` (the default is 2 s) and it rejoins by fetching the global state;
- **synchronous DiLoCo** (quorum 4, overlap off): the same kills; every learner waits for every
  merge, so a dead learner stalls the others until it is back;
- **data-parallel** (torchrun + gloo, `--max-restarts` = number of kills): `run_ddp(kill_schedule=...)`
  SIGKILLs one worker at each time; torchrun restarts the whole job, which resumes from its last
  checkpoint (every 5 s).

**Measurement window**, the same for all: from the moment the whole fleet has started training
(DiLoCo: the first syncer sample in which all 4 learners have step > 0; DP: the first training
step of its first incarnation) to D seconds later (DP: to its final model, D s after launch plus
its start-up, reported). Kill times count from the window's start. One-time provisioning (process
start, torch import, first join) is excluded for all; every restart inside the window counts.

- DiLoCo goodput = merged learner compute time / provisioned learner time over the window, from
  the syncer's samples: merged_s(t) = goodput(t) x 4 x (t - syncer start), goodput = (merged_s(end)
  - merged_s(start)) / (4 x window) (`bench.fleet_summary.window_goodput`). Work still unmerged at the end
  of the window (at most H steps per fragment and learner) is not counted.
- DP goodput = compute time of the steps in the final model (summed over ranks) / (4 x window).
- tokens merged per second (DP: tokens in the final model per second) over the window.
- eval loss of each final model, by `bench.evaluate` on the same held-out batches.

Targets: Decoupled DiLoCo goodput >= 0.9 and >= 1.5x the data-parallel goodput.

    .venv/bin/python bench/goodput.py            # full: D = 100 s, + Decoupled rebase at H = 128, ~11 min on 2 cores
    .venv/bin/python bench/goodput.py --quick    # D = 40 s, ~3 min
    .venv/bin/python bench/goodput.py --extra quorum=2,rebase=true,max_lag=2   # one more Decoupled fleet
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.ddp_baseline import failure_schedule
from bench.dprun import run_dp
from bench.fleet import Plan, diloco_run, local_host, run_diloco

LEARNERS = 4
MTBF = 20.0
DP_BOOT_S = 8.0  # added to DP's duration, which counts from its launch: its window is then about D
TARGET_ABS, TARGET_RATIO = 0.9, 1.5


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=None, help="window D in seconds (default 100, quick 40)")
    parser.add_argument("--seed", type=int, default=1, help="failure schedule and victim seed")
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument(
        "--long-h",
        type=int,
        default=None,
        help="also run Decoupled DiLoCo at this H (default 128 in full mode, none in quick; 0 = none)",
    )
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="KEY=VALUE,...",
        help="also run Decoupled DiLoCo with these [run] overrides, e.g. quorum=2,max_lag=2 (repeatable)",
    )


def strategies(H: int, long_h: int, extra: Sequence[str] = ()) -> list[tuple[str, dict[str, Any]]]:
    """(name, [run] table): Decoupled at H, overwriting (the default) and rebasing replies (and
    rebasing at long_h unless 0, and with each `extra` override), synchronous at H."""
    out = [("Decoupled DiLoCo", diloco_run(H)), ("Decoupled DiLoCo, rebase", diloco_run(H, rebase=True))]
    if long_h:
        out.append((f"Decoupled DiLoCo, rebase, H={long_h}", diloco_run(long_h, rebase=True)))
    out += [(f"Decoupled DiLoCo, {spec}", {**diloco_run(H), **common.overrides(spec)}) for spec in extra]
    return [*out, ("synchronous DiLoCo", diloco_run(H, quorum=LEARNERS, overlap=False))]


def kills(schedule: list[float], seed: int) -> Any:
    def chaos(fleet: Any, start: float, stop: Any) -> list[dict[str, Any]]:
        return fleet.run_kills(schedule, LEARNERS, seed, start, stop)

    return chaos


def diloco_row(strategy: str, res: dict[str, Any]) -> dict[str, Any]:
    win = res["window"]
    return {
        "strategy": strategy,
        "window_s": win["window_s"],
        "kills": len(res["chaos"] or []),
        "goodput": win["goodput"],
        "goodput (syncer, from start)": res["goodput_syncer"],
        "tokens merged/s": win["tokens_merged_per_s"],
        "tokens trained/s": win["tokens_trained_per_s"],
        "eval loss": res["eval_loss"],
    }


def dp_row(res: dict[str, Any]) -> dict[str, Any]:
    return {
        "strategy": "data-parallel + restarts",
        "window_s": res.get("train_window_s") or 0.0,
        "kills": len(res["kills"]),
        "goodput": res.get("window_goodput") or 0.0,
        "goodput (syncer, from start)": res["goodput"],
        "tokens merged/s": res.get("window_tokens_per_s") or 0.0,
        "tokens trained/s": float("nan"),
        "eval loss": res["eval_loss_shared"] or float("nan"),
    }


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets, for the first (H as in bench/quality.py) and the best Decoupled row."""
    dec, dp = max(r["goodput"] for r in rows if r["strategy"].startswith("Decoupled")), rows[-1]["goodput"]
    ratio = dec / dp if dp else float("inf")
    met_abs, met_ratio = dec >= TARGET_ABS, ratio >= TARGET_RATIO
    return {
        "decoupled": dec,
        "dp": dp,
        "ratio": ratio,
        "abs_met": met_abs,
        "ratio_met": met_ratio,
        "first": rows[0]["goodput"],
        "text": f"Decoupled goodput {rows[0]['goodput']:.3f} at H as quality, best {dec:.3f} "
        f"(target >= {TARGET_ABS}: {'MET' if met_abs else 'MISSED'}), "
        f"{ratio:.2f}x data-parallel (target >= {TARGET_RATIO}x: {'MET' if met_ratio else 'MISSED'})",
    }


def _color(strategy: str) -> str:
    return {
        "Decoupled DiLoCo": "tab:blue",
        "synchronous DiLoCo": "tab:green",
        "data-parallel + restarts": "tab:red",
    }.get(strategy, "tab:cyan")


def plot(rows: list[dict[str, Any]], runs: dict[str, Any], path: Path) -> None:
    """Goodput per strategy, and the Decoupled fleet's trailing goodput over time with the kills."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.8))
    FigureCanvasAgg(fig)
    ax, ax2 = fig.subplots(1, 2)
    colors = [_color(r["strategy"]) for r in rows]
    ax.bar([textwrap.fill(r["strategy"], 16) for r in rows], [r["goodput"] for r in rows], color=colors)
    ax.axhline(TARGET_ABS, color="k", ls=":", label="target 0.9")
    ax.set_ylim(0, 1)
    ax.set_ylabel("goodput over the window")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8)
    for name, res in runs.items():
        if name == "data-parallel":
            continue
        color = _color(name)
        start = res["training_started"]
        pts = [(s["t"] - start, s["tokens_merged"]) for s in res["samples"] if s["t"] >= start - 2]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], color=color, label=name)
        for k in res["chaos"] or []:
            ax2.axvline(k["t"], color=color, alpha=0.3, lw=0.8)
    ax2.set_xlabel("seconds since the fleet started training (vertical lines: kills)")
    ax2.set_ylabel("tokens merged")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("goodput", __doc__, _extra, argv)
    duration = args.duration or (40.0 if args.quick else 100.0)
    if args.long_h is None:
        args.long_h = 0 if args.quick else 128
    schedule = failure_schedule(duration, MTBF, args.seed)
    hosts = [local_host("here", LEARNERS)]
    keep = lambda fleet: fleet.samples()
    runs: dict[str, Any] = {}
    for i, (name, run) in enumerate(strategies(args.H, args.long_h, args.extra)):
        res = run_diloco(
            Plan(
                f"gp{i}-q{run['quorum']}-h{run['H']}",
                run,
                hosts,
                LEARNERS,
                duration_s=duration,
                chaos=kills(schedule, args.seed),
                inspect=keep,
            )
        )
        res["samples"] = res.pop("inspect")
        runs[name] = res
    settings = runs["Decoupled DiLoCo"]["run"]
    runs["data-parallel"] = run_dp(
        settings,
        LEARNERS,
        duration_s=duration + DP_BOOT_S,
        kill_schedule=schedule,
        seed=args.seed,
        checkpoint_every_s=5.0,
    )
    rows = [diloco_row(n, r) for n, r in runs.items() if n != "data-parallel"] + [dp_row(runs["data-parallel"])]
    common.print_table(
        f"Goodput under failure: {LEARNERS} learners/workers, gpt-tiny, H={args.H}, window {duration:g} s, "
        f"kills at {schedule} (mean every {MTBF:g} s, seed {args.seed})",
        rows,
    )
    result = verdict(rows)
    print(result["text"])
    png = args.out.with_suffix(".png")
    plot(rows, runs, png)
    common.write_json(
        args.out,
        {
            "benchmark": "goodput",
            "quick": args.quick,
            "duration_s": duration,
            "mtbf_s": MTBF,
            "seed": args.seed,
            "schedule": schedule,
            "settings": settings,
            "rows": rows,
            "verdict": result,
            "runs": runs,
            "plot": common.shown(png),
        },
    )
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
