"""The inner learning-rate schedule shared by learners and the data-parallel baseline."""

from __future__ import annotations

import itertools
import math

import pytest

from learner.schedule import FLOOR, learning_rate
from syncer.common.settings import RunSettings, SettingsError


def test_constant_is_warmup_then_flat() -> None:
    assert learning_rate(0, 1e-3, 10) == pytest.approx(1e-4)
    assert learning_rate(9, 1e-3, 10) == pytest.approx(1e-3)
    assert learning_rate(10_000, 1e-3, 10) == pytest.approx(1e-3)


def test_cosine_decays_from_lr_after_warmup_to_the_floor_at_the_budget() -> None:
    lr, warmup, steps = 2e-3, 10, 110
    assert learning_rate(warmup, lr, warmup, "cosine", steps) == pytest.approx(lr)
    middle = learning_rate(warmup + 50, lr, warmup, "cosine", steps)
    assert middle == pytest.approx(lr * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi / 2))))
    assert learning_rate(steps, lr, warmup, "cosine", steps) == pytest.approx(lr * FLOOR)
    assert learning_rate(10 * steps, lr, warmup, "cosine", steps) == pytest.approx(
        lr * FLOOR
    )  # a restarted learner past it
    rates = [learning_rate(s, lr, warmup, "cosine", steps) for s in range(warmup, steps)]
    assert all(a >= b for a, b in itertools.pairwise(rates))


def test_cosine_without_a_step_budget_is_refused() -> None:
    with pytest.raises(SettingsError, match=r"lr_schedule.*steps"):
        RunSettings(lr_schedule="cosine").validate()
    RunSettings(lr_schedule="cosine", steps=100).validate()
    with pytest.raises(SettingsError, match="lr_schedule"):
        RunSettings(lr_schedule="linear").validate()


def test_a_resumed_learner_warms_up_again_to_the_schedule_not_to_the_peak() -> None:
    lr, warmup, steps, at = 2e-3, 10, 1000, 800
    there = learning_rate(at + warmup, lr, warmup, "cosine", steps)
    assert there < 0.3 * lr  # late in the cosine: near the floor
    assert learning_rate(at, lr, warmup, "cosine", steps, resumed_at=at) == pytest.approx(
        learning_rate(at, lr, warmup, "cosine", steps) / warmup
    )
    assert learning_rate(at + warmup, lr, warmup, "cosine", steps, resumed_at=at) == pytest.approx(there)
    ramp = [learning_rate(s, lr, warmup, "cosine", steps, resumed_at=at) for s in range(at, at + warmup)]
    assert all(a < b for a, b in itertools.pairwise(ramp)) and max(ramp) <= there * 1.01
