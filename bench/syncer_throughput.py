"""Benchmark: the syncer's per-round hot path, in MB of fp32 fragment parameters per second.

Drives the real `SyncerCore` (no sockets, fake wall clock) with the fragment plan of a real
model (`workload.gpt.param_shapes` + `syncer.wire.fragments.plan`, default settings: int4 + zstd,
block 128, RDA, robust clip, fleet scale, Nesterov). One round of fragment p is what production
runs when 4 learners push it:

    4 x push (zstd decompress, one check of the codes and scales; int4 codes stay packed)
    tick -> close: token weights, Gram matrices (norms for robust clipping and RDA), RDA per
            tensor segment (plain mean for embeddings), fleet scale, Nesterov step, publish
            (quantize change + residual, dequantize, add), encode the update blob (int4 pack +
            zstd), crc32 of the new fragment.

Each model runs twice: with the native kernel (syncer/native, what the syncer uses when the
host has a C compiler) and with the torch round step (syncer/fused.py, its fallback).

A sample closes one round of every fragment of the model; throughput = fp32 bytes of the whole
model / sample time (`input_MB/s` counts the 4 learners' fp32 parameters received instead, 4x).
Baselines, same run, interleaved with the samples: `clone()` of every fragment (memcpy of the same
bytes); `zstd_only`: just the zstd work of a round (4 decompressions + 1 compression of the
same blobs); `state_only`: one read and one write of the three fp32 vectors a round must update
(parameters, Nesterov momentum, error-feedback residual: 3x memcpy's traffic), nothing computed.
`bound` = 1 / (1/zstd_only + 1/state_only): what one core doing only those two could reach, an
upper bound for any implementation of this pipeline (`bound_ratio`: as a share of memcpy;
`bound_share`: the round's MB/s as a share of it). Without zstd (`--no-zstd`: `[run] zstd =
false`, payloads as they are both ways) the bound is the state vectors alone. Single thread
(`torch.set_num_threads(1)`); the headline MB/s uses this thread's CPU time (per core, robust to a
shared machine), wall-clock MB/s is shown next to it. `faults/round` and `kernel_share` (share of
the CPU time spent in the OS kernel) show what fresh fragment-sized allocations cost.

Targets (issues): at least 500 MB/s and at least 25% of memcpy; the round at least 80% of its
same-run bound (`bound_share`, issue 20).

    .venv/bin/python bench/syncer_throughput.py [--quick] [--out PATH] [--models a,b] [--profile] [--no-zstd]
    DLDCTL_NATIVE=0 ...   # the torch round step only
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from syncer import native
from syncer.common.settings import RunSettings
from syncer.core import SyncerCore
from syncer.globalmodel import GlobalModel, Outbox
from syncer.wire import codec, fragments, quant
from syncer.wire.protocol import Message
from workload.gpt import param_shapes

LEARNERS = ("l0", "l1", "l2", "l3")
EMBEDDINGS = {"transformer.wte.weight", "transformer.wpe.weight"}
TARGET_MBS = 500.0
TARGET_RATIO = 0.25
TARGET_SHARE = 0.8  # of the same-run bound (issue 20)
KERNEL = None if os.environ.get("DLDCTL_NATIVE") == "0" else native.load()


def manifest(model: str) -> list[fragments.TensorSpec]:
    """The parameter manifest a learner of `model` sends in its hello."""
    return [fragments.TensorSpec(n, s, "embedding" if n in EMBEDDINGS else "dense") for n, s in param_shapes(model)]


def hello(lid: str, specs: list[fragments.TensorSpec], count: int, run: str = "bench") -> Message:
    """A learner's hello for a model of `specs` cut into `count` fragments (the benches' joins)."""
    meta = {
        "learner": lid,
        "incarnation": "i1",
        "run": run,
        "pid": 1,
        "host": "local",
        "device": "cpu",
        "batch_size": 16,
        "codecs": list(quant.MODES),
        "manifest": fragments.manifest_to_json(specs),
        "fragments": count,
    }
    return Message("hello", meta)


def build_core(
    model: str, settings: RunSettings, kernel: native.Kernel | None = KERNEL, learners: Sequence[str] = LEARNERS
) -> SyncerCore:
    """A SyncerCore with live `learners` (4) and the model's weights uploaded (as a run starts)."""
    core = SyncerCore(settings, "bench", list(learners), now=0.0, kernel=kernel)
    specs = manifest(model)
    out = Outbox()
    for lid in learners:
        core.handle(lid, hello(lid, specs, settings.fragments), 0.5, out)
    plan = fragments.plan(specs, settings.fragments)
    g = torch.Generator().manual_seed(0)
    chunk = core.chunk_numel()
    for p, n in enumerate(plan.sizes()):
        values = torch.randn(n, generator=g) * 0.02
        for off in range(0, n, chunk):
            part = values[off : off + chunk]
            core.handle(
                learners[0],
                Message(
                    "init", {"fragment": p, "offset": off, "numel": part.numel(), "total": n}, [part.numpy().tobytes()]
                ),
                0.5,
                out,
            )
    for lid in learners:
        core.handle(lid, Message("heartbeat", {"step": 1, "tokens": 16, "state": "running"}), 0.5, out)
    assert core.model is not None
    return core


