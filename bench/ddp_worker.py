"""One rank of the data-parallel baseline: the learners' model and data, trained with DDP under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node=N --max-restarts=R \\
        bench/ddp_worker.py --config CONFIG.json --out DIR

`bench/ddp_baseline.py` launches this (and sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without
which a torchrun restart fails gloo init: pytorch/pytorch#135712). Every rank builds the same
`Workload` a learner builds (`build_workload`, learner_index = rank, shards = world, the run's
seed: identical init everywhere), wraps the model in DDP (gloo on CPU, NCCL on CUDA) and trains
with the learners' inner optimizer (AdamW, linear warmup, grad clip) until the token budget
(summed over ranks) or the duration (counted from the launcher's start, restarts included).

Two ways to average gradients (config "reducer"; both in bench/ddp_comm.py):
- "ddp" (default): DistributedDataParallel, bucketed all-reduce overlapped with backward;
- "flat": no DDP; after backward, the fp32 gradients are copied into flat buckets, each bucket is
  all-reduced with `dist.all_reduce` and averaged, nothing overlapped. Same maths, same bytes, and
  every second of communication is plainly blocked time. (On our 2-core CPU host it was the faster
  of the two: DDP's background all-reduce competes with backward for the cores.)

What it counts, and how:
- gradient bytes: a DDP comm hook (the stock allreduce hook plus a counter) adds the size of every
  bucket this rank hands to all-reduce ("flat": of every bucket it all-reduces); a ring all-reduce
  of B bytes sends 2(N-1)/N * B and receives as much per rank. Either way it is exactly the fp32
  gradients, once per step.
- blocked time: the hook also notes when the last bucket became ready (local backward done);
  what backward() spends after that is communication left exposed (overlap hides the rest);
  "flat" counts the whole explicit all-reduce as blocked.
  The small per-step control all-reduce (tokens, times, loss, stop flag) counts as blocked too.
- compute time: forward + backward + clip + AdamW minus the exposed communication, summed over
  ranks. It is stored in the checkpoint, so after a restart it counts only work that survived.
Start-up (the bulk of a restart's cost) is timed by stage and reported with the "start" event:
imports, process group, workload + checkpoint, DDP + AdamW (whose construction imports
torch._dynamo: about 2 s on a small CPU host, learners pay it too), first step.
Rank 0 checkpoints model + optimizer + counters + data position atomically (syncer.common.atomic)
every `checkpoint_every_s`; every rank resumes from it at start and fast-forwards its batch
stream to the checkpointed step (exactly, for the built-in `Batches`). Rank 0 evaluates on the
learners' held-out batches at the start, every `eval_every` steps and at the end, and appends
JSON lines to OUT/progress.jsonl: events "start" (first step of an incarnation), "eval",
"checkpoint", "final"; any rank that survives a peer's death appends "abort" (how far this
incarnation got). OUT/final.json holds the end result.
"""

from __future__ import annotations

import time

_PROCESS_T0 = time.time()  # before the heavy imports: the restart cost includes them

import argparse
import datetime
import gc
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script by torchrun: make `bench`, `learner` importable

import torch
import torch.distributed as dist

from bench.baseline_loop import InnerLoop, inner_optimizer, workload
from bench.ddp_comm import reducer, ring_wire_bytes
from syncer.common.atomic import atomic_file, atomic_write
from syncer.common.settings import settings_from_dict
from workload import Workload
from workload import data as data_mod

_BOOT: dict[str, float] = {"imported": time.time()}  # when each start-up stage ended (restart cost)

CHECKPOINT, PROGRESS, FINAL = "checkpoint.pt", "progress.jsonl", "final.json"


@dataclass
class JobConfig:
    """The worker's JSON config (what `run_ddp` writes)."""

    settings: dict  # run settings, as for the learners (model, data, seed, lr, ...)
    budget_tokens: int | None = None  # stop at this many tokens, summed over ranks
    duration_s: float | None = None  # stop this long after `started_at` (restarts included)
    started_at: float | None = None  # the launcher's time.time() at launch
    checkpoint_every_s: float = 5.0
    eval_every: int | None = None  # default: settings["eval_every"]
    threads: int = 1  # torch intra-op threads per rank
    device: str = "cpu"  # cpu | cuda (each rank takes its LOCAL_RANK's GPU)
    reducer: str = "ddp"  # ddp | flat (see the module docstring)
    bucket_mb: float = 25.0  # "flat": bucket size (DDP's default bucket_cap_mb is 25 too)
    pg_timeout_s: float = 120.0
    throttle: float = 1.0  # > 1: each step waits (throttle - 1) x its compute, as a learner's host throttle


