"""Soak benchmark (issue 10, not in CI): the built-in default fleet under a chaos monkey for 15 minutes.

Two runs of the same length, each on a fresh `dldctl up` with no inventory (the built-in default:
a syncer and four gpt-small learners of different speeds on this machine):

- **chaos**: `dldctl chaos monkey --mtbf 30 --duration D --seed N --actions kill,pause,slow,partition`
  from the moment all learners train;
- **clean**: the same length without faults.

Reported for each, and checked against the targets:

- unplanned syncer restarts: `syncer_death` events (target 0);
- syncer RSS growth: VmRSS of the syncer (pid from `dldctl status --json`, read from
  `/proc/<pid>/status` every 5 s), mean over the first W minutes after a warm-up vs the mean over
  the last W minutes (target < 10%);
- leaked processes after `dldctl down`: every process in the run's `procs.jsonl` (pid and start
  time from /proc/<pid>/stat, so a reused pid is not mistaken for ours) must be gone (target 0);
- final loss: the final global model (`final_model.pt`) scored by `bench.evaluate` on the run's
  held-out eval batches, chaos vs clean; plus the syncer's own numbers (goodput, tokens, faults,
  learner restarts).

    .venv/bin/python bench/soak.py            # full: 15 + 15 minutes (warm-up 60 s, windows 3 min)
    .venv/bin/python bench/soak.py --quick    # 2 + 2 minutes (warm-up 20 s, windows 30 s)
    .venv/bin/python bench/soak.py --no-clean # the chaos run only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.fleet import BenchRun

LEARNERS = 4  # the built-in default fleet
TARGET_RSS = 0.10


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=None, help="seconds per run (default 900, quick 120)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-clean", action="store_true", help="skip the clean run of the same length")


def vm_rss_kb(pid: int) -> int | None:
    """VmRSS of a live process in kB (None if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def sample_rss(fleet: BenchRun, stop: threading.Event, every: float, out: list[dict[str, Any]]) -> None:
    """Append {"t", "pid", "rss_kb"} every `every` s; re-reads the syncer pid if it changed."""
    pid = fleet.status()["syncer"].get("pid")
    while not stop.wait(every):
        rss = vm_rss_kb(pid) if pid else None
        if rss is None:  # the syncer is gone or was replaced: ask dldctl for the current pid
            try:
                pid = fleet.status()["syncer"].get("pid")
            except (RuntimeError, ValueError):
                pid = None
            rss = vm_rss_kb(pid) if pid else None
        out.append({"t": time.time(), "pid": pid, "rss_kb": rss})


def rss_growth(samples: list[dict[str, Any]], start: float, end: float, warmup: float, win: float) -> dict[str, Any]:
    """Mean RSS in [start + warmup, + win] vs in [end - win, end]; growth = last / first - 1."""
    first = [s["rss_kb"] for s in samples if s["rss_kb"] and start + warmup <= s["t"] <= start + warmup + win]
    last = [s["rss_kb"] for s in samples if s["rss_kb"] and end - win <= s["t"] <= end]
    if not first or not last:
        return {"first_mb": None, "last_mb": None, "growth": None, "max_mb": None}
    a, b = statistics.fmean(first), statistics.fmean(last)
    return {
        "first_mb": a / 1024,
        "last_mb": b / 1024,
        "growth": b / a - 1.0,
        "max_mb": max(s["rss_kb"] for s in samples if s["rss_kb"]) / 1024,
        "n_first": len(first),
        "n_last": len(last),
    }


def soak(name: str, duration: float, monkey_seed: int | None, warmup: float, win: float) -> dict[str, Any]:
    """One run of the built-in default: up, (monkey), RSS samples, down, leftovers, eval."""
    from bench import evaluate

    with BenchRun(name) as fleet:
        fleet.up({}, None)
        start = fleet.wait_training(LEARNERS, timeout=300)
        stop = threading.Event()
        rss: list[dict[str, Any]] = []
        sampler = threading.Thread(target=sample_rss, args=(fleet, stop, 5.0, rss), daemon=True)
        sampler.start()
        monkey = None
        if monkey_seed is not None:
            monkey = fleet.monkey(30.0, duration, monkey_seed, "kill,pause,slow,partition", threading.Event())
        else:
            time.sleep(duration)
        end = time.time()
        stop.set()
        sampler.join(timeout=30)
        settings = fleet.config().run.to_dict()
        down_error = None
        try:
            summary = fleet.down()
        except RuntimeError as exc:  # down exits 1 when something is left running: that is a finding
            summary, down_error = {}, str(exc)[-2000:]
        leftovers = fleet.leftovers()
        events = fleet.events()
        curve = [
            {k: x.get(k) for k in ("t", "loss_train", "loss_eval", "goodput", "tokens_trained", "quorum_live")}
            for x in fleet.samples()[::5]
        ]
        final = summary.get("final_model")
        loss = evaluate.eval_file(final, settings) if final else None
        kinds = [e["kind"] for e in events]
        return {
            "name": name,
            "duration_s": end - start,
            "settings": settings,
            "summary": summary,
            "down_error": down_error,
            "leftovers": leftovers,
            "eval_loss": loss,
            "syncer_deaths": kinds.count("syncer_death"),
            "learner_restarts": kinds.count("restart"),
            "faults_injected": kinds.count("fault_inject"),
            "monkey": monkey,
            "rss": rss_growth(rss, start, end, warmup, win),
            "rss_samples": rss,
            "curve": curve,
        }


def row(res: dict[str, Any]) -> dict[str, Any]:
    s, rss = res["summary"], res["rss"]
    return {
        "run": res["name"],
        "minutes": res["duration_s"] / 60,
        "faults": res["faults_injected"],
        "learner restarts": res["learner_restarts"],
        "syncer deaths": res["syncer_deaths"],
        "RSS first MB": rss["first_mb"] or float("nan"),
        "RSS last MB": rss["last_mb"] or float("nan"),
        "RSS growth": rss["growth"] if rss["growth"] is not None else float("nan"),
        "leaked procs": len(res["leftovers"]),
        "goodput": s.get("goodput") or float("nan"),
        "tokens trained": s.get("tokens_trained") or 0,
        "eval loss": res["eval_loss"] or float("nan"),
    }


def verdict(chaos: dict[str, Any], clean: dict[str, Any] | None) -> dict[str, Any]:
    growth = chaos["rss"]["growth"]
    checks = {
        "no unplanned syncer restarts": chaos["syncer_deaths"] == 0,
        "syncer RSS growth < 10%": growth is not None and growth < TARGET_RSS,
        "no leaked processes": not chaos["leftovers"] and not chaos["down_error"],
    }
    text = "; ".join(f"{k}: {'MET' if v else 'MISSED'}" for k, v in checks.items())
    gap = None
    if clean and clean["eval_loss"] and chaos["eval_loss"]:
        gap = chaos["eval_loss"] / clean["eval_loss"] - 1.0
        text += f"; final eval loss {chaos['eval_loss']:.4f} vs clean {clean['eval_loss']:.4f} ({100 * gap:+.1f}%)"
    return {"checks": checks, "loss_gap": gap, "text": text}


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 3.4))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for res in runs:
        pts = [s for s in res["rss_samples"] if s["rss_kb"]]
        if pts:
            t0 = pts[0]["t"]
            ax.plot([(s["t"] - t0) / 60 for s in pts], [s["rss_kb"] / 1024 for s in pts], label=res["name"])
    ax.set_xlabel("minutes")
    ax.set_ylabel("syncer RSS (MB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("soak", __doc__, _extra, argv)
    duration = args.duration or (120.0 if args.quick else 900.0)
    warmup, win = (20.0, 30.0) if args.quick else (60.0, 180.0)
    chaos = soak("soak-chaos", duration, args.seed, warmup, win)
    clean = None if args.no_clean else soak("soak-clean", duration, None, warmup, win)
    runs = [r for r in (chaos, clean) if r]
    common.print_table(
        f"Soak: built-in default fleet, chaos monkey mtbf 30 s (kill, pause, slow, partition), "
        f"{duration / 60:g} min each",
        [row(r) for r in runs],
    )
    result = verdict(chaos, clean)
    print(result["text"])
    png = args.out.with_suffix(".png")
    plot(runs, png)
    common.write_json(
        args.out,
        {
            "benchmark": "soak",
            "quick": args.quick,
            "duration_s": duration,
            "seed": args.seed,
            "rows": [row(r) for r in runs],
            "verdict": result,
            "runs": runs,
            "plot": common.shown(png),
        },
    )
    print(f"wrote {args.out} and {png}")
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
