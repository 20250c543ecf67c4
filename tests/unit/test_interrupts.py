"""Interrupts (Ctrl-C, SIGTERM) of the foreground commands, with real signals to this process: an
interrupt during a fault's injection waits for it, so the interrupted monkey heals that fault too
(CI once saw a 10-minute pause outlive its monkey: interrupted between recording and noting it)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from rich.console import Console

from dldctl.chaos import runner
from dldctl.chaos.plan import Fault
from dldctl.chaos.records import Injection
from dldctl.interrupts import interruptible


def test_outside_an_atomic_block_sigterm_interrupts_at_once() -> None:
    with pytest.raises(KeyboardInterrupt), interruptible():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def test_an_atomic_block_finishes_before_the_interrupt() -> None:
    done = []
    with pytest.raises(KeyboardInterrupt), interruptible() as interrupts:
        with interrupts.atomic():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("recorded")
            done.append("applied")
        done.append("after the block")  # never: the interrupt is raised as the block ends
    assert done == ["recorded", "applied"]


def test_a_second_signal_interrupts_a_hung_block() -> None:
    with pytest.raises(KeyboardInterrupt), interruptible() as interrupts, interrupts.atomic():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # an SSH host gone quiet


def test_an_ignored_sigint_stays_ignored() -> None:
    """A shell starts background jobs with SIGINT ignored; the command must not start taking it."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interruptible():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


class _Run:
    name = "r"


class _Chaos:
    """Stands in for dldctl.chaos.inject.Chaos (the real one is interrupted for real in
    tests/e2e/test_cli_local.py): records each fault, and is interrupted in the middle of the
    second one, as Ctrl-C or `kill` would."""

    def __init__(self) -> None:
        self.run = _Run()
        self.recorded: list[str] = []

    def guard(self, *args: Any, **kwargs: Any) -> None:
        pass

    def fault(self, action: str, target: str, duration: float, factor: float) -> Injection:
        self.recorded.append(f"{action} {target}")
        if len(self.recorded) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        t = time.time()
        return Injection(action, target, "h", 1, t, duration, t + duration, "SIGSTOP", None, None, "id")

    def heal(self, own: bool = False) -> list[str]:
        return list(self.recorded)


def test_an_interrupted_monkey_heals_the_fault_it_was_injecting() -> None:
    chaos = _Chaos()
    schedule = [Fault(0.0, "pause", "learner-3", 600.0), Fault(0.0, "pause", "learner-2", 600.0)]
    schedule += [Fault(0.0, "pause", "learner-1", 600.0)]
    console = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    outcome = runner.monkey(chaos, schedule, console, force=True, sleep=lambda s: None)  # type: ignore[arg-type]
    assert outcome.injected == 2  # the second is done, counted and reported before the interrupt
    assert outcome.healed == ["pause learner-3", "pause learner-2"]
