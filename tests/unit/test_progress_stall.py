"""A stopped learner's stall is not compute (learner/progress.py `counted`): goodput must not
count a pause, while a real slow-down is followed."""

from __future__ import annotations

import pytest

from learner.progress import STALL_FACTOR, Progress
from learner.recipe import Steady


def progress() -> Progress:
    return Progress(Steady(warmup_steps=3, started=0.0))


def test_the_first_step_counts_whole_and_a_stall_counts_as_a_few_typical_steps() -> None:
    p = progress()
    assert p.counted(3.0) == 3.0  # no typical step yet (compile, first batch): all of it
    for _ in range(20):
        p.stepped(256, p.counted(0.02), 1, 256)
    assert p.counted(0.03) == pytest.approx(0.03)
    assert p.counted(5.02) == pytest.approx(STALL_FACTOR * p.step_time)  # SIGSTOP for 5 s inside a step
    assert p.counted(5.02) < 0.1


def test_a_real_slow_down_is_followed_within_a_few_steps() -> None:
    p = progress()
    for _ in range(20):
        p.stepped(256, p.counted(0.02), 1, 256)
    counted = []
    for _ in range(40):  # the host becomes 10x slower for good
        counted.append(p.counted(0.2))
        p.stepped(256, counted[-1], 1, 256)
    assert counted[0] < 0.2 and counted[-1] == pytest.approx(0.2)
    assert sum(1 for c in counted if c < 0.2) <= 5
    assert p.busy_s == pytest.approx(20 * 0.02 + sum(counted))
