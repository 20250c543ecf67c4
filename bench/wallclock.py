"""Benchmark: the global model's held-out loss at equal wall time, under a learner killed every
20 s on average (issue 17): Decoupled DiLoCo at dldctl's defaults against synchronous DiLoCo,
data-parallel with restarts and torchft's fault-tolerant DiLoCo.

Every strategy trains the same model (gpt-tiny, seq 32, batch 8 per worker, constant learning
rate after warm-up, 4 workers, one thread each), the same data shards and the same H for the same
window of D seconds, under the same seeded kill schedule (`bench.ddp_baseline.failure_schedule`:
a Poisson process, mean 20 s; victims drawn with `random.Random(seed)`), counted from the moment
the whole fleet trains:

- **Decoupled DiLoCo, dldctl defaults** (quorum 1, overlap, the syncer's round clock, rebase) and
  **synchronous DiLoCo** (quorum 4, overlap off), both with dldctl's default outer optimizer
  (Nesterov 0.6 / 0.8, the synchronous fleet's best measured too):
  `dldctl chaos kill learner-<i> --signal KILL`; the supervisor restarts the learner after 0.5 s;
- **data-parallel + restarts** (torchrun + gloo; the job restarts from its last checkpoint, every 5 s);
- **torchft DiLoCo** (`bench.torchft_diloco`: torchft 0.2.0's Lighthouse, one replica group per
  worker on gloo, `torchft.local_sgd.DiLoCo` at the same H and outer optimizer), each kill a
  SIGKILL of that replica group, restarted after 0.5 s to recover from a live peer. Skipped, with
  the reason, where torchft is not installed (`pip install torchft==0.2.0`).

Decoupled DiLoCo and torchft also run once without kills, so each strategy's throughput under
kills is reported as a share of its own clean run. Measured: the held-out loss of the final global
model (`bench.evaluate.eval_loss`, the same 16 batches for all), and a curve of it against wall
time: the DiLoCo fleets' global model from every syncer checkpoint (one every 10 merges),
data-parallel's model at its evaluations (a restart rolls it back to its checkpoint, which shows),
torchft's replica 0 at its evaluations. Target: the defaults end below synchronous DiLoCo,
data-parallel + restarts and torchft, and keep a larger share of their clean throughput than torchft.

One device per learner (`--throttle`): a real fleet gives each learner its own accelerator, so a
learner that waits (for a synchronous round, for a restarting peer, for an all-reduce) leaves that
device idle. Four CPU-bound learners on two cores do not: a waiting learner hands its core to the
others, and the fleet that waits most loses least. Every learner, data-parallel rank and torchft
replica therefore waits (F - 1) x its step's compute after each step (a `[[hosts]]` `throttle`;
the same `learner.files.Slowdown` rule in the workers), F = 3 by default on a machine with fewer
than LEARNERS + 2 cores: they then use 1.33 of 2 cores and each computes at its own speed.
`--throttle 1` is the shared-core measurement.

    .venv/bin/python bench/wallclock.py --set lr=0.001   # D = 120 s, ~11 min on 2 cores, the issue's lr
    .venv/bin/python bench/wallclock.py --quick          # D = 60 s
    .venv/bin/python bench/wallclock.py --throttle 1     # the learners share the cores
    .venv/bin/python bench/wallclock_seeds.py bench/results/wallclock_*.json   # several seeds together
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import common, evaluate
from bench.ddp_baseline import failure_schedule
from bench.dprun import run_dp
from bench.fleet import BenchRun, Plan, diloco_run, local_host, run_diloco
from syncer import checkpoint
from syncer.wire import fragments

LEARNERS = 4
MTBF = 20.0
DP_BOOT_S = 8.0
DEFAULTS, SYNC, DP, TORCHFT = (
    "Decoupled DiLoCo, dldctl defaults",
    "synchronous DiLoCo",
    "data-parallel + restarts",
    "torchft DiLoCo",
)


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=None, help="window D in seconds (default 120, quick 60)")
    parser.add_argument("--seed", type=int, default=1, help="kill schedule and victim seed")
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument(
        "--throttle",
        type=float,
        default=None,
        help="every learner/worker waits (F - 1) x its step's compute, so that a wait is lost time as on "
        "one device per learner, not a core handed to the others (default: 1 with a core per learner "
        "and two spare, else 3; 1 = the learners share the cores)",
    )
    common.add_set_option(parser, "[run] overrides for every strategy, e.g. lr=0.001 or model=gpt-small")


def dedicated_throttle(cores: int | None) -> float:
    """The default `--throttle`: 1 where every learner has its own core and two are left (the
    syncer, the kill and the restart), else 3: four learners at a third of a core each use 1.33 of
    2 cores, so each computes at its own speed and a learner that waits leaves its core idle."""
    return 1.0 if (cores or 1) >= LEARNERS + 2 else 3.0


def settings(H: int, spec: str | Sequence[str] = "") -> dict[str, Any]:
    """The [run] table every strategy shares: the bench workload, dldctl's outer optimizer, a
    checkpoint every 10 merges (all kept, for the curve), an evaluation every 200 steps, and
    the `--set` overrides `spec` on top."""
    return diloco_run(H, checkpoint_every=10, keep_checkpoints=100000, eval_every=200, **common.overrides(spec))


def checkpoint_curve(fleet: BenchRun, run: dict[str, Any], start: float) -> list[dict[str, Any]]:
    """The global model's held-out loss at every syncer checkpoint: (t since `start`, merged tokens, loss)."""
    assert fleet.run_dir is not None
    wl = evaluate.workload(run)
    curve = []
    for path in sorted(checkpoint.list_checkpoints(fleet.run_dir / "checkpoints"), key=lambda p: p.stat().st_mtime):
        try:
            state = checkpoint.read(path)
        except checkpoint.CheckpointError:
            continue
        manifest = fragments.manifest_from_json(state["manifest"])
        plan = fragments.plan(manifest, int(state["fragments"]))
        tensors = {spec.name: torch.zeros(spec.shape) for spec in manifest}
        for p in range(plan.count):
            plan.scatter(p, state["theta"][p], tensors)
        curve.append(
            {
                "t": float(state["saved_at"]) - start,
                "tokens": int(state["fleet"]["merged_tokens"]),
                "eval_loss": evaluate.eval_loss(tensors, run, wl),
            }
        )
    return curve


