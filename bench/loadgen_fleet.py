"""The load generator's processes and one measurement (bench/loadgen.py drives them).

`LoadFleet` writes a resolved configuration with CURVE keys for every learner it may run, starts
the real syncer (bench/loadgen_syncer.py: `python -m syncer --config ...`; with `shards` S > 1,
S processes `--shard 0..S-1` of one run, each owning its share of the fragments as
syncer/wire/shards.py assigns them), encodes a few outer gradients per fragment once
(`make_blobs`), and starts `procs` worker processes of synthetic learners
(bench/loadgen_worker.py; each learner links to every shard). `resize(n)` runs learners 0..n-1
(learner-0 joins first and uploads the initial model to every shard; the others fetch it) and
waits until every one holds the global state; `measure(n)` waits `settle_s`, then measures a
window of `window_s` seconds: the shards' round records (their local fragment numbers mapped to
global ones), the learners' replies, each shard's CPU time (bench/loadgen_measure.py: the
process and its loop / libzmq / other threads) and memory (VmRSS sampled through the window,
VmHWM), the workers' CPU time, and the shards' counters. Sharded, the level holds the totals
(`stats`, `syncer`: the shards summed) and each shard's own (`shards`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch

from bench import loadgen_core as core
from bench import loadgen_worker
from bench.loadgen_link import Shard
from bench.loadgen_measure import (
    combine,
    counter_delta,
    machine_busy,
    proc_cpu,
    proc_memory,
    thread_cpu,
    thread_delta,
)
from bench.loadgen_syncer import SyncerProcess, write_run
from bench.loadgen_worker import WorkerSpec
from syncer.wire import codec, fragments, shards
from workload.presets import PRESETS

REPORT_EVERY_S = 2.0


@dataclass(frozen=True)
class LoadConfig:
    """One load generator run (bench/loadgen.py's command line)."""

    shape: str = "gpt2-124m"
    H: int = 64
    fragments: int = 4
    step_time: float = 1.0
    procs: int = 2
    decode: str = "one"
    variants: int = 4
    window_s: float = 120.0
    settle_s: float | None = None  # None: one round interval, at least 5 s
    declared: int = 16  # learners with keys in the run (the most the run can hold)
    overrides: dict[str, Any] = field(default_factory=dict)  # [run] settings
    seed: int = 0
    keep: bool = False  # keep the run directory
    tmp: str | None = None  # where the run directory goes (the syncer's checkpoints too); None: the system's
    shards: int = 1  # syncer processes of the run, each owning a balanced share of the fragments
    syncer_threads: int = 0  # torch's intra-op threads in each syncer process (OMP_NUM_THREADS); 0: torch's default

    @property
    def schedule(self) -> core.Schedule:
        return core.Schedule(self.H, self.fragments, self.step_time)

    @property
    def settle(self) -> float:
        return self.settle_s if self.settle_s is not None else max(5.0, self.schedule.round_interval_s)

    def run_settings(self) -> dict[str, Any]:
        """The [run] table: the defaults, with the global model's scoring off (it would build and
        evaluate a real model in the syncer) and the generator's H, fragments, model."""
        return {
            "model": self.shape if self.shape in PRESETS else "gpt2-124m",  # a name only: no model is built
            "seq_len": min(1024, core.SHAPES[self.shape].block_size),
            "batch_size": 16,
            "H": self.H,
            "fragments": self.fragments,
            "heartbeat_s": 0.5,
            "liveness_s": 3.0,
            "eval_every": 50,
            "eval_batches": 4,
            "warmup": 50,
            "global_eval_every": 0,
            "quality_guard": 0.0,
            **self.overrides,
        }


@dataclass
class Window:
    """What one measurement window sampled (per shard where a list)."""

    start: float  # wall clock
    end: float
    before: list[dict[str, Any]]  # each shard's status snapshot at the start ({} if it did not answer)
    cpu: list[float]  # each shard's CPU seconds over the window
    threads: list[dict[str, float]]  # each shard's cores per kind of thread (loadgen_measure.thread_cpu)
    rss: list[list[float]]  # VmRSS samples (MB): one list of the shards' values per sample time
    gen_cpu: float  # the workers' CPU seconds
    busy: float  # CPU seconds the whole machine was busy (every process, ours and others')
    own: float  # CPU seconds of this process (the fleet's parent)
    lag: dict[str, float | None]  # how late the workers handled step boundaries
    links: dict[str, int]  # the learners' link counters' change

    @property
    def span(self) -> float:
        return self.end - self.start


def make_blobs(
    directory: Path, sizes: list[int], variants: int, mode: str, block: int, seed: int
) -> dict[int, list[str]]:
    """`variants` encoded outer gradients per fragment, with the statistics of real ones: a
    direction shared by the fleet, each learner's own Gaussian noise, and a few outliers
    (bench/syncer_throughput.py's model of them). Files: DIR/push-P-K.bin."""
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[int, list[str]] = {}
    for p, n in enumerate(sizes):
        g = torch.Generator().manual_seed(7919 * seed + p)
        shared = torch.randn(n, generator=g) * 3e-4
        out[p] = []
        for k in range(variants):
            delta = shared + torch.randn(n, generator=g) * 1e-3
            idx = torch.randint(0, n, (max(1, n // 1000),), generator=g)
            delta[idx] *= 20.0
            path = directory / f"push-{p}-{k}.bin"
            path.write_bytes(codec.encode(delta, mode, block))
            out[p].append(str(path))
        del shared
    return out


class LoadFleet:
    """The real syncer (its shards) and the synthetic learners' workers; always close() (a context
    manager)."""

    def __init__(self, cfg: LoadConfig) -> None:
        self.cfg = cfg
        self.dir = Path(tempfile.mkdtemp(prefix="dldctl-loadgen-", dir=cfg.tmp))
        self.specs = core.manifest(cfg.shape)
        self.sizes = fragments.plan(self.specs, cfg.fragments).sizes()
        owner = shards.assign(self.sizes, cfg.shards)
        self.owned = [owner.owned(s) for s in range(cfg.shards)]  # global fragments, each shard's local order
        config = write_run(self.dir, cfg.declared, cfg.run_settings(), shards=cfg.shards)
        env = {"OMP_NUM_THREADS": str(cfg.syncer_threads)} if cfg.syncer_threads > 0 else {}
        self.syncers = [SyncerProcess(self.dir, config, s, env) for s in range(cfg.shards)]
        self.workers: list[tuple[BaseProcess, Connection]] = []
        self.replies: list[core.Reply] = []
        self.learners: dict[str, dict[str, Any]] = {}
        self.lag: list[float] = []
        self.size = 0

    def __enter__(self) -> LoadFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def run(self) -> SyncerProcess:
        """Shard 0: the whole syncer when unsharded."""
        return self.syncers[0]

    @property
    def syncer_pid(self) -> int:
        return self.run.pid

    # -- start -------------------------------------------------------------------------------
    def start(self) -> dict[str, float]:
        """Start the shards, encode the blobs (meanwhile), start the workers; seconds each took."""
        t0 = time.monotonic()
        for syncer in self.syncers:
            syncer.start()
        s = self.run.cfg.run
        blobs = make_blobs(self.dir / "blobs", self.sizes, self.cfg.variants, s.compression, s.block, self.cfg.seed)
        t1 = time.monotonic()
        for syncer in self.syncers:
            syncer.wait_up(60.0)
        spec = WorkerSpec(
            worker=0,
            procs=self.cfg.procs,
            shards=tuple(Shard(x.address, self.owned[x.shard]) for x in self.syncers),
            keys_dir=None if s.insecure else str(self.dir / "keys"),
            run_id=self.run.cfg.run_id,
            settings=s.to_dict(),
            manifest=fragments.manifest_to_json(self.specs),
            sizes=self.sizes,
            blobs=blobs,
            step_time=self.cfg.step_time,
            decode=self.cfg.decode,
            seed=self.cfg.seed,
        )
        ctx = mp.get_context("spawn")  # no fork of a process that holds ZeroMQ contexts and torch threads
        for w in range(self.cfg.procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=loadgen_worker.main, args=(_with_worker(spec, w), child), daemon=True)
            proc.start()
            self.workers.append((proc, parent))
        return {"blobs_s": t1 - t0, "start_s": time.monotonic() - t0}

    # -- the fleet ---------------------------------------------------------------------------
    def resize(self, n: int, timeout: float | None = None, hold: bool = False) -> float:
        """Run learners 0..n-1 and wait until each holds the global state; seconds it took. The
        first learner ever joins alone (it uploads the initial model), the rest together. With
        `hold`, the new learners take their first step only once all of them are ready (no merge
        competes with their fetches)."""
        if n > self.cfg.declared:
            raise ValueError(f"{n} learners, but the run has keys for {self.cfg.declared}")
        t0 = time.monotonic()
        mb = 4 * sum(self.sizes) / 1e6
        self._send(("hold", hold))
        if self.size == 0 and n > 1:
            self._resize(1, 60.0 + mb / 20.0)
        self._resize(n, timeout or 60.0 + max(1, n - self.size) * mb / 20.0)
        self._send(("hold", False))
        return time.monotonic() - t0

    def _send(self, cmd: tuple[Any, ...]) -> None:
        for _, conn in self.workers:
            conn.send(cmd)

    def _resize(self, n: int, timeout: float) -> None:
        self._send(("set", n))
        self.size = n
        deadline = time.monotonic() + timeout
        while True:
            self.collect()
            ready = sum(1 for lid, st in self.learners.items() if st["ready"] and _index(lid) < n)
            if ready >= n:
                return
            fatal = [f"{lid}: {st['fatal']}" for lid, st in self.learners.items() if st["fatal"]]
            if fatal or time.monotonic() > deadline:
                why = "; ".join(fatal) or f"{ready} of {n} ready after {timeout:.0f} s"
                logs = "\n".join(x.log()[-2000:] for x in self.syncers)
                raise RuntimeError(f"the learners did not join: {why}\n{logs}")
            time.sleep(0.5)

    def collect(self) -> None:
        """A report from every worker: learner states, replies and step-boundary delays.
        SyncerDied if a shard has ended: nothing would ever join or merge again."""
        for syncer in self.syncers:
            syncer.check_alive()
        for proc, conn in self.workers:
            if not proc.is_alive():
                raise RuntimeError(f"load generator worker {proc.pid} died (exit code {proc.exitcode})")
            conn.send(("report",))
        for _, conn in self.workers:
            if not conn.poll(30.0):
                raise RuntimeError("a load generator worker did not answer within 30 s")
            report = conn.recv()
            self.learners.update(report["learners"])
            self.replies += [core.Reply.from_dict(r) for r in report["replies"]]
            self.lag += report["lag"]
        self.learners = {lid: st for lid, st in self.learners.items() if _index(lid) < self.size}

    # -- measuring ---------------------------------------------------------------------------
    def status(self, shard: int = 0, tries: int = 3) -> dict[str, Any]:
        """A shard's status snapshot; empty if it does not answer in `tries` x 10 s (a
        checkpoint holds its loop for seconds at the size of real models)."""
        for _ in range(tries):
            try:
                return self.syncers[shard].status(timeout=10.0)
            except TimeoutError:
                continue
        return {}

    def rounds(self, shard: int) -> list[dict[str, Any]]:
        """A shard's `round` records, their fragments numbered globally (and the shard named)."""
        owned = self.owned[shard]
        return [
            {**r, "fragment": owned[int(r["fragment"])], "shard": shard} for r in self.syncers[shard].metrics("round")
        ]

    def _rss(self) -> list[float]:
        return [proc_memory(x.pid).get("VmRSS", 0.0) for x in self.syncers]

    def _wait(self, seconds: float, rss: list[list[float]] | None = None) -> None:
        """Sleep `seconds`, collecting reports (and sampling the shards' RSS) every REPORT_EVERY_S."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(REPORT_EVERY_S, left))
            self.collect()
            if rss is not None:
                rss.append(self._rss())

    def measure(self, n: int) -> dict[str, Any]:
        """Settle, then one window of the fleet at its current size: the level's record."""
        self._wait(self.cfg.settle)
        w = self._sample()
        self._wait(min(2.0, self.cfg.window_s))  # replies of the window's last rounds, still in the workers
        parts: list[dict[str, Any]] = []
        records: list[dict[str, Any]] = []
        stalls: list[tuple[float, float]] = []
        for s in range(self.cfg.shards):
            recs, st, stats = self._shard_window(s, w.start, w.end)
            records, stalls = records + recs, stalls + st
            numbers = self._syncer_numbers(s, w, st, stats.rounds)
            parts.append({"shard": s, "fragments": list(self.owned[s]), "stats": asdict(stats), "syncer": numbers})
        total = core.window_stats(records, self.replies, self.sizes, w.start, w.end, self.cfg.schedule, stalls)
        syncers = [p["syncer"] for p in parts]
        others = max(0.0, w.busy - sum(w.cpu) - w.gen_cpu - w.own)  # every other process on the machine
        level: dict[str, Any] = {
            "learners": n,
            "window": {"start": w.start, "end": w.end},
            "stats": asdict(total),
            "syncer": syncers[0] if len(parts) == 1 else combine(syncers, w.rss, total.rounds, w.span),
            "generator": {"cpu_cores": w.gen_cpu / w.span, "lag": w.lag, "links": w.links},
            "machine": {"busy_cores": w.busy / w.span, "others_cores": others / w.span, "parent_cores": w.own / w.span},
        }
        if len(parts) > 1:
            level["shards"] = parts
        return level

    def _sample(self) -> Window:
        """One window of `window_s`: what the processes and the learners counted over it."""
        self.lag.clear()
        before, links0 = [self.status(s) for s in range(self.cfg.shards)], self._link_counts()
        cpu0, threads0, gen0 = self._cpu(), [thread_cpu(x.pid) for x in self.syncers], self._gen_cpu()
        busy0, own0 = machine_busy(), proc_cpu(os.getpid())
        start, rss = time.time(), [self._rss()]
        self._wait(self.cfg.window_s, rss)
        end = time.time()
        return Window(
            start=start,
            end=end,
            before=before,
            cpu=[c - c0 for c, c0 in zip(self._cpu(), cpu0, strict=True)],
            threads=[thread_delta(t0, thread_cpu(x.pid), end - start) for t0, x in zip(threads0, self.syncers)],
            rss=rss,
            gen_cpu=self._gen_cpu() - gen0,
            busy=machine_busy() - busy0,
            own=proc_cpu(os.getpid()) - own0,
            lag=core.spread(self.lag),
            links=self._link_delta(links0),
        )

    def _shard_window(
        self, s: int, start: float, end: float
    ) -> tuple[list[dict[str, Any]], list[tuple[float, float]], core.WindowStats]:
        """Shard s over [start, end): its round records, its checkpoints, its window's stats (the
        replies it sent; the offered rate of its own fragments)."""
        records = self.rounds(s)
        stalls = core.checkpoint_stalls(self.syncers[s].log(), start, end)
        schedule = core.Schedule(self.cfg.H, len(self.owned[s]), self.cfg.step_time)
        replies = [r for r in self.replies if r.shard == s]
        return records, stalls, core.window_stats(records, replies, self.sizes, start, end, schedule, stalls)

    def _syncer_numbers(self, s: int, w: Window, stalls: list[tuple[float, float]], rounds: int) -> dict[str, Any]:
        """Shard s's process over the window: CPU (and per kind of thread), memory, its counters'
        change, its checkpoints (`share`: how much of the window they held the loop)."""
        rss = [sample[s] for sample in w.rss]
        return {
            "cpu_cores": w.cpu[s] / w.span,
            "threads": w.threads[s],
            "cpu_s_per_round": w.cpu[s] / rounds if rounds else None,
            "rss_mb_max": max(rss),
            "rss_mb_end": rss[-1],
            "hwm_mb": proc_memory(self.syncers[s].pid).get("VmHWM", 0.0),
            "counters": counter_delta(w.before[s], self.status(s)),
            "checkpoints": {
                "count": len(stalls),
                "seconds": [sec for _, sec in stalls],
                "share": core.stalled_seconds(stalls, w.start, w.end) / w.span,
            },
        }

    def _cpu(self) -> list[float]:
        return [proc_cpu(x.pid) for x in self.syncers]

    def _gen_cpu(self) -> float:
        pids = [p.pid for p, _ in self.workers if p.pid is not None]
        return sum(proc_cpu(pid) for pid in pids)

    def _link_counts(self) -> dict[str, dict[str, int]]:
        """Each learner's link counters so far (they count from its start)."""
        keys = ("reconnects", "refetches", "bad_messages", "missed_updates", "fetched_replies")
        return {lid: {k: int(st[k]) for k in keys} for lid, st in self.learners.items()}

    def _link_delta(self, before: dict[str, dict[str, int]]) -> dict[str, int]:
        """What the learners' links counted since `before` (all learners together), and the
        pushes still waiting for a reply now."""
        now = self._link_counts()
        keys = ("reconnects", "refetches", "bad_messages", "missed_updates", "fetched_replies")
        out = {k: sum(c[k] - before.get(lid, {}).get(k, 0) for lid, c in now.items()) for k in keys}
        out["outstanding"] = sum(int(st["outstanding"]) for st in self.learners.values())
        return out

    # -- stop --------------------------------------------------------------------------------
    def close(self) -> None:
        """Quit the workers (killed if they do not), stop the shards, remove the run directory."""
        try:
            self._send(("quit",))
        except OSError:
            pass
        for proc, _ in self.workers:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        self.workers.clear()
        for syncer in self.syncers:
            syncer.close()
        if not self.cfg.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def _with_worker(spec: WorkerSpec, worker: int) -> WorkerSpec:
    return replace(spec, worker=worker)


def _index(lid: str) -> int:
    return int(lid.rsplit("-", 1)[1])
