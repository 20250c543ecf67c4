"""Benchmark: how much of a learner's step time the training thread waits on communication (issue 4).

Four learners train gpt-tiny for the same number of inner steps in three configurations, one
after the other in the same run:

- **overlap** (the default, `overlap = true`, quorum 1): at a sync point the training thread takes
  the outer gradient (`mark - local`, on the device), hands it to the background sender and goes
  on; a reply is applied when it has arrived. Encoding, zstd, the socket and the merge all happen
  off the training thread.
- **wait for own merge** (`overlap = false`, quorum 1): the synchronous variant of the same learner.
  It sends, waits until the merge of that fragment has come back, applies it and continues. Only
  the network and the syncer's latency are exposed, never another learner.
- **synchronous DiLoCo** (`overlap = false`, quorum 4): as above, and every round waits for every
  learner, so each learner also waits for the slowest.

Each learner measures its own time: `busy` (the inner steps, including any throttle) and `blocked`
(everything the training thread does for the outer loop between steps: collecting and applying
replies, taking outer gradients, pushing, and in the synchronous variants the wait). It reports
`blocked / (busy + blocked)` with its heartbeats; the syncer writes it into its `sample` records,
and the last sample before the fleet stops is read here. Target (issue 4): under 2% with overlap.

    .venv/bin/python bench/blocked.py            # full: 1500 steps per learner, ~5 min on 2 cores
    .venv/bin/python bench/blocked.py --quick    # 400 steps, ~1.5 min
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.fleet import BenchRun, Plan, diloco_run, local_host, run_diloco

LEARNERS = 4
TARGET = 0.02


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=None, help="inner steps per learner (default 1500, quick 400)")
    parser.add_argument("--H", type=int, default=32)


def configs(H: int, steps: int) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("overlap (default)", diloco_run(H, steps=steps)),
        ("wait for own merge", diloco_run(H, steps=steps, overlap=False)),
        ("synchronous DiLoCo", diloco_run(H, steps=steps, overlap=False, quorum=LEARNERS)),
    ]


def last_blocked(fleet: BenchRun) -> dict[str, float]:
    """Each learner's blocked fraction in the last sample that has it (cumulative over its life)."""
    out: dict[str, float] = {}
    for sample in fleet.samples():
        for lid, row in (sample.get("learners") or {}).items():
            if row.get("blocked_frac") is not None and row.get("step"):
                out[lid] = float(row["blocked_frac"])
    return out


def row(name: str, res: dict[str, Any]) -> dict[str, Any]:
    fracs = list(res["blocked"].values())
    return {
        "config": name,
        "blocked % (mean)": 100 * statistics.fmean(fracs) if fracs else None,
        "blocked % (worst learner)": 100 * max(fracs) if fracs else None,
        "train s": res["train_s"],
        "tokens/s": res["tokens_trained"] / res["train_s"] if res["train_s"] else None,
        "goodput": res["window"]["goodput"],
        "eval loss": res["eval_loss"],
    }


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("blocked", __doc__, _extra, argv)
    steps = args.steps or (400 if args.quick else 1500)
    results: dict[str, Any] = {}
    for name, run in configs(args.H, steps):
        res = run_diloco(
            Plan(f"blocked-{len(results)}", run, [local_host("here", LEARNERS)], LEARNERS, inspect=last_blocked)
        )
        res["blocked"] = res.pop("inspect")
        results[name] = res
    rows = [row(name, res) for name, res in results.items()]
    common.print_table(
        f"Training-thread time blocked on communication: {LEARNERS} learners, gpt-tiny, H={args.H}, {steps} steps each",
        rows,
    )
    overlap = rows[0]["blocked % (worst learner)"]
    verdict = {
        "target": f"< {100 * TARGET:g}% with overlap",
        "overlap_worst_pct": overlap,
        "met": overlap is not None and overlap < 100 * TARGET,
        "ratio_vs_own_merge": (
            rows[1]["blocked % (mean)"] / rows[0]["blocked % (mean)"] if rows[0]["blocked % (mean)"] else None
        ),
    }
    print(
        f"verdict: worst overlap learner blocked {overlap:.2f}% of its time "
        f"({'MET' if verdict['met'] else 'MISSED'}: target {verdict['target']})"
    )
    common.write_json(
        args.out,
        {
            "benchmark": "blocked",
            "quick": args.quick,
            "steps": steps,
            "H": args.H,
            "rows": rows,
            "verdict": verdict,
            "runs": results,
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