def run_fleet(
    name: str, run: dict[str, Any], duration: float, schedule: list[float], seed: int, throttle: float = 1.0
) -> dict[str, Any]:
    """One DiLoCo fleet for the window, kills on `schedule` (none if empty), with its curve."""
    box: dict[str, float] = {}

    def kills(fleet: BenchRun, start: float, stop: Any) -> list[dict[str, Any]]:
        box["start"] = start
        return fleet.run_kills(schedule, LEARNERS, seed, start, stop) if schedule else []

    def curve(fleet: BenchRun) -> list[dict[str, Any]]:
        return checkpoint_curve(fleet, run, box.get("start", 0.0))

    res = run_diloco(
        Plan(
            name,
            run,
            [local_host("here", LEARNERS, throttle=throttle)],
            LEARNERS,
            duration_s=duration,
            chaos=kills,
            inspect=curve,
        )
    )
    res["curve"] = res.pop("inspect")
    return res


def run_torchft_or_skip(
    run: dict[str, Any], duration: float, schedule: list[float], seed: int, throttle: float = 1.0
) -> dict[str, Any]:
    """bench.torchft_diloco.run_torchft, or {"skipped": why} where torchft is missing."""
    try:
        from bench.torchft_diloco import run_torchft
    except ImportError as exc:
        return {"skipped": f"torchft is not installed ({exc}); pip install torchft==0.2.0"}
    with tempfile.TemporaryDirectory(prefix="dld-tft-") as out:
        return run_torchft(
            run, LEARNERS, Path(out), duration_s=duration, kill_schedule=schedule, seed=seed, throttle=throttle
        )


def row(strategy: str, res: dict[str, Any], clean: dict[str, Any] | None, merged_per_s: float | None) -> dict[str, Any]:
    clean_rate = _rate(strategy, clean) if clean else None
    return {
        "strategy": strategy,
        "kills": len(res.get("chaos") or res.get("kills") or []),
        "eval loss": res.get("eval_loss_shared", res.get("eval_loss")),
        "tokens merged/s": merged_per_s,
        "share of clean": merged_per_s / clean_rate if merged_per_s and clean_rate else None,
    }


