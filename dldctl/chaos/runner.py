"""The foreground loops: the chaos monkey and experiment runs (sleep, inject, sample, judge).

Both print each fault as it happens, and hand `emit` its JSON line (records.py) for `--json`.
Interrupting either (Ctrl-C, or SIGTERM from `kill`,
`timeout` or a service manager: the way to stop one started in the background, where a shell
leaves SIGINT ignored) heals the faults it started (the supervisor would undo them at their
expiry anyway). An experiment samples `dldctl status --json` snapshots, aborts (and rolls back)
when an abort check fires, and ends with a verdict and a report written to the run directory
(chaos/<name>-<time>.json and .md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from dldctl.chaos import records, verdict
from dldctl.chaos.inject import Chaos
from dldctl.chaos.plan import Experiment, Fault, Result
from dldctl.chaos.records import Injection
from dldctl.errors import DldError
from dldctl.interrupts import interruptible
from dldctl.observe.snapshot import collect
from dldctl.rundir import RunDir
from syncer.common import jsonlread, strictjson
from syncer.common.atomic import atomic_write

Sleep = Callable[[float], None]
Emit = Callable[[dict[str, Any]], None]  # gets each fault's JSON line (records.fault_line)


def drop(record: dict[str, Any]) -> None:
    """The default `emit`: text mode prints, it reports nothing else."""


@dataclass
class MonkeyOutcome:
    """How a monkey ended: faults injected; `healed` (what it undid) only when interrupted."""

    injected: int = 0
    healed: list[str] | None = None


def inject(chaos: Chaos, fault: Fault, *, force: bool) -> Injection:
    """One fault now; the quorum guard refuses (no prompt in a loop) unless forced."""
    chaos.guard(fault.action, fault.target, force, confirm=None)
    if fault.action == "kill":
        return chaos.kill(fault.target, fault.signal, fault.duration or None)
    if fault.action == "link":
        return chaos.link(fault.target, fault.rate, fault.duration)
    if fault.action == "corrupt":
        return chaos.fault(fault.action, fault.target, fault.duration, fault.factor, mode=fault.mode)
    return chaos.fault(fault.action, fault.target, fault.duration, fault.factor)


def monkey(
    chaos: Chaos, schedule: list[Fault], console: Console, *, force: bool, sleep: Sleep = time.sleep, emit: Emit = drop
) -> MonkeyOutcome:
    """Run a schedule; how many faults were injected, and what an interrupt healed."""
    start = time.monotonic()
    outcome = MonkeyOutcome()
    try:
        with interruptible() as interrupts:
            for fault in schedule:
                sleep(max(0.0, start + fault.at - time.monotonic()))
                with interrupts.atomic():  # recorded, applied and reported, or none: so healed if interrupted
                    _monkey_one(chaos, fault, console, emit, outcome, force)
    except KeyboardInterrupt:
        outcome.healed = chaos.heal(own=True)
        console.print(f"monkey interrupted; healed its faults: {', '.join(outcome.healed) or 'nothing'}")
    return outcome


def _monkey_one(chaos: Chaos, fault: Fault, console: Console, emit: Emit, outcome: MonkeyOutcome, force: bool) -> None:
    try:
        done = inject(chaos, fault, force=force)
    except DldError as exc:
        console.print(f"[yellow]{fault.describe()}  skipped: {exc.line()}[/]", highlight=False)
        emit(records.fault_line(chaos.run.name, fault, None, exc.line(), time.time()))
        return
    outcome.injected += 1
    console.print(f"[red]{fault.describe()}[/]  {done.detail}", highlight=False)
    emit(records.fault_line(chaos.run.name, fault, done, None, done.t))


def run_experiment(
    chaos: Chaos, run: RunDir, exp: Experiment, console: Console, sleep: Sleep = time.sleep, emit: Emit = drop
) -> Result:
    """Steady state, faults on time, sampling, abort/rollback, verdict and report (its files in
    `Result.files`)."""
    t0 = time.time()
    samples = [collect(run)]
    injected: list[float | None] = [None] * len(exp.faults)
    aborted = None
    pending = list(enumerate(exp.faults))
    try:
        with interruptible() as interrupts:
            while time.time() - t0 < exp.duration:
                elapsed = time.time() - t0
                while pending and pending[0][1].at <= elapsed:
                    i, fault = pending.pop(0)
                    with interrupts.atomic():
                        aborted = _inject_one(chaos, fault, console, emit) or aborted
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
    events = list(jsonlread.read(run.events, since=t0 - 1))
    result = verdict.evaluate(exp, samples, events, injected, aborted)
    stem = _write(run, exp, result, t0)
    result.files = [str(stem.with_suffix(".json")), str(stem.with_suffix(".md"))]
    return result


def _inject_one(chaos: Chaos, fault: Fault, console: Console, emit: Emit) -> str | None:
    try:
        done = inject(chaos, fault, force=True)
    except DldError as exc:
        console.print(f"[yellow]{fault.describe()}  failed: {exc.line()}[/]", highlight=False)
        emit(records.fault_line(chaos.run.name, fault, None, exc.line(), time.time()))
        return f"could not inject {fault.action} {fault.target}: {exc.line()}"
    console.print(f"[red]{fault.describe()}[/]  {done.detail}", highlight=False)
    emit(records.fault_line(chaos.run.name, fault, done, None, done.t))
    return None


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
