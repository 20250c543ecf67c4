"""The load generator's processes and one measurement (bench/loadgen.py drives them).

`LoadFleet` writes a resolved configuration with CURVE keys for every learner it may run, starts
one real syncer process (bench/loadgen_syncer.py: `python -m syncer --config ...`), encodes a few
outer gradients per fragment once (`make_blobs`), and starts `procs` worker processes of
synthetic learners (bench/loadgen_worker.py). `resize(n)` runs learners 0..n-1 (learner-0 joins
first and uploads the initial model; the others fetch it) and waits until every one holds the
global state; `measure(n)` waits `settle_s`, then measures a window of `window_s` seconds: the
syncer's round records, the learners' replies, the syncer's CPU time (/proc/PID/stat, utime +
stime) and memory (VmRSS sampled through the window, VmHWM), the workers' CPU time, and the
syncer's counters.
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
from bench.loadgen_syncer import SyncerProcess, write_run
from bench.loadgen_worker import Shard, WorkerSpec
from syncer.wire import codec, fragments
from workload.presets import PRESETS

CLOCK_TICK = os.sysconf("SC_CLK_TCK")
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


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process so far; 0 if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state is fields[0]
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def proc_memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, in MB (empty if it is gone)."""
    out: dict[str, float] = {}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


class LoadFleet:
    """A real syncer and the synthetic learners' workers; always close() (a context manager)."""

    def __init__(self, cfg: LoadConfig) -> None:
        self.cfg = cfg
        self.dir = Path(tempfile.mkdtemp(prefix="dldctl-loadgen-", dir=cfg.tmp))
        self.specs = core.manifest(cfg.shape)
        self.sizes = fragments.plan(self.specs, cfg.fragments).sizes()
        self.run = SyncerProcess(self.dir, write_run(self.dir, cfg.declared, cfg.run_settings()))
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
    def syncer_pid(self) -> int:
        return self.run.pid

    # -- start -------------------------------------------------------------------------------
    def start(self) -> dict[str, float]:
        """Start the syncer, encode the blobs (meanwhile), start the workers; seconds each took."""
        t0 = time.monotonic()
        self.run.start()
        s = self.run.cfg.run
        blobs = make_blobs(self.dir / "blobs", self.sizes, self.cfg.variants, s.compression, s.block, self.cfg.seed)
        t1 = time.monotonic()
        self.run.wait_up(60.0)
        spec = WorkerSpec(
            worker=0,
            procs=self.cfg.procs,
            shards=(Shard(self.run.address, tuple(range(self.cfg.fragments))),),
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
    def resize(self, n: int, timeout: float | None = None) -> float:
        """Run learners 0..n-1 and wait until each holds the global state; seconds it took. The
        first learner ever joins alone (it uploads the initial model), the rest together."""
        if n > self.cfg.declared:
            raise ValueError(f"{n} learners, but the run has keys for {self.cfg.declared}")
        t0 = time.monotonic()
        mb = 4 * sum(self.sizes) / 1e6
        if self.size == 0 and n > 1:
            self._resize(1, 60.0 + mb / 20.0)
        self._resize(n, timeout or 60.0 + max(1, n - self.size) * mb / 20.0)
        return time.monotonic() - t0

    def _resize(self, n: int, timeout: float) -> None:
        for _, conn in self.workers:
            conn.send(("set", n))
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
                raise RuntimeError(f"the learners did not join: {why}\n{self.run.log()[-2000:]}")
            time.sleep(0.5)

    def collect(self) -> None:
        """A report from every worker: learner states, replies and step-boundary delays."""
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
    def status(self, tries: int = 3) -> dict[str, Any]:
        """The syncer's status snapshot; empty if it does not answer in `tries` x 10 s (a
        checkpoint holds its loop for seconds at the size of real models)."""
        for _ in range(tries):
            try:
                return self.run.status(timeout=10.0)
            except TimeoutError:
                continue
        return {}

    def _wait(self, seconds: float, rss: list[float] | None = None) -> None:
        """Sleep `seconds`, collecting reports (and sampling the syncer's RSS) every REPORT_EVERY_S."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(REPORT_EVERY_S, left))
            self.collect()
            if rss is not None:
                rss.append(proc_memory(self.syncer_pid).get("VmRSS", 0.0))

    def measure(self, n: int) -> dict[str, Any]:
        """Settle, then one window of the fleet at its current size: the level's record."""
        self._wait(self.cfg.settle)
        self.lag.clear()
        before, links0 = self.status(), self._link_counts()
        cpu0, gen0 = proc_cpu(self.syncer_pid), self._gen_cpu()
        start, rss = time.time(), [proc_memory(self.syncer_pid).get("VmRSS", 0.0)]
        self._wait(self.cfg.window_s, rss)
        end = time.time()
        cpu, gen = proc_cpu(self.syncer_pid) - cpu0, self._gen_cpu() - gen0
        lag, links = core.spread(self.lag), self._link_delta(links0)
        self._wait(min(2.0, self.cfg.window_s))  # replies of the window's last rounds, still in the workers
        stalls = core.checkpoint_stalls(self.run.log(), start, end)
        stats = core.window_stats(
            self.run.metrics("round"), self.replies, self.sizes, start, end, self.cfg.schedule, stalls
        )
        return {
            "learners": n,
            "window": {"start": start, "end": end},
            "stats": asdict(stats),
            "syncer": self._syncer_numbers(cpu, rss, before, stalls, stats.rounds, (start, end)),
            "generator": {"cpu_cores": gen / (end - start), "lag": lag, "links": links},
        }

    def _syncer_numbers(
        self,
        cpu: float,
        rss: list[float],
        before: dict[str, Any],
        stalls: list[tuple[float, float]],
        rounds: int,
        window: tuple[float, float],
    ) -> dict[str, Any]:
        """The syncer process over a window: CPU, memory, its counters' change, its checkpoints
        (`share`: how much of the window they held the loop)."""
        span = window[1] - window[0]
        return {
            "cpu_cores": cpu / span,
            "cpu_s_per_round": cpu / rounds if rounds else None,
            "rss_mb_max": max(rss),
            "rss_mb_end": rss[-1],
            "hwm_mb": proc_memory(self.syncer_pid).get("VmHWM", 0.0),
            "counters": _counter_delta(before, self.status()),
            "checkpoints": {
                "count": len(stalls),
                "seconds": [s for _, s in stalls],
                "share": core.stalled_seconds(stalls, *window) / span,
            },
        }

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
        """Quit the workers (killed if they do not), stop the syncer, remove the run directory."""
        for _, conn in self.workers:
            try:
                conn.send(("quit",))
            except OSError:
                pass
        for proc, _ in self.workers:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        self.workers.clear()
        self.run.close()
        if not self.cfg.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def _with_worker(spec: WorkerSpec, worker: int) -> WorkerSpec:
    return replace(spec, worker=worker)


def _index(lid: str) -> int:
    return int(lid.rsplit("-", 1)[1])


def _counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the syncer counted during the window: dropped sends and pushes, rejections, disconnects."""
    if not before or not after:
        return {"unknown": "the syncer did not answer a status request in time"}
    b, a = before["syncer"], after["syncer"]
    out: dict[str, Any] = {k: a.get(k, 0) - b.get(k, 0) for k in ("dropped_sends", "dropped_pushes", "disconnects")}
    out["rejected"] = sum(a.get("rejected", {}).values()) - sum(b.get("rejected", {}).values())
    out["live"] = after["quorum"]["live"]
    out["open_rounds"] = after["quorum"]["open_rounds"]
    return out
