"""The foreground loops: the chaos monkey and experiment runs (sleep, inject, sample, judge).

Both print each fault as it happens. Interrupting either (Ctrl-C, or SIGTERM from `kill`,
`timeout` or a service manager: the way to stop one started in the background, where a shell
leaves SIGINT ignored) heals the faults it started (the supervisor would undo them at their
expiry anyway). An experiment samples `dldctl status --json` snapshots, aborts (and rolls back)
when an abort check fires, and ends with a verdict and a report written to the run directory
(chaos/<name>-<time>.json and .md).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from dldctl.chaos import verdict
from dldctl.chaos.inject import Chaos
from dldctl.chaos.plan import Experiment, Fault, Result
from dldctl.errors import DldError
from dldctl.observe.snapshot import collect
from dldctl.rundir import RunDir
from syncer.common import jsonl, strictjson
from syncer.common.atomic import atomic_write

Sleep = Callable[[float], None]


def inject(chaos: Chaos, fault: Fault, *, force: bool) -> str:
    """One fault now; the quorum guard refuses (no prompt in a loop) unless forced."""
    chaos.guard(fault.action, fault.target, force, confirm=None)
    if fault.action == "kill":
        return chaos.kill(fault.target, fault.signal, fault.duration or None)
    return chaos.fault(fault.action, fault.target, fault.duration, fault.factor)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside, SIGTERM raises KeyboardInterrupt as Ctrl-C does (main thread only; restored after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def monkey(chaos: Chaos, schedule: list[Fault], console: Console, *, force: bool, sleep: Sleep = time.sleep) -> int:
    """Run a schedule; returns how many faults were injected."""
    start = time.monotonic()
    injected = 0
    try:
        with sigterm_interrupts():
            for fault in schedule:
                sleep(max(0.0, start + fault.at - time.monotonic()))
                try:
                    detail = inject(chaos, fault, force=force)
                    injected += 1
                    console.print(f"[red]{fault.describe()}[/]  {detail}", highlight=False)
                except DldError as exc:
                    console.print(f"[yellow]{fault.describe()}  skipped: {exc.line()}[/]", highlight=False)
    except KeyboardInterrupt:
        healed = chaos.heal(own=True)
        console.print(f"monkey interrupted; healed its faults: {', '.join(healed) or 'nothing'}")
    return injected


def run_experiment(chaos: Chaos, run: RunDir, exp: Experiment, console: Console, sleep: Sleep = time.sleep) -> Result:
    """Steady state, faults on time, sampling, abort/rollback, verdict and report."""
    t0 = time.time()
    samples = [collect(run)]
    injected: list[float | None] = [None] * len(exp.faults)
    aborted = None
    pending = list(enumerate(exp.faults))
    try:
        with sigterm_interrupts():
            while time.time() - t0 < exp.duration:
                elapsed = time.time() - t0
                while pending and pending[0][1].at <= elapsed:
                    i, fault = pending.pop(0)
                    aborted = _inject_one(chaos, fault, console) or aborted
                    injected[i] = time.time()
                sleep(exp.sample_every)
                samples.append(collect(run))
                fired = [c.text for c in exp.aborts if c.holds(samples[-1], samples[0])]
                if fired or aborted:
                    aborted = aborted or f"abort condition {fired[0]}"
                    break
    except KeyboardInterrupt:
        aborted = "interrupted"
    if aborted and exp.heal_on_abort:
        console.print(f"[yellow]rolling back ({aborted}): healed {', '.join(chaos.heal(own=True)) or 'nothing'}[/]")
    events = list(jsonl.read(run.events, since=t0 - 1))
    result = verdict.evaluate(exp, samples, events, injected, aborted)
    _write(run, exp, result, t0)
    return result


def _inject_one(chaos: Chaos, fault: Fault, console: Console) -> str | None:
    try:
        detail = inject(chaos, fault, force=True)
        console.print(f"[red]{fault.describe()}[/]  {detail}", highlight=False)
        return None
    except DldError as exc:
        console.print(f"[yellow]{fault.describe()}  failed: {exc.line()}[/]", highlight=False)
        return f"could not inject {fault.action} {fault.target}: {exc.line()}"


def _write(run: RunDir, exp: Experiment, result: Result, t0: float) -> Path:
    out = run.path / "chaos"
    out.mkdir(exist_ok=True)
    stem = out / f"{exp.name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(t0))}"
    payload = {
        "experiment": exp.name,
        "file": exp.path,
        "passed": result.passed,
        "reasons": result.reasons,
        "aborted": result.aborted,
        "faults": [f.to_dict() for f in result.faults],
    }
    atomic_write(stem.with_suffix(".json"), strictjson.dumps(payload, indent=1))
    atomic_write(stem.with_suffix(".md"), verdict.markdown(exp, result))
    return stem
