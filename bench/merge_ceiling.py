"""The merge alone, in one process and in K processes at once: the ceiling of what K syncer shards
can gain on this machine before any socket, CURVE or load generator (bench/shard_scaling.py's
same-run baseline).

Each process holds the real `SyncerCore` (no sockets, as bench/syncer_throughput.py drives it)
with the whole model of a loadgen shape uploaded, and merges rounds of the fragments one shard
would own (syncer/wire/shards.py `assign`): M learners push a pre-encoded int4 + zstd outer
gradient each (the push handler: zstd decompress, checks), then `tick` closes the round (Gram,
RDA, Nesterov, publish, the update's encode, crc32). All processes start together (a barrier)
and merge for `seconds`; the result is parameters merged per second, summed over the processes,
with each process's CPU time (the share of a core it got).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from bench import loadgen_core as core
from bench.syncer_throughput import KERNEL, hello, outer_gradient
from syncer.common.settings import RunSettings
from syncer.core import SyncerCore
from syncer.globalmodel import Outbox
from syncer.wire import codec, fragments, shards
from syncer.wire.protocol import Message


@dataclass(frozen=True)
class CeilingResult:
    """K processes merging at once: parameters merged per second (summed) and each one's share."""

    processes: int
    params_per_s: float
    rounds: int
    cpu_cores: list[float]  # each process's CPU seconds / its wall seconds while merging


def build(specs: list[fragments.TensorSpec], settings: RunSettings, learners: list[str]) -> SyncerCore:
    """A SyncerCore with `learners` live and the model's random initial values uploaded."""
    sc = SyncerCore(settings, "ceiling", learners, now=0.0, kernel=KERNEL)
    out = Outbox()
    for lid in learners:
        sc.handle(lid, hello(lid, specs, settings.fragments, "ceiling"), 0.5, out)
    g, chunk = torch.Generator().manual_seed(0), sc.chunk_numel()
    for p, n in enumerate(fragments.plan(specs, settings.fragments).sizes()):
        values = (torch.randn(n, generator=g) * 0.02).numpy()
        for off in range(0, n, chunk):
            part = values[off : off + chunk]
            meta = {"fragment": p, "offset": off, "numel": part.size, "total": n}
            sc.handle(learners[0], Message("init", meta, [part.tobytes()]), 0.5, out)
    for lid in learners:
        sc.handle(lid, Message("heartbeat", {"step": 1, "tokens": 16, "state": "running"}), 0.5, out)
    assert sc.model is not None, "the upload did not complete"
    return sc


class Merger:
    """Rounds of some fragments on one core: every learner pushes its blob, then a tick closes it."""

    def __init__(self, sc: SyncerCore, owned: tuple[int, ...], learners: list[str], settings: RunSettings) -> None:
        assert sc.model is not None
        self.sc, self.owned, self.learners = sc, owned, learners
        self.sizes = [sc.model.theta[p].numel() for p in range(len(sc.model.theta))]
        self.blobs = {p: self._blobs(p, settings) for p in owned}
        self.now, self.seq = 1.0, 0

    def _blobs(self, p: int, settings: RunSettings) -> list[bytes]:
        n = self.sizes[p]
        shared = torch.randn(n, generator=torch.Generator().manual_seed(1000 + p)) * 3e-4
        return [
            codec.encode(outer_gradient(n, 10 * p + m, shared), settings.compression, settings.block, settings.zstd)
            for m in range(len(self.learners))
        ]

    def round(self, p: int) -> int:
        """One round of fragment p; its parameters."""
        assert self.sc.model is not None
        self.now += 1e-3
        self.seq += 1
        out = Outbox()
        for lid, blob in zip(self.learners, self.blobs[p], strict=True):
            meta = {
                "fragment": p,
                "base_version": self.sc.model.versions[p],
                "seq": self.seq,
                "epoch": self.sc.epoch,
                "c_steps": 4,
                "c_tokens": 4 * 2048,
                "c_time": 0.2,
                "step_time": 0.05,
            }
            self.sc.handle(lid, Message("push", meta, [blob]), self.now, out)
        self.sc.tick(self.now, out)
        assert [m.kind for _, m in out.sends] == ["update"], f"the round did not close: {out.events}"
        return self.sizes[p]


def _worker(
    shape: str, count: int, owned: tuple[int, ...], learners: int, seconds: float, barrier: Any, q: Any
) -> None:
    """One process: build, warm up one round of each fragment, wait for the others, merge `seconds`."""
    settings = RunSettings(fragments=count, round_clock="learner")  # a round closes once every learner pushed
    names = [f"learner-{i}" for i in range(learners)]
    merger = Merger(build(core.manifest(shape), settings, names), owned, names, settings)
    for p in owned:
        merger.round(p)
    barrier.wait()
    t0, c0, merged, rounds = time.perf_counter(), time.process_time(), 0, 0
    while time.perf_counter() - t0 < seconds:
        merged += merger.round(owned[rounds % len(owned)])
        rounds += 1
    wall = time.perf_counter() - t0
    q.put((merged / wall, rounds, (time.process_time() - c0) / wall))


def measure(
    shape: str, count: int, processes: int, learners: int, seconds: float, env: dict[str, str]
) -> CeilingResult:
    """`processes` processes at once, each merging the fragments shard s of `processes` would own."""
    sizes = fragments.plan(core.manifest(shape), count).sizes()
    owner = shards.assign(sizes, processes)
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(processes), ctx.Queue()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the children's (OMP_NUM_THREADS), as the shard processes get it
    procs = [
        ctx.Process(target=_worker, args=(shape, count, owner.owned(s), learners, seconds, barrier, q))
        for s in range(processes)
    ]
    try:
        for proc in procs:
            proc.start()
        results = [q.get(timeout=600) for _ in procs]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return CeilingResult(processes, sum(r[0] for r in results), sum(r[1] for r in results), [r[2] for r in results])
