"""A harness for the fleet benchmarks: the real `dldctl` CLI on a local fleet, in a throw-away home.

`BenchRun` runs `dldctl` as a subprocess with its own `DLDCTL_HOME` (a temp dir), writes an
inventory of local hosts (`address = "local"`), brings the run up (`up -d`), injects faults
(`chaos kill`, `chaos monkey`), stops it with `dldctl down --json`, and always cleans up:
`close()` runs `dldctl down` if the run may still be up, then SIGKILLs every process recorded in
the run's `procs.jsonl` that is still alive *and* still has the recorded start time (pid reuse is
checked, nothing is ever killed by name), then deletes the home (kept, and its path printed,
when the environment sets `DLD_BENCH_KEEP=1`: for a post-mortem of a run's records and logs).

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

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
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
from dldctl.hosts.local import read_stat
from syncer.common import jsonl

DLDCTL = str(Path(sys.executable).parent / "dldctl")


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

# Outer optimizer per H, chosen because they are stable on this workload (see docs/tuning.md): the
# default Nesterov (0.7, 0.9) diverged here at H <= 32, plain averaging (1.0, 0.0) did not.
OUTER: dict[int, tuple[float, float]] = {}
DEFAULT_OUTER = (1.0, 0.0)


class OuterOptimizer(TypedDict):
    """An outer optimizer as `[run]` keys, to pass on as `diloco_run(H, **outer)` (typed, so that
    mypy knows these floats go to `**extra`, not to `compression` or `quorum`)."""

    outer_lr: float
    outer_momentum: float


def diloco_run(
    H: int = 32, *, compression: str = "int4", quorum: int = 1, overlap: bool = True, steps: int = 0, **extra: Any
) -> dict[str, Any]:
    """The `[run]` table of a benchmark fleet: WORKLOAD plus the DiLoCo settings.

    4 fragments, the outer optimizer of `OUTER` for this H, a 0.5 s restart delay (the default
    is 2 s: the failure benchmarks measure the algorithm, not a conservative supervisor), and
    `extra` on top.
    """
    lr, momentum = OUTER.get(H, DEFAULT_OUTER)
    run = {
        **WORKLOAD,
        "H": H,
        "fragments": 4,
        "quorum": quorum,
        "overlap": overlap,
        "compression": compression,
        "outer_lr": lr,
        "outer_momentum": momentum,
        "restart_delay_s": 0.5,
        "steps": steps,
    }
    run.update(extra)
    return run


# --------------------------------------------------------------------------- inventory


def toml_value(value: Any) -> str:
    """One TOML value (str, bool, int, float, or a flat dict as an inline table)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))


def inventory_text(run: dict[str, Any], hosts: list[dict[str, Any]]) -> str:
    """An inventory: the `[run]` table and one `[[hosts]]` table per host."""
    lines = ["[run]"] + [f"{k} = {toml_value(v)}" for k, v in run.items()]
    for host in hosts:
        lines += ["", "[[hosts]]"] + [f"{k} = {toml_value(v)}" for k, v in host.items()]
    return "\n".join(lines) + "\n"


