"""The fleet benchmarks' harness: the real `dldctl` CLI on a local fleet, in a throw-away home.

`BenchRun` is the project's harness (`dldctl.testing.DldctlHome`: `dldctl` as a subprocess with
its own `DLDCTL_HOME` in a temp dir, `up -d` from a `[run]` table and local hosts, `chaos kill`,
`down --json`, and a teardown that always runs: `dldctl down`, then a SIGKILL by pid and start
time for whatever procs.jsonl records as still alive, never by name, then the home deleted)
with what only the benchmarks need: the syncer's samples and rounds, the training start,
seeded kills and the chaos monkey. The home is kept, and its path printed, when the environment
sets `DLD_BENCH_KEEP=1`: for a post-mortem of a run's records and logs.

The benchmarks read what the run wrote rather than polling `dldctl status` (each call is a
Python start-up, about a second of CPU on a 2-core machine shared with the fleet):
`samples()` (the syncer's `sample` records, every 2 s), `rounds()` (one per merge) and
`events()`. `window_goodput()` (in bench/fleet_summary.py, with the run's other derived numbers)
turns the samples into goodput over a chosen time window:

    merged_s(t)      = goodput(t) * provisioned_s(t)          (what the syncer reports)
    provisioned_s(t) = M * (t - t_syncer_start)               (M declared learners, no syncer restart)
    goodput[a, b]    = (merged_s(b) - merged_s(a)) / (M * (b - a))

`WORKLOAD` and `diloco_run()` give every benchmark the same model, data, batch and inner
optimizer; `run_diloco(Plan(...))` runs one fleet from `up` to the evaluated final model, and
`run_dp(...)` runs the data-parallel baseline (bench/ddp_baseline.py) and evaluates it the same way:

    res = run_diloco(Plan("quality", diloco_run(32, steps=1500), [local_host("here", 4)], learners=4))
    res["eval_loss"], res["tokens_trained"], res["bytes_per_token"], res["window"]["goodput"]
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.fleet_summary import budget_reached, finished_learners, summarize_run
from dldctl.testing import DldctlHome
from dldctl.testing import local_host as local_host  # the benchmarks import these two from here
from dldctl.testing import read_jsonl as read_jsonl
from syncer.common.settings import RunSettings

# --------------------------------------------------------------------------- shared settings

# The workload every fleet benchmark trains, DiLoCo and its baselines alike: the model, data,
# batch, inner optimizer (AdamW, the learners' defaults) and held-out eval batches.
WORKLOAD: dict[str, Any] = {
    "model": "gpt-tiny",
    "data": "builtin",
    "seq_len": 32,
    "batch_size": 8,
    "seed": 0,
    "lr": 3e-3,
    "warmup": 50,
    "eval_every": 500,
    "eval_batches": 16,
}


class OuterOptimizer(TypedDict):
    """An outer optimizer as `[run]` keys, to pass on as `diloco_run(H, **outer)` (typed, so that
    mypy knows these floats go to `**extra`, not to `compression` or `quorum`)."""

    outer_lr: float
    outer_momentum: float


def diloco_run(
    H: int = 32, *, compression: str = "int4", quorum: int = 1, overlap: bool = True, steps: int = 0, **extra: Any
) -> dict[str, Any]:
    """The `[run]` table of a benchmark fleet: WORKLOAD plus the DiLoCo settings.

    4 fragments, dldctl's default outer optimizer (`RunSettings.outer_lr`, `outer_momentum`),
    a 0.5 s restart delay (the default
    is 2 s: the failure benchmarks measure the algorithm, not a conservative supervisor), and
    `extra` on top.
    """
    run = {
        **WORKLOAD,
        "H": H,
        "fragments": 4,
        "quorum": quorum,
        "overlap": overlap,
        "compression": compression,
        "outer_lr": RunSettings.outer_lr,
        "outer_momentum": RunSettings.outer_momentum,
        "restart_delay_s": 0.5,
        "steps": steps,
    }
    run.update(extra)
    return run


# --------------------------------------------------------------------------- the fleet


class BenchRun(DldctlHome):
    """One `dldctl` home (dldctl.testing: a temp dir, always torn down) with (at most) one run
    in it, plus what the benchmarks read and do: samples, rounds, seeded kills, the monkey."""

    def __init__(self, name: str = "bench", keep: bool = False, tmpfs_mb: int | None = None) -> None:
        super().__init__(name=name, keep=keep, tmpfs_mb=tmpfs_mb, columns=160)

    def samples(self) -> list[dict[str, Any]]:
        """The syncer's `sample` records (every 2 s)."""
        return self.metrics("sample")

    def rounds(self) -> list[dict[str, Any]]:
        """One record per merge."""
        return self.metrics("round")

    def wait_training(self, learners: int, timeout: float = 180) -> float:
        """Unix time of the first sample in which `learners` learners have trained (step > 0)."""

        def started() -> float | None:
            for s in self.samples():
                steps = [row.get("step", 0) for row in s.get("learners", {}).values()]
                if sum(1 for n in steps if n and n > 0) >= learners:
                    return float(s["t"])
            return None

        return self.wait_for(started, timeout, f"{learners} learners training")

    # -- faults ------------------------------------------------------------------------------
    def run_kills(
        self, schedule: list[float], learners: int, seed: int, origin: float, stop: threading.Event
    ) -> list[dict[str, Any]]:
        """Kill a seeded random learner at each time of `schedule` (seconds after `origin`).

        The targets are drawn like `bench.ddp_baseline.run_ddp` draws ranks (`random.Random(seed)`,
        one draw before the first kill and one after each), so the same seed hits the same indices.
        A kill refused because its target is not running (still restarting) is retried every
        0.5 s, as run_ddp retries a rank that is not up. Returns what was done:
        [{"t", "time", "target", "scheduled_t"}]; gives up when `stop` is set.
        """
        rng = random.Random(seed)
        target = rng.randrange(learners)
        done: list[dict[str, Any]] = []
        for at in sorted(schedule):
            if stop.wait(max(0.0, origin + at - time.time())):
                return done
            while not stop.is_set():
                if self.kill(f"learner-{target}"):
                    now = time.time()
                    done.append({"t": now - origin, "time": now, "target": f"learner-{target}", "scheduled_t": at})
                    target = rng.randrange(learners)
                    break
                stop.wait(0.5)
        return done

    def monkey(
        self, mtbf: float, duration: float, seed: int, actions: str, stop: threading.Event, fault_duration: float = 10.0
    ) -> dict[str, Any]:
        """`dldctl chaos monkey ... --force` until it ends or `stop` is set (then SIGTERM: it heals its
        faults and exits; not SIGINT, which a shell's background job ignores: the monkey ran on, and
        the fleet trained on past its budget while this waited for it)."""
        log = self.home / f"monkey-{seed}.log"
        args = ["chaos", "monkey", "--mtbf", str(mtbf), "--duration", str(duration), "--seed", str(seed)]
        args += ["--actions", actions, "--fault-duration", str(fault_duration), "--force"]
        with open(log, "w") as fh:
            proc = self.popen(*args, stdout=fh, stderr=subprocess.STDOUT)
            interrupted_at, hung = _stop_monkey(proc, stop)
        text = log.read_text(errors="replace")
        return {
            "returncode": proc.returncode,
            "injected": _injected(text),
            "log": text[-4000:],
            "sigterm_ignored": hung,
            "exit_after_sigterm_s": None if interrupted_at is None or hung else time.monotonic() - interrupted_at,
        }


