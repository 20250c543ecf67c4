"""Where one syncer round's CPU goes, by stage, against the same-run bound (issue 20's per-core
target, bench/syncer_throughput.py): what the native parts alone would reach if every line of
Python in the round cost nothing.

The rounds are bench/syncer_throughput.py's (the real `SyncerCore`, native kernel, 4 learners,
int4 + zstd, 4 fragments, one thread, CPU time). Each stage is timed where the core calls it
(a wrapper around the codec's zstd decompression and update encoding, and the kernel's check,
Gram and publish calls: ~1 us each, a few per round): the rest of a round is Python, torch and
numpy calls (messages, rounds, coefficients, accounting). In the same run: the bound's two parts
(zstd only, state only) exactly as syncer_throughput measures them.

    .venv/bin/python bench/round_split.py                      # gpt-small, gpt-medium; ~1 min
    .venv/bin/python bench/round_split.py --models gpt-small --quick

`native_share` = bound / (the native stages' sum): the share of the bound a round would reach
with no Python at all. Where it is below the 0.8 target, no trimming of Python reaches it.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench import syncer_throughput as st
from syncer.common.settings import RunSettings
from syncer.native import Kernel
from syncer.wire import codec

STAGES = {"decompress": (codec, "_payload"), "encode": (codec, "_blob")}
KERNEL_STAGES = ("check", "gram", "publish")


def _timed(acc: dict[str, float], label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[label] += time.thread_time() - t0

    return run


def _per_round(fn: Callable[[], None], repeat: int, fragments: int) -> float:
    """CPU seconds per fragment round of `fn` (one call runs every fragment's round once)."""
    t0 = time.thread_time()
    for _ in range(repeat):
        fn()
    return (time.thread_time() - t0) / repeat / fragments


def split(model: str, repeat: int, fragments: int = 4) -> dict[str, Any]:
    """One model's round, its stages and its bound, per fragment round, in ms."""
    settings = RunSettings(model=model, fragments=fragments, H=16 * fragments, round_clock="learner")
    core = st.build_core(model, settings)
    rounds = st.Rounds(core, st.make_blobs(core, settings), settings.H)
    for _ in range(5):
        rounds()  # warm-up
    acc: dict[str, float] = collections.defaultdict(float)
    saved = {label: getattr(owner, name) for label, (owner, name) in STAGES.items()}
    saved.update({label: getattr(Kernel, label) for label in KERNEL_STAGES})
    try:
        for label, (owner, name) in STAGES.items():
            setattr(owner, name, _timed(acc, label, saved[label]))
        for label in KERNEL_STAGES:
            setattr(Kernel, label, _timed(acc, label, saved[label]))
        round_s = _per_round(rounds, repeat, fragments)
    finally:
        for label, (owner, name) in STAGES.items():
            setattr(owner, name, saved[label])
        for label in KERNEL_STAGES:
            setattr(Kernel, label, saved[label])
    floor = st.zstd_floor(rounds.blobs)
    assert floor is not None, "the rounds are int4 + zstd"
    zstd_s, state_s = _per_round(floor, repeat, fragments), _per_round(st.state_floor(core), repeat, fragments)
    stages = {label: acc[label] / repeat / fragments for label in (*STAGES, *KERNEL_STAGES)}
    native_s, bound_s = sum(stages.values()), zstd_s + state_s
    return {
        "model": model,
        "round_ms": 1e3 * round_s,
        **{f"{label}_ms": 1e3 * v for label, v in stages.items()},
        "native_ms": 1e3 * native_s,
        "rest_ms": 1e3 * (round_s - native_s),
        "bound_ms": 1e3 * bound_s,
        "zstd_only_ms": 1e3 * zstd_s,
        "state_only_ms": 1e3 * state_s,
        "bound_share": bound_s / round_s,
        "native_share": bound_s / native_s,
    }


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="gpt-small,gpt-medium", help="comma-separated model presets")


def main() -> None:
    args = common.parse_args("round_split", __doc__, _extra)
    torch.set_num_threads(1)
    if st.KERNEL is None:
        raise SystemExit("round_split: the native kernel is not available here: nothing to split")
    repeat = {"gpt-small": 300, "gpt-medium": 40}
    rows = [split(m, max(5, repeat.get(m, 10) // (5 if args.quick else 1))) for m in args.models.split(",")]
    columns = ["model", "round_ms", *(f"{s}_ms" for s in (*STAGES, *KERNEL_STAGES)), "native_ms", "rest_ms"]
    columns += ["bound_ms", "bound_share", "native_share"]
    common.print_table("One fragment round by stage (CPU ms, native kernel, 4 learners, int4 + zstd)", rows, columns)
    print("native_share: the bound's share with the Python of the round at zero cost (target 0.8)")
    common.write_json(args.out, {"benchmark": "round_split", "quick": args.quick, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