def local_host(name: str, learners: int, **extra: Any) -> dict[str, Any]:
    """A `[[hosts]]` entry on this machine: one torch thread per learner unless `extra` says otherwise."""
    return {"name": name, "address": "local", "learners": learners, "threads": 1, **extra}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON record of a file (a torn last line is skipped); [] if it is missing."""
    return list(jsonl.read(path))


# --------------------------------------------------------------------------- the fleet


class BenchRun:
    """One `dldctl` home with (at most) one run in it."""

    def __init__(self, name: str = "bench", keep: bool = False, tmpfs_mb: int | None = None) -> None:
        self.name = name
        self.keep = keep
        self.home = Path(tempfile.mkdtemp(prefix=f"dld-{name}-"))
        self.tmpfs = (
            bool(tmpfs_mb)
            and subprocess.run(  # a home on its own small file system, to fill up
                ["mount", "-t", "tmpfs", "-o", f"size={tmpfs_mb}m", "tmpfs", str(self.home)], capture_output=True
            ).returncode
            == 0
        )
        self.env = dict(os.environ, DLDCTL_HOME=str(self.home), COLUMNS="160", PYTHONUNBUFFERED="1")
        self.run_dir: Path | None = None
        self.is_up = False
        self.summary: dict[str, Any] | None = None

    def __enter__(self) -> BenchRun:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def dl(self, *args: str, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
        """Run `dldctl ARGS` in this home; raise with the output tail if it fails and `check`."""
        proc = subprocess.run(
            [DLDCTL, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"dldctl {' '.join(args)} exited {proc.returncode}: {proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
        return proc

    def up(self, run: dict[str, Any], hosts: list[dict[str, Any]] | None, timeout: float = 240) -> Path:
        """`dldctl up INVENTORY -d` (or the built-in default when `hosts` is None); the run dir."""
        args = ["up", "-d", "--timeout", str(timeout)]
        if hosts is not None:
            inv = self.home / "inventory.toml"
            inv.write_text(inventory_text({"name": self.name, **run}, hosts))
            args.insert(1, str(inv))
        self.is_up = True
        self.dl(*args, timeout=timeout + 60)
        runs = sorted((self.home / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
        self.run_dir = runs[-1]
        return self.run_dir

    def status(self) -> dict[str, Any]:
        return json.loads(self.dl("status", "--json", timeout=60).stdout)

    def config(self) -> dict[str, Any]:
        assert self.run_dir is not None
        return json.loads((self.run_dir / "config.json").read_text())

    # -- what the run wrote ------------------------------------------------------------------
    def samples(self) -> list[dict[str, Any]]:
        return [r for r in self._records("metrics.jsonl") if r.get("kind") == "sample"]

    def rounds(self) -> list[dict[str, Any]]:
        return [r for r in self._records("metrics.jsonl") if r.get("kind") == "round"]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self._records("events.jsonl") if kind is None or e.get("kind") == kind]

    def _records(self, name: str) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / name) if self.run_dir else []

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
        """Poll `predicate` (no dldctl call unless it makes one) until it returns something truthy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(every)
        raise TimeoutError(f"{self.name}: timed out after {timeout:g} s waiting for {what}")

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
    def kill(self, target: str, sig: str = "KILL") -> bool:
        """`dldctl chaos kill TARGET --signal SIG --force`; False if it was refused (not running)."""
        return self.dl("chaos", "kill", target, "--signal", sig, "--force", check=False, timeout=60).returncode == 0

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
        cmd = [
            DLDCTL,
            "chaos",
            "monkey",
            "--mtbf",
            str(mtbf),
            "--duration",
            str(duration),
            "--seed",
            str(seed),
            "--actions",
            actions,
            "--fault-duration",
            str(fault_duration),
            "--force",
        ]
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                cmd, env=self.env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, stdin=subprocess.DEVNULL
            )
            interrupted_at = None
            try:
                while proc.poll() is None and not stop.wait(0.5):
                    pass
                if proc.poll() is None:
                    interrupted_at = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass  # reported below as `sigterm_ignored`
            finally:
                hung = proc.poll() is None
                if hung:
                    proc.kill()
                    proc.wait()
        text = log.read_text(errors="replace")
        return {
            "returncode": proc.returncode,
            "injected": _injected(text),
            "log": text[-4000:],
            "sigterm_ignored": hung,
            "exit_after_sigterm_s": None if interrupted_at is None or hung else time.monotonic() - interrupted_at,
        }

    # -- the end -----------------------------------------------------------------------------
    def down(self) -> dict[str, Any]:
        """`dldctl down --json`; the summary (with `final_model` the path of final_model.pt)."""
        proc = self.dl("down", "--json", timeout=180)
        self.is_up = False
        self.summary = json.loads(proc.stdout)
        return self.summary

    def leftovers(self) -> list[dict[str, Any]]:
        """Processes recorded in procs.jsonl that are still alive with the same start time."""
        alive = []
        for procs in (self.home / "runs").glob("*/procs.jsonl"):
            for rec in read_jsonl(procs):
                stat = read_stat(int(rec["pid"]))
                if stat is not None and stat.start_ticks == rec["start_ticks"] and stat.state not in "ZX":
                    alive.append(rec)
        return alive

    def close(self) -> list[dict[str, Any]]:
        """Stop everything this home started; returns what had to be SIGKILLed after `down`."""
        if self.is_up and (self.home / "runs").is_dir():
            try:
                self.dl("down", timeout=180, check=False)
            except subprocess.TimeoutExpired:
                pass
            self.is_up = False
        killed = self.leftovers()
        for rec in killed:
            stat = read_stat(int(rec["pid"]))
            if stat is not None and stat.start_ticks == rec["start_ticks"]:
                try:
                    os.kill(int(rec["pid"]), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if self.tmpfs and subprocess.run(["umount", str(self.home)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(self.home)], capture_output=True)
        if not self.keep:
            shutil.rmtree(self.home, ignore_errors=True)
        else:
            print(f"{self.name}: home kept at {self.home}", file=sys.stderr)
        return killed


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
        fleet.up(plan.run, plan.hosts)
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