def _stop_monkey(proc: subprocess.Popen[Any], stop: threading.Event) -> tuple[float | None, bool]:
    """Wait for the monkey to end, or SIGTERM it once `stop` is set (SIGKILL if it ignores that for
    30 s); (when it was interrupted, whether it ignored the SIGTERM)."""
    interrupted_at = None
    try:
        while proc.poll() is None and not stop.wait(0.5):
            pass
        if proc.poll() is None:
            interrupted_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass  # reported as `sigterm_ignored`
    finally:
        hung = proc.poll() is None
        if hung:
            proc.kill()
            proc.wait()
    return interrupted_at, hung


def _injected(text: str) -> int:
    """Faults the monkey reports as injected (its `monkey done: N of M faults injected` line)."""
    for line in text.splitlines():
        if line.startswith("monkey done:"):
            return int(line.split()[2])
    return sum(1 for line in text.splitlines() if line.startswith("t+") and "skipped" not in line)


# --------------------------------------------------------------------------- one run (numbers: bench/fleet_summary.py)


@dataclass
class Plan:
    """One DiLoCo fleet run: what to start, when to stop, and what to break meanwhile.

    The run ends at the first of: every learner finished its `steps` budget; `budget_tokens`
    trained in all (read from the syncer's samples, so it may overshoot by one 2 s sample);
    `duration_s` after the whole fleet started training. `chaos(fleet, start, stop)` runs in a
    thread from the training start and must return soon after `stop` is set.
    """

    name: str
    run: dict[str, Any]
    hosts: list[dict[str, Any]] | None
    learners: int
    budget_tokens: int | None = None
    duration_s: float | None = None
    chaos: Callable[[BenchRun, float, threading.Event], Any] | None = None
    timeout_s: float = 900.0
    eval_settings: dict[str, Any] | None = None  # default: `run`
    inspect: Callable[[BenchRun], Any] | None = None  # called after down, before the home is deleted
    home_tmpfs_mb: int | None = None  # the dldctl home on a tmpfs of this size (disk-full faults)
    syncer: dict[str, Any] | None = None  # the inventory's [syncer] table (e.g. shards)
    tables: dict[str, dict[str, Any]] | None = None  # further tables: [ssh], [model]