def _rate(strategy: str, res: dict[str, Any]) -> float | None:
    """Tokens that reached the model per second of the window."""
    if "skipped" in res:
        return None
    if strategy == DP:
        return res.get("window_tokens_per_s")
    if strategy == TORCHFT:
        return res.get("tokens_per_s")
    return res["window"]["tokens_merged_per_s"]


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["strategy"]: r for r in rows}
    mine = by[DEFAULTS]["eval loss"]
    others = {k: r["eval loss"] for k, r in by.items() if k != DEFAULTS and r["eval loss"] is not None}
    lower = all(mine < v for v in others.values())
    share_ok = None
    if by.get(TORCHFT, {}).get("share of clean") is not None:
        share_ok = (by[DEFAULTS]["share of clean"] or 0) > by[TORCHFT]["share of clean"]
    text = (
        f"dldctl defaults end at {mine:.3f} against "
        + ", ".join(f"{k} {v:.3f}" for k, v in others.items())
        + f" (target: lowest: {'MET' if lower else 'MISSED'})"
    )
    if share_ok is not None:
        text += (
            f"; share of clean throughput {by[DEFAULTS]['share of clean']:.2f} against torchft's "
            f"{by[TORCHFT]['share of clean']:.2f} ({'MET' if share_ok else 'MISSED'})"
        )
    return {"lowest_met": lower, "share_met": share_ok, "text": text}


def plot(runs: dict[str, Any], path: Path) -> None:
    """Held-out loss against wall time (left) and against the tokens that reached the model (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    by_time, by_tokens = fig.subplots(1, 2, sharey=True)
    lowest = float("inf")
    for name, res in runs.items():
        points = [c for c in res.get("curve") or [] if c.get("eval_loss") is not None and c["t"] >= 0]
        if points and "clean" not in name:
            by_time.plot([c["t"] for c in points], [c["eval_loss"] for c in points], marker=".", label=name)
            tokens = [(c["tokens"] / 1e6, c["eval_loss"]) for c in points if c.get("tokens") is not None]
            by_tokens.plot(*zip(*tokens), marker=".", label=name)
            lowest = min(lowest, *(c["eval_loss"] for c in points))
    if lowest < float("inf"):  # the end is what differs: keep the first seconds' steep start out of scale
        by_time.set_ylim(lowest - 0.05, lowest * 1.4)
    by_time.set_xlabel("seconds since the whole fleet trains (kills every 20 s on average)")
    by_time.set_ylabel("held-out loss of the global model")
    by_tokens.set_xlabel("tokens in the model (millions; DiLoCo: merged)")
    by_time.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("wallclock", __doc__, _extra, argv)
    duration = args.duration or (60.0 if args.quick else 120.0)
    schedule = failure_schedule(duration, MTBF, args.seed)
    dec = settings(args.H, args.set)
    sync = {**dec, "quorum": LEARNERS, "overlap": False}
    f = args.throttle if args.throttle is not None else dedicated_throttle(os.cpu_count())
    if f < 1.0:
        raise SystemExit(f"wallclock: --throttle must be >= 1 (1 = full speed), got {f:g}")
    runs: dict[str, Any] = {
        DEFAULTS: run_fleet("wc-dec", dec, duration, schedule, args.seed, f),
        f"{DEFAULTS}, clean": run_fleet("wc-dec-clean", dec, duration, [], args.seed, f),
        SYNC: run_fleet("wc-sync", sync, duration, schedule, args.seed, f),
        DP: run_dp(dec, LEARNERS, duration_s=duration + DP_BOOT_S, kill_schedule=schedule, seed=args.seed, throttle=f),
        TORCHFT: run_torchft_or_skip(dec, duration, schedule, args.seed, f),
    }
    runs[f"{TORCHFT}, clean"] = (
        run_torchft_or_skip(dec, duration, [], args.seed, f) if "skipped" not in runs[TORCHFT] else runs[TORCHFT]
    )
    rows = [
        row(name, runs[name], runs.get(f"{name}, clean"), _rate(name, runs[name]))
        for name in (DEFAULTS, SYNC, DP, TORCHFT)
        if "skipped" not in runs[name]
    ]
    common.print_table(
        f"Equal wall time: {LEARNERS} learners/workers, {dec['model']}, lr {dec['lr']:g}, H={args.H}, throttle {f:g}, "
        f"window {duration:g} s, kills at {schedule} (mean every {MTBF:g} s, seed {args.seed})",
        rows,
    )
    result = verdict(rows)
    if "skipped" in runs[TORCHFT]:
        result["text"] += f"; torchft skipped: {runs[TORCHFT]['skipped']}"
    print(result["text"])
    png = args.out.with_suffix(".png")
    plot(runs, png)
    common.write_json(
        args.out,
        {
            "benchmark": "wallclock",
            "quick": args.quick,
            "duration_s": duration,
            "mtbf_s": MTBF,
            "seed": args.seed,
            "throttle": f,
            "schedule": schedule,
            "settings": dec,
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
