"""Benchmark baseline: the learners' model and data trained by plain data-parallel (DDP under torchrun).

`run_ddp(...)` launches one job of `bench/ddp_worker.py` under
`python -m torch.distributed.run --standalone --nproc-per-node=N --max-restarts=R` in its own
process group, optionally SIGKILLs one worker (a seeded random rank) at each time of a failure
schedule, waits, always cleans up every process it started, and summarises the job:

- tokens, tokens/s (tokens in the final model per second of wall time), final eval loss;
- bytes of the gradient all-reduce: the payload each worker handed to all-reduce (counted by a
  DDP comm hook) and the ring all-reduce's traffic, 2(N-1)/N x payload sent (and as much
  received) per worker; per token = all workers' sent bytes / tokens;
- restarts: for each kill, the restart cost (kill -> first step of the restarted job: torchrun
  notices, tears down, re-rendezvouses, imports torch, reloads the checkpoint) and the steps and
  compute lost (trained after the last checkpoint);
- goodput = compute time whose tokens survived into the final model (summed over workers) /
  (workers x wall time, launch to exit): start-up, restarts, lost steps, exposed communication,
  evaluation and checkpoints all count against it (ALGORITHM.md, Goodput).

    .venv/bin/python bench/ddp_baseline.py --quick                  # ~1 min on 2 cores
    .venv/bin/python bench/ddp_baseline.py --workers 4 --model gpt-small --duration 120 --mtbf 20
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as python bench/ddp_baseline.py

from bench.proctree import descendants, proc_stat, signal_if_same, worker_rank

WORKER = ROOT / "bench" / "ddp_worker.py"
JOB_FILES = ("checkpoint.pt", "progress.jsonl", "final.json", "config.json", "torchrun.log")


# --------------------------------------------------------------------------- one job


class DdpJob:
    """A running torchrun job: its process, every descendant seen, and the kills done."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.log_fh = open(log, "wb")  # noqa: SIM115 (torchrun's output for the job's life; closed in cleanup)
        self.started = time.time()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self.log_fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.seen: dict[int, int] = {}
        self.kills: list[dict[str, Any]] = []

    def watch(self) -> None:
        """Remember every descendant (workers live in their own sessions: killpg misses them)."""
        self.seen.update(descendants(self.proc.pid))

    def kill_rank(self, rank: int) -> dict[str, Any] | None:
        """SIGKILL the worker process of `rank` (a child of the agent); None if it is not up now."""
        for pid, start in descendants(self.proc.pid).items():
            st = proc_stat(pid)
            mine = st is not None and st[0] == self.proc.pid and worker_rank(pid) == rank
            if mine and signal_if_same(pid, start, signal.SIGKILL):
                record = {"time": time.time(), "t": time.time() - self.started, "rank": rank, "pid": pid}
                self.kills.append(record)
                return record
        return None

    def cleanup(self, grace_s: float = 8.0) -> None:
        """SIGTERM the agent's group (it stops its workers), then SIGKILL whatever is left."""
        self.watch()
        if self.proc.poll() is None:
            _killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.seen.update(descendants(self.proc.pid))
        if self.proc.poll() is None:
            _killpg(self.proc.pid, signal.SIGKILL)
        for pid, start in self.seen.items():
            signal_if_same(pid, start, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log_fh.close()

    def alive(self) -> list[int]:
        """Pids of this job that are still running (empty after cleanup)."""
        procs = {self.proc.pid: None, **self.seen}
        alive = []
        for pid, start in procs.items():
            st = proc_stat(pid)
            if st is not None and (start is None or st[1] == start):
                alive.append(pid)
        return alive


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def torchrun_argv(workers: int, max_restarts: int, config: Path, out_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={workers}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        str(WORKER),
        "--config",
        str(config),
        "--out",
        str(out_dir),
    ]


def job_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # else a restart fails gloo init (pytorch#135712)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def read_progress(out_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (out_dir / "progress.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip().startswith("{") and line.strip().endswith("}")]


def _kill_origin(job: DdpJob, out_dir: Path, kill_from: str) -> float | None:
    """Absolute time the kill schedule counts from: the launch, or the job's first training step."""
    if kill_from == "launch":
        return job.started
    starts = [e["time"] for e in read_progress(out_dir) if e.get("event") == "start"]
    return min(starts) if starts else None


def _supervise(
    job: DdpJob, out_dir: Path, workers: int, schedule: list[float], seed: int, kill_from: str, timeout_s: float
) -> bool:
    """Poll the job until it exits (True) or the timeout (False), killing on schedule."""
    rng = random.Random(seed)
    pending = sorted(schedule)
    origin = None
    rank = rng.randrange(workers) if pending else 0
    while job.proc.poll() is None:
        if time.time() - job.started > timeout_s:
            return False
        job.watch()
        if pending and (out_dir / "final.json").exists():
            pending = []  # the final model exists: no more failures
        if pending:
            origin = origin or _kill_origin(job, out_dir, kill_from)
            due = origin is not None and time.time() - origin >= pending[0]
            if due and job.kill_rank(rank) is not None:  # not up (restarting)? try again next poll
                pending.pop(0)
                rank = rng.randrange(workers)
        time.sleep(0.1)
    return True


def run_ddp(
    settings: dict,
    workers: int,
    out_dir: Path,
    *,
    budget_tokens: int | None,
    duration_s: float | None,
    max_restarts: int = 0,
    kill_schedule: list[float] | None = None,
    seed: int = 0,
    checkpoint_every_s: float = 5.0,
    eval_every: int | None = None,
    threads: int = 1,
    device: str = "cpu",
    kill_from: str = "launch",
    timeout_s: float | None = None,
    reducer: str = "ddp",
    throttle: float = 1.0,
) -> dict:
    """Run one data-parallel job to completion and summarise it (see the module docstring).

    `kill_schedule`: seconds after `kill_from` ("launch", or "train": the first training step)
    at which one worker, a rank drawn with `seed`, is SIGKILLed; a kill due while no worker is up
    waits for the next one. `out_dir` receives the job's files (a previous job's are removed).
    `reducer`: "ddp" (DistributedDataParallel) or "flat" (explicit bucketed all-reduce after backward).
    `throttle` > 1: every rank waits (throttle - 1) x its step's compute, as a learner host's throttle.
    """
    if kill_from not in ("launch", "train"):
        raise ValueError(f"kill_from must be 'launch' or 'train', got {kill_from!r}")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in JOB_FILES:
        (out_dir / name).unlink(missing_ok=True)
    started = time.time()
    config = out_dir / "config.json"
    config.write_text(
        json.dumps(
            {
                "settings": settings,
                "budget_tokens": budget_tokens,
                "duration_s": duration_s,
                "started_at": started,
                "checkpoint_every_s": checkpoint_every_s,
                "eval_every": eval_every,
                "threads": threads,
                "device": device,
                "reducer": reducer,
                "throttle": throttle,
            },
            indent=1,
        )
    )
    if timeout_s is None:
        timeout_s = 3 * (duration_s or 1200) + 30 * (max_restarts + 2)
    job = DdpJob(torchrun_argv(workers, max_restarts, config, out_dir), job_env(threads), out_dir / "torchrun.log")
    job.started = started
    try:
        finished = _supervise(job, out_dir, workers, list(kill_schedule or []), seed, kill_from, timeout_s)
        exited = time.time()
    finally:
        job.cleanup()
    return summarize(out_dir, job, workers, exited, finished)


# --------------------------------------------------------------------------- the summary


def _restart_costs(kills: list[dict], events: list[dict]) -> list[dict]:
    """For each kill: restart cost (kill -> first step of the restarted job) and what was lost."""
    starts = [e for e in events if e.get("event") == "start" and e.get("restarts", 0) > 0]
    aborts = [e for e in events if e.get("event") == "abort"]
    out = []
    for kill in kills:
        nxt = next((s for s in starts if s["time"] > kill["time"]), None)
        abort = next((a for a in aborts if a["time"] >= kill["time"]), None)
        item = {
            **kill,
            "restart_cost_s": nxt["time"] - kill["time"] if nxt else None,
            "respawn_s": nxt["process_started"] - kill["time"] if nxt else None,  # torchrun's part
            "boot_s": nxt["boot_s"] if nxt else None,  # the new process's part
            "resumed_step": nxt["resumed_step"] if nxt else None,
            "lost_steps": None,
            "lost_compute_s": None,
        }
        if nxt and abort and abort["time"] <= nxt["time"]:
            item["lost_steps"] = abort["step"] - nxt["resumed_step"]
            item["lost_compute_s"] = abort["compute_s"] - nxt["resumed_compute_s"]
        out.append(item)
    return out


def summarize(out_dir: Path, job: DdpJob, workers: int, exited: float, finished: bool) -> dict:
    """The job's numbers from OUT/final.json, OUT/progress.jsonl and the kills done.

    Wall time runs from the launch to the final model (final.json), or to the exit without one.
    """
    events = read_progress(out_dir)
    try:
        final = json.loads((out_dir / "final.json").read_text())
    except (OSError, ValueError):
        final = {}
    ok = finished and job.proc.returncode == 0 and bool(final)
    wall = (final["time"] if final else exited) - job.started
    tokens = int(final.get("tokens", 0))
    wire_per_worker = float(final.get("wire_bytes_sent", 0.0))
    kills = _restart_costs(job.kills, events)
    costs = [k["restart_cost_s"] for k in kills if k["restart_cost_s"] is not None]
    summary = {
        "ok": ok,
        "returncode": job.proc.returncode,
        "timed_out": not finished,
        "workers": workers,
        "model": final.get("settings", {}).get("model"),
        "n_params": final.get("n_params"),
        "reducer": _config(out_dir).get("reducer"),
        "wall_s": wall,
        "exit_s": exited - job.started - wall,
        "steps": final.get("step", 0),
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "loss": final.get("loss"),
        "eval_loss": final.get("eval_loss"),
        "initial_eval_loss": final.get("initial_eval_loss"),
        "restarts": max([e.get("restarts", 0) for e in events] + [final.get("restarts", 0)]),
        "kills": kills,
        "restart_cost_s": sum(costs) / len(costs) if costs else None,
        "allreduce_payload_bytes": final.get("payload_bytes", 0),  # per worker, fp32 gradient buckets
        "wire_bytes_sent_per_worker": wire_per_worker,  # ring: 2(N-1)/N x payload (as much received)
        "wire_bytes_total": wire_per_worker * workers,
        "wire_bytes_per_token": wire_per_worker * workers / tokens if tokens else None,
        "control_bytes": final.get("control_bytes", 0),
        "compute_s": final.get("compute_s", 0.0),
        "blocked_s": final.get("blocked_s", 0.0),
        "goodput": final.get("compute_s", 0.0) / (workers * wall) if wall else 0.0,
        "pids_alive_after": job.alive(),
        "out_dir": str(out_dir),
    }
    if not ok:
        summary["log_tail"] = _tail(out_dir / "torchrun.log")
    return summary


def _config(out_dir: Path) -> dict:
    try:
        return json.loads((out_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def failure_schedule(duration_s: float, mean_interval_s: float, seed: int) -> list[float]:
    """Seeded exponential inter-failure times (a Poisson process) within `duration_s`."""
    rng = random.Random(seed)
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mean_interval_s)
        if t >= duration_s:
            return times
        times.append(round(t, 3))


# --------------------------------------------------------------------------- CLI


def _extra(parser: Any) -> None:
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds per job, start-up included")
    parser.add_argument("--mtbf", type=float, default=20.0, help="mean seconds between worker kills")
    parser.add_argument("--checkpoint-every", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reducer", choices=["ddp", "flat", "both"], default="ddp")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the jobs' files here")


def _row(case: str, s: dict) -> dict:
    cost = s["restart_cost_s"]
    return {
        "case": case,
        "ok": str(s["ok"]),
        "wall_s": s["wall_s"],
        "steps": s["steps"],
        "tokens": s["tokens"],
        "tokens/s": s["tokens_per_s"],
        "eval_loss": s["eval_loss"] or float("nan"),
        "bytes/token": s["wire_bytes_per_token"] or 0.0,
        "restarts": s["restarts"],
        "restart_cost_s": cost if cost is not None else "-",
        "lost_steps": sum(k["lost_steps"] or 0 for k in s["kills"]),
        "goodput": s["goodput"],
    }


def _quick(args: Any) -> None:
    args.workers, args.model, args.seq_len, args.batch_size = 2, "gpt-tiny", 32, 8
    args.duration, args.mtbf, args.checkpoint_every = 15.0, 8.0, 1.0


def _run_pair(args: Any, reducer: str, schedule: list[float], workdir: Path) -> tuple[dict, dict]:
    """The same job without failures, then with the kill schedule and enough restarts for it."""
    settings = {"model": args.model, "seq_len": args.seq_len, "batch_size": args.batch_size, "seed": args.seed}
    kw = dict(
        budget_tokens=None,
        duration_s=args.duration,
        checkpoint_every_s=args.checkpoint_every,
        seed=args.seed,
        reducer=reducer,
    )
    clean = run_ddp(settings, args.workers, workdir / f"{reducer}-clean", **kw)
    failing = run_ddp(
        settings,
        args.workers,
        workdir / f"{reducer}-failures",
        max_restarts=len(schedule),
        kill_schedule=schedule,
        **kw,
    )
    return clean, failing


def main(argv: list[str] | None = None) -> int:
    from bench import common

    args = common.parse_args("ddp_baseline", __doc__, _extra, argv)
    if args.quick:
        _quick(args)
    schedule = failure_schedule(args.duration, args.mtbf, args.seed)
    if args.quick:
        schedule = [round(0.6 * args.duration, 3)]  # one kill, mid-run
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ddp_baseline_"))
    reducers = ["ddp", "flat"] if args.reducer == "both" else [args.reducer]
    rows, runs = [], {}
    try:
        for reducer in reducers:
            clean, failing = _run_pair(args, reducer, schedule, workdir)
            runs[reducer] = {"clean": clean, "failures": failing}
            rows += [_row(f"{reducer}, no failures", clean), _row(f"{reducer}, {len(schedule)} kills", failing)]
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    common.print_table(
        f"Data-parallel baseline: {args.workers} workers, {args.model}, seq {args.seq_len}, "
        f"batch {args.batch_size}/worker, {args.duration:g} s, gloo",
        rows,
    )
    common.write_json(
        args.out,
        {
            "benchmark": "ddp_baseline",
            "quick": args.quick,
            "workers": args.workers,
            "model": args.model,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "duration_s": args.duration,
            "mtbf_s": args.mtbf,
            "kill_schedule": schedule,
            "rows": rows,
            "runs": runs,
        },
    )
    print(f"wrote {args.out}")
    return 0 if all(r["ok"] == "True" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