def _ended(fleet: BenchRun, plan: Plan, start: float) -> bool:
    if plan.duration_s is not None and time.time() >= start + plan.duration_s:
        return True
    if plan.run.get("steps") and finished_learners(fleet, plan.learners) >= plan.learners:
        return True
    if plan.budget_tokens is not None:
        samples = fleet.samples()
        return bool(samples) and budget_reached(samples, plan.budget_tokens)
    return False


def run_diloco(plan: Plan) -> dict[str, Any]:
    """Run `plan` on a fresh fleet (always cleaned up) and summarise it; see `summarize_run`."""
    from bench import evaluate

    with BenchRun(plan.name, keep=bool(os.environ.get("DLD_BENCH_KEEP")), tmpfs_mb=plan.home_tmpfs_mb) as fleet:
        fleet.up(plan.run, plan.hosts, syncer=plan.syncer, tables=plan.tables)
        start = fleet.wait_training(plan.learners)
        stop = threading.Event()
        box: list[Any] = []  # what the chaos thread returned (or the error it raised)
        worker = None
        if plan.chaos is not None:
            worker = threading.Thread(target=_run_chaos, args=(plan.chaos, fleet, start, stop, box), daemon=True)
            worker.start()
        fleet.wait_for(lambda: _ended(fleet, plan, start), plan.timeout_s, f"{plan.name} to end", every=0.5)
        end = time.time()
        stop.set()
        if worker is not None:
            worker.join(timeout=120)
        summary = fleet.down()
        out = summarize_run(fleet, plan, summary, start, end)
        out["eval_loss"] = evaluate.eval_file(summary["final_model"], plan.eval_settings or plan.run)
        out["chaos"] = (
            box[0]
            if box
            else None
            if worker is None
            else {"error": "the chaos thread had not returned 120 s after the run ended"}
        )
        out["inspect"] = plan.inspect(fleet) if plan.inspect else None
        out["leftovers"] = fleet.leftovers()
        return out


def _run_chaos(chaos: Any, fleet: BenchRun, start: float, stop: threading.Event, box: list[Any]) -> None:
    """The plan's chaos function; what it returns, or the error it raised, goes into `box`."""
    try:
        box.append(chaos(fleet, start, stop))
    except Exception as exc:
        box.append({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]})