@dataclass
class Counters:
    """The job's progress along the lineage of the current model (restored from the checkpoint)."""

    step: int = 0
    tokens: int = 0  # summed over ranks
    compute_s: float = 0.0  # summed over ranks: fwd + bwd + clip + AdamW - exposed comm
    blocked_s: float = 0.0  # summed over ranks: exposed gradient all-reduce + control all-reduce
    payload_bytes: int = 0  # per rank: gradient bytes handed to all-reduce
    control_bytes: int = 0  # per rank: bytes of the small control all-reduce
    eval_s: float = 0.0  # rank 0: time spent evaluating
    checkpoint_s: float = 0.0  # rank 0: time spent writing checkpoints
    loss: float | None = None  # training loss of the last step, mean over ranks
    eval_loss: float | None = None
    initial_eval_loss: float | None = None


def fast_forward(next_batch: Any, steps: int) -> bool:
    """Skip `steps` batches of a built-in `Batches` stream without gathering them (the same window
    starts `Batches.next()` would draw); False if `next_batch` is not one (a custom workload)."""
    batches = getattr(next_batch, "__self__", None)
    if not isinstance(batches, data_mod.Batches):
        return False
    for _ in range(steps):
        batches._rng.integers(batches.start, batches.stop - batches.seq_len, size=batches.batch_size)
    return True