def global_model(core: SyncerCore) -> GlobalModel:
    """The core's global model, which exists once the learners' weights are uploaded (`build_core`)."""
    if core.model is None:
        raise RuntimeError("the syncer core has no global model yet: build it with build_core()")
    return core.model


def outer_gradient(n: int, seed: int, shared: torch.Tensor) -> torch.Tensor:
    """A learner's outer gradient: a shared direction, its own Gaussian noise and a few outliers."""
    g = torch.Generator().manual_seed(seed)
    delta = shared + torch.randn(n, generator=g) * 1e-3
    idx = torch.randint(0, n, (max(1, n // 1000),), generator=g)
    delta[idx] *= 20.0
    return delta


def make_blobs(core: SyncerCore, settings: RunSettings, learners: int = len(LEARNERS)) -> list[list[bytes]]:
    """blobs[p][m]: learner m's encoded outer gradient of fragment p (encoded once, reused; with
    zstd or without it, as `settings.zstd` says)."""
    blobs, mode = [], settings.compression
    for p, theta in enumerate(global_model(core).theta):
        shared = torch.randn(theta.numel(), generator=torch.Generator().manual_seed(1000 + p)) * 3e-4
        blobs.append(
            [
                codec.encode(outer_gradient(theta.numel(), 10 * p + m, shared), mode, settings.block, settings.zstd)
                for m in range(learners)
            ]
        )
    return blobs


class Rounds:
    """Runs rounds on a core: each call pushes every learner's blob of every fragment and ticks."""

    def __init__(
        self, core: SyncerCore, blobs: list[list[bytes]], steps: int, learners: Sequence[str] = LEARNERS
    ) -> None:
        self.core, self.blobs, self.steps, self.learners = core, blobs, steps, learners
        self.now = 1.0
        self.seq = 0  # per-learner push sequence numbers must increase (replay protection)
        self.push_s = 0.0
        self.close_s = 0.0

    def __call__(self) -> None:
        core = self.core
        gm = global_model(core)  # looked up before the timed pushes
        for p, blobs in enumerate(self.blobs):
            self.now += 1e-3
            out = Outbox()
            self.seq += 1
            t0 = time.thread_time()
            for lid, blob in zip(self.learners, blobs, strict=True):
                core.handle(
                    lid,
                    Message(
                        "push",
                        {
                            "fragment": p,
                            "base_version": gm.versions[p],
                            "seq": self.seq,
                            "epoch": core.epoch,
                            "c_steps": self.steps,
                            "c_tokens": self.steps * 2048,
                            "c_time": self.steps * 0.1,
                            "step_time": 0.1,
                        },
                        [blob],
                    ),
                    self.now,
                    out,
                )
            t1 = time.thread_time()
            core.tick(self.now, out)
            t2 = time.thread_time()
            self.push_s += t1 - t0
            self.close_s += t2 - t1
            assert [m.kind for _, m in out.sends] == ["update"], f"the round did not close: {out.sends} {out.events}"


def zstd_floor(blobs: list[list[bytes]]) -> Callable[[], None] | None:
    """What zstd alone costs a round: decompress the 4 pushes and compress one update payload
    of the same size, per fragment (no decode, merge or anything else); None without zstd."""
    if blobs[0][0][2] & codec.RAW:  # the format byte: payloads stored as they are
        return None
    d = zstandard.ZstdDecompressor()
    c = zstandard.ZstdCompressor(level=1, write_content_size=True)
    raws = [d.decompress(memoryview(row[0])[codec.HEADER_SIZE :]) for row in blobs]

    def run() -> None:
        for row, raw in zip(blobs, raws):
            for blob in row:
                d.decompress(memoryview(blob)[codec.HEADER_SIZE :])
            c.compress(raw)

    return run


def state_floor(core: SyncerCore) -> Callable[[], None]:
    """What updating the round's fp32 state costs at the least: one read and one write of each of
    the three vectors every round must update (parameters, Nesterov momentum, error-feedback
    residual), on copies of them, with nothing computed."""
    gm = global_model(core)
    copies = [t.clone() for m in (gm.theta, gm.momentum, gm.residual) for t in m]

    def run() -> None:
        for t in copies:
            t.mul_(1.0)

    return run


def memcpy(core: SyncerCore) -> None:
    """The baseline: one copy of every fragment (the same fp32 bytes the rounds process)."""
    for theta in global_model(core).theta:
        theta.clone()


def bench_model(
    model: str, fragments_count: int, repeat: int, kernel: native.Kernel | None = KERNEL, zstd: bool = True
) -> dict:
    """Time `repeat` samples of the pipeline and of memcpy, interleaved so both see the same load."""
    # the merge arithmetic, not the round clock: rounds close on the pushes alone
    settings = RunSettings(
        model=model, fragments=fragments_count, H=16 * fragments_count, round_clock="learner", zstd=zstd
    )
    settings.validate()
    core = build_core(model, settings, kernel)
    gm = global_model(core)
    nbytes = 4 * gm.numel
    blobs = make_blobs(core, settings)
    rounds, floor_fn, state_fn = Rounds(core, blobs, settings.H), zstd_floor(blobs), state_floor(core)
    rounds()  # warm-up (first-touch allocations, caches)
    rounds.push_s = rounds.close_s = 0.0
    pipe = base = floor = state = common.Timing()
    faults = sys_s = cpu_s = 0.0
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_SELF)
        pipe += common.measure(rounds, repeat=1, warmup=0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults += after.ru_minflt - before.ru_minflt
        sys_s += after.ru_stime - before.ru_stime
        cpu_s += after.ru_stime - before.ru_stime + after.ru_utime - before.ru_utime
        base += common.measure(lambda: memcpy(core), repeat=3, warmup=1)
        if floor_fn is not None:
            floor += common.measure(floor_fn, repeat=1, warmup=0)
        state += common.measure(state_fn, repeat=1, warmup=0)
    mbs, mbs_base = common.mb_per_s(nbytes, pipe.cpu.median), common.mb_per_s(nbytes, base.cpu.median)
    mbs_zstd = common.mb_per_s(nbytes, floor.cpu.median) if floor_fn is not None else float("inf")
    mbs_state = common.mb_per_s(nbytes, state.cpu.median)
    bound = 1.0 / (1.0 / mbs_zstd + 1.0 / mbs_state)  # one core does both, one after the other
    return {
        "model": model,
        "kernel": "native" if kernel is not None else "torch",
        "zstd": zstd,
        "fragments": fragments_count,
        "fragment_MB": nbytes / fragments_count / 1e6,
        "segments": sum(len(gm.plan.segments(p)) for p in range(fragments_count)),
        "round_ms": 1e3 * pipe.cpu.median / fragments_count,
        "MB/s": mbs,
        "best_MB/s": common.mb_per_s(nbytes, pipe.cpu.best),
        "spread": pipe.cpu.spread,
        "wall_MB/s": common.mb_per_s(nbytes, pipe.median),
        "wall_spread": pipe.spread,
        "memcpy_MB/s": mbs_base,
        "memcpy_spread": base.cpu.spread,
        "ratio": mbs / mbs_base,
        "zstd_only_MB/s": mbs_zstd,
        "zstd_only_ratio": mbs_zstd / mbs_base if floor_fn is not None else None,
        "state_only_MB/s": mbs_state,
        "state_only_ratio": mbs_state / mbs_base,
        "bound_MB/s": bound,
        "bound_ratio": bound / mbs_base,
        "bound_share": mbs / bound,
        "input_MB/s": mbs * len(LEARNERS),
        "push_share": rounds.push_s / (rounds.push_s + rounds.close_s),
        "faults/round": faults / (repeat * fragments_count),
        "kernel_share": sys_s / cpu_s if cpu_s else 0.0,
        "verdict": "PASS" if mbs >= TARGET_MBS and mbs / mbs_base >= TARGET_RATIO else "FAIL",
        "pipeline": pipe.to_dict(),
        "memcpy": base.to_dict(),
        "settings": settings.to_dict(),
    }


def profile(model: str, fragments_count: int, samples: int) -> None:
    """cProfile of a few samples: where the time goes (top 25 by own time)."""
    # the merge arithmetic, not the round clock: rounds close on the pushes alone
    settings = RunSettings(model=model, fragments=fragments_count, H=16 * fragments_count, round_clock="learner")
    core = build_core(model, settings)
    rounds = Rounds(core, make_blobs(core, settings), settings.H)
    rounds()
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    for _ in range(samples):
        rounds()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(20)


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", action="store_true", help="print a cProfile of gpt-medium rounds and exit")
    parser.add_argument("--models", default="gpt-small,gpt-medium,gpt2-124m", help="comma-separated model presets")
    parser.add_argument("--no-zstd", action="store_true", help="payloads without zstd both ways ([run] zstd = false)")


def main() -> None:
    args = common.parse_args("syncer_throughput", __doc__, _extra)
    torch.set_num_threads(1)
    if args.profile:
        profile(args.models.split(",")[-1], 4, 5)
        return
    repeat = 10 if args.quick else 60
    kernels = [KERNEL, None] if KERNEL is not None else [None]
    if KERNEL is None:
        print(f"native kernel not available ({native.problem}): torch round step only")
    zstd = not args.no_zstd
    rows = [bench_model(model, 4, repeat, k, zstd) for model in args.models.split(",") for k in kernels]
    columns = [
        "model",
        "kernel",
        "zstd",
        "fragment_MB",
        "round_ms",
        "MB/s",
        "best_MB/s",
        "spread",
        "wall_MB/s",
        "memcpy_MB/s",
        "ratio",
        "zstd_only_ratio",
        "state_only_ratio",
        "bound_ratio",
        "bound_share",
        "input_MB/s",
        "faults/round",
        "verdict",
    ]
    common.print_table(
        f"Syncer round throughput, 4 learners, int4+zstd, 1 thread (CPU time, median of {repeat}; wall_ = wall clock)",
        rows,
        columns,
    )
    print(
        f"targets: >= {TARGET_MBS:.0f} MB/s, >= {TARGET_RATIO:.0%} of memcpy (same bytes, same run) and "
        f"bound_share >= {TARGET_SHARE:.0%}; "
        "bound_ratio: zstd + state updates alone, the most any implementation can reach (the JSON has every column)"
    )
    common.write_json(
        args.out,
        {
            "benchmark": "syncer_throughput",
            "quick": args.quick,
            "learners": len(LEARNERS),
            "zstd": zstd,
            "target_MB/s": TARGET_MBS,
            "target_ratio": TARGET_RATIO,
            "rows": rows,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
