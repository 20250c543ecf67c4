"""Benchmark: a CPU learner's real peak memory against the estimate `dldctl up` judges hosts by.

`dldctl up` (and `check`) refuse a host whose CPU learners would not fit in its free memory, by
dldctl/learnermem.py's estimate (an idle learner, 28 bytes per parameter, the activations of
one batch, linear in its tokens). This runs **real learner processes** (`dldctl up`, one learner and the syncer, the
default int4 pushes, 4 fragments) on the CPU for each model, batch and sequence length, and
reads the peak resident set each learner reports in its `finished` record (getrusage maxrss):

    ratio = measured peak / estimate        (1.0: the estimate is exact; the target: 0.8 - 1.2)

The estimate's parts are in the table too (base, state, activations), so a miss says which part
is off. Each case is a fresh fleet; the learner trains `--steps` steps and stops.

    .venv/bin/python bench/learner_memory.py            # six cases, gpt-tiny to gpt2-124m's shapes
    .venv/bin/python bench/learner_memory.py --quick    # gpt-tiny and gpt-small
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.fleet import diloco_run
from bench.learner_throughput import learner_run
from dldctl import learnermem
from dldctl.syncermem import total_params
from workload import presets

# (model, batch, seq_len): the builtin byte data (vocabulary 256)
CASES = (
    ("gpt-tiny", 16, 32),
    ("gpt-small", 16, 128),
    ("gpt-medium", 4, 256),
    ("gpt-medium", 8, 256),
    ("gpt2-124m", 2, 256),
    ("gpt2-124m", 1, 1024),  # a long sequence: would show scores kept per seq x seq
)
TARGET = (0.8, 1.2)


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=12, help="steps each learner trains")


def estimate(model: str, batch: int, seq: int) -> dict[str, float]:
    """The estimate and its parts, in bytes."""
    cfg = presets.config_for(model, vocab_size=256, block_size=seq)
    params = total_params(presets.param_shapes(model, vocab_size=256, block_size=seq))
    return {
        "params": params,
        "base_B": learnermem.BASE_B,
        "state_B": learnermem.STATE_B * params,
        "activations_B": learnermem.activations(cfg, batch, seq),
        "estimate_B": learnermem.learner_need(cfg, params, batch, seq),
    }


def run_case(model: str, batch: int, seq: int, steps: int) -> dict[str, Any]:
    run = diloco_run(32, model=model, batch_size=batch, seq_len=seq, steps=steps, eval_every=steps + 1, eval_batches=2)
    record = learner_run(run, "cpu", 2, timeout=900)
    row: dict[str, Any] = {"model": model, "batch": batch, "seq_len": seq, **estimate(model, batch, seq)}
    row["measured_B"] = record["peak_memory_bytes"]
    row["ratio"] = round(row["measured_B"] / row["estimate_B"], 3)
    row["met"] = TARGET[0] <= row["ratio"] <= TARGET[1]
    return row


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("learner_memory", __doc__, _extra, argv)
    cases = CASES[:2] if args.quick else CASES
    rows = [run_case(m, b, s, args.steps) for m, b, s in cases]
    shown = [
        {
            "model": r["model"],
            "batch x seq": f"{r['batch']} x {r['seq_len']}",
            "params M": round(r["params"] / 1e6, 2),
            "base GB": round(r["base_B"] / 1e9, 3),
            "state GB": round(r["state_B"] / 1e9, 3),
            "activations GB": round(r["activations_B"] / 1e9, 3),
            "estimate GB": round(r["estimate_B"] / 1e9, 3),
            "measured GB": round(r["measured_B"] / 1e9, 3),
            "ratio": r["ratio"],
            "met": r["met"],
        }
        for r in rows
    ]
    common.print_table("CPU learner peak memory: measured against dldctl's estimate", shown)
    path = common.write_json(args.out, {"target": list(TARGET), "rows": rows})
    print(f"wrote {common.shown(path)}")
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