def load_config(text_or_path: str) -> JobConfig:
    """A JobConfig from inline JSON or a JSON file; unknown keys are an error."""
    raw = text_or_path.strip()
    data = json.loads(raw if raw.startswith("{") else Path(raw).read_text())
    known = {f.name for f in fields(JobConfig)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown ddp_worker config keys {sorted(unknown)}; known: {sorted(known)}")
    cfg = JobConfig(**data)
    cfg.settings = settings_from_dict(cfg.settings).to_dict()  # the learners' defaults, validated
    if cfg.reducer not in ("ddp", "flat"):
        raise ValueError(f"reducer must be 'ddp' or 'flat', got {cfg.reducer!r}")
    if not cfg.budget_tokens and not cfg.duration_s:
        raise ValueError("set budget_tokens or duration_s: the job needs a way to end")
    return cfg


class Job:
    """This rank's training job."""

    def __init__(self, cfg: JobConfig, out: Path, device: torch.device) -> None:
        self.cfg, self.s, self.out, self.device = cfg, cfg.settings, out, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.eval_every = int(cfg.eval_every or self.s["eval_every"])
        ckpt = load_checkpoint(out / CHECKPOINT, device)
        self.finished = bool(ckpt and ckpt.get("finished"))
        self.final_doc: dict = (ckpt or {}).get("final") or {}
        self.c = Counters(**ckpt["counters"]) if ckpt else Counters()
        self.started_at = float(cfg.started_at or (ckpt or {}).get("started_at") or time.time())
        self.resumed = Counters(**asdict(self.c))
        self.wl = self._build(ckpt)
        _BOOT["workload"] = time.time()
        self.reduce = reducer(cfg.reducer, self.wl.model, device, self.world, cfg.bucket_mb, self.c.payload_bytes)
        self.opt = inner_optimizer(self.wl.model, self.s)
        if ckpt:
            self.opt.load_state_dict(ckpt["optimizer"])
        self.loop = InnerLoop(self.wl, self.opt, self.reduce, self.s, device=device, throttle=cfg.throttle)
        self._agree_on_step()
        self.pending_blocked = 0.0
        self.last_checkpoint = time.monotonic()
        _BOOT["job_ready"] = time.time()

    def _build(self, ckpt: dict | None) -> Workload:
        wl = workload(self.s, self.rank, self.world, self.device, int(self.s["seed"]))
        if ckpt:
            if not fast_forward(wl.next_batch, self.c.step):
                # a custom workload: its stream cannot be fast-forwarded; draw a fresh one instead
                wl = workload(self.s, self.rank, self.world, self.device, int(self.s["seed"]) + 7_919 * self.c.step)
            wl.model.load_state_dict(ckpt["model"])
        return wl

    def _agree_on_step(self) -> None:
        """Check that every rank loaded the same checkpoint (no rank can step, so rank 0 cannot write
        a newer one, before all ranks have passed this all-reduce)."""
        mine = torch.tensor([self.c.step, -self.c.step], dtype=torch.int64, device=self.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        if int(mine[0]) != self.c.step or int(mine[1]) != -self.c.step:
            raise RuntimeError(
                f"rank {self.rank}: ranks resumed from different steps ({int(mine[0])} vs "
                f"{-int(mine[1])}); was the checkpoint rewritten during start-up?"
            )

    # -- training ----------------------------------------------------------------------------
    def run(self) -> int:
        """Train until the budget is spent; checkpoint, evaluate, report; returns the exit code."""
        if self.finished:  # restarted after the final checkpoint: nothing left to train
            if self.rank == 0:
                self._event("finished-already")
                if not (self.out / FINAL).exists():
                    write_json_atomic(self.out / FINAL, self.final_doc)
            dist.barrier()
            return 0
        if self.rank == 0 and self.c.step == 0:
            self._evaluate(initial=True)
        try:
            stop = False
            while not stop:
                stop = self._train_step()
                if self.rank == 0:
                    self._after_step(first=self.c.step == self.resumed.step + 1)
        except Exception as exc:
            # a survivor whose collective failed when a peer died says how far this incarnation got
            # (counters are the same on every rank). No SIGTERM handler on purpose: a Python handler
            # cannot run while the rank is blocked inside a C++ collective or rendezvous, so the
            # agent would wait its 30 s shutdown timeout before SIGKILL, slowing every restart.
            self._event("abort", rank=self.rank, error=f"{type(exc).__name__}: {exc}"[:300])
            raise
        self._finish()
        return 0

    def _train_step(self) -> bool:
        """One inner step (the reducer averages the gradients) and the control all-reduce; True when
        the job should stop."""
        step = self.loop.step(self.loop.lr(self.c.step))
        value, exposed, compute = float(step.loss.detach()), step.exposed_s, step.compute_s
        ctrl = torch.tensor(
            [step.tokens, compute, exposed + self.pending_blocked, value, float(self._out_of_time())],
            dtype=torch.float64,
            device=self.device,
        )
        t1 = time.perf_counter()
        dist.all_reduce(ctrl)
        self.pending_blocked = time.perf_counter() - t1  # counted with the next step
        tokens, compute_sum, blocked_sum, loss_sum, stop = ctrl.tolist()
        c = self.c
        c.step += 1
        c.tokens += round(tokens)
        c.compute_s += compute_sum
        c.blocked_s += blocked_sum
        c.payload_bytes = self.reduce.payload_bytes
        c.control_bytes += ctrl.numel() * ctrl.element_size()
        c.loss = loss_sum / self.world
        return stop > 0 or bool(self.cfg.budget_tokens and c.tokens >= self.cfg.budget_tokens)

    def _out_of_time(self) -> bool:
        duration = self.cfg.duration_s
        if not duration:  # no duration set (or 0): only the token budget ends the job
            return False
        return time.time() - self.started_at >= float(duration)

    def _after_step(self, first: bool) -> None:
        """Rank 0's bookkeeping between steps: start event, periodic eval and checkpoint."""
        if first:
            _BOOT["first_step"] = time.time()
            marks = [_PROCESS_T0, *_BOOT.values()]
            stages = {f"{name}_s": b - a for name, a, b in zip(_BOOT, marks, marks[1:])}
            self._event(
                "start",
                resumed_step=self.resumed.step,
                resumed_tokens=self.resumed.tokens,
                resumed_compute_s=self.resumed.compute_s,
                process_started=_PROCESS_T0,
                boot_s=_BOOT["first_step"] - _PROCESS_T0,
                boot_stages=stages,
            )
        if self.c.step % self.eval_every == 0:
            self._evaluate()
        if time.monotonic() - self.last_checkpoint >= self.cfg.checkpoint_every_s:
            self._checkpoint()

    @torch.no_grad()
    def _evaluate(self, initial: bool = False) -> float:
        """Mean loss over the learners' fixed held-out batches, on the bare model (rank 0)."""
        t0 = time.perf_counter()
        model = self.wl.model
        model.eval()
        losses = [float(self.wl.loss(model, b)) for b in self.wl.eval_batches]
        model.train()
        value = sum(losses) / max(1, len(losses))
        self.c.eval_loss = value
        if initial:
            self.c.initial_eval_loss = value
        self.c.eval_s += time.perf_counter() - t0
        self._event("eval")
        return value

    def _checkpoint(self, final: dict | None = None) -> None:
        t0 = time.perf_counter()
        state = {
            "model": self.wl.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "counters": asdict(self.c),
            "data": {"step": self.c.step, "seed": int(self.s["seed"])},
            "world": self.world,
            "started_at": self.started_at,
            "saved_at": time.time(),
            "finished": final is not None,
            "final": final,
        }
        save_atomic(state, self.out / CHECKPOINT)
        self.c.checkpoint_s += time.perf_counter() - t0
        self.last_checkpoint = time.monotonic()
        self._event("checkpoint")

    def _finish(self) -> None:
        """Final eval, final.json and a finished checkpoint (rank 0); then every rank meets."""
        if self.rank == 0:
            self._evaluate()
            doc = self._record("final")
            doc.update(
                world=self.world,
                n_params=sum(p.numel() for p in self.wl.model.parameters()),
                resumed_step=self.resumed.step,
                settings=self.s,
                budget_tokens=self.cfg.budget_tokens,
                duration_s=self.cfg.duration_s,
            )
            self._checkpoint(final=doc)
            write_json_atomic(self.out / FINAL, doc)
            self._append(doc)
        dist.barrier()

    # -- reporting ---------------------------------------------------------------------------
    def _record(self, event: str, **extra: Any) -> dict:
        now = time.time()
        doc = {
            "event": event,
            "time": now,
            "t": now - self.started_at,
            "restarts": self.restart,
            **asdict(self.c),
            "wire_bytes_sent": ring_wire_bytes(self.c.payload_bytes, self.world),
            **extra,
        }
        doc["bytes"] = doc["wire_bytes_sent"]
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in doc.items()}

    def _event(self, event: str, **extra: Any) -> None:
        self._append(self._record(event, **extra))

    def _append(self, doc: dict) -> None:
        """One line, one write() in append mode: lines from several ranks never interleave."""
        with open(self.out / PROGRESS, "a") as fh:
            fh.write(json.dumps(doc) + "\n")


def load_checkpoint(path: Path, device: torch.device) -> dict | None:
    """The checkpoint at `path`, or None when there is none yet."""
    if not path.exists():
        return None
    return torch.load(path, map_location=device, weights_only=True)


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save through the one atomic write: never a torn checkpoint."""
    with atomic_file(path) as fh:
        torch.save(obj, fh)


def write_json_atomic(path: Path, doc: dict) -> None:
    atomic_write(path, json.dumps(doc, indent=1) + "\n")


def setup(cfg: JobConfig) -> torch.device:
    """Threads, device and the process group torchrun prepared (env:// rendezvous)."""
    torch.set_num_threads(max(1, cfg.threads))
    cuda = cfg.device.startswith("cuda")
    if cuda:
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # a dead peer must fail the collective quickly, not after gloo's default 30 minutes
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=cfg.pg_timeout_s))
    _BOOT["process_group"] = time.time()
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="JSON text or a JSON file (see JobConfig)")
    parser.add_argument("--out", required=True, type=Path, help="the job's directory (checkpoint, progress)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    args.out.mkdir(parents=True, exist_ok=True)
    device = setup(cfg)
    try:
        return Job(cfg, args.out, device).run()
    finally:
        # the DDP model sits in reference cycles: alive at exit, its gloo state was torn down during
        # interpreter finalization and aborted a rank after the final barrier ("terminate called
        # without an active exception"), as learner/island.py found for FSDP; collect it first
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
