"""bench/capacity_model.py: the syncer's capacity formulas (pure)."""

from __future__ import annotations

import math

import pytest

from bench import capacity_model as cm

COSTS = cm.Costs(round_ns=2.0, push_ns=0.5, push_B=0.5, state_B=13.0, base_B=250e6, crypto_MBps=400.0)


def test_the_loads_follow_from_the_fleet() -> None:
    f = cm.Fleet(learners=8, H=64, step_s=1.0)
    n = 1e9
    assert f.period_s == 64.0
    assert cm.merge_cores(COSTS, f, n) == pytest.approx(1e9 * (2.0 + 4.0) * 1e-9 / 64)
    assert cm.wire_MBps(COSTS, f, n) == pytest.approx(8 * 1e9 * 0.5 / 64 / 1e6)
    assert cm.crypto_cores(COSTS, f, n) == pytest.approx(2 * 62.5 / 400)
    assert cm.memory_B(COSTS, f, n) == pytest.approx(250e6 + 1e9 * (13 + 4))
    assert cm.memory_B(COSTS, f, n, checkpointing=True) == pytest.approx(250e6 + 1e9 * (13 + 4 + 12))


def test_the_largest_fleet_is_where_the_first_limit_binds() -> None:
    n, H, step = 124e6, 64, 1.0
    m = cm.max_learners(COSTS, H, step, n, loop_share=0.5, io_cores=1.0)
    f = cm.Fleet(m, H, step)
    assert cm.merge_cores(COSTS, f, n) <= 0.5 and cm.crypto_cores(COSTS, f, n) <= 1.0
    g = cm.Fleet(m + 1, H, step)
    assert cm.merge_cores(COSTS, g, n) > 0.5 or cm.crypto_cores(COSTS, g, n) > 1.0
    # a slower step or a longer H lets more learners in; a bigger model fewer
    assert cm.max_learners(COSTS, H, 2 * step, n, 0.5, 1.0) > m
    assert cm.max_learners(COSTS, H, step, 4 * n, 0.5, 1.0) < m
    assert cm.max_learners(COSTS, H, step, 1e15, 0.5, 1.0) == 0  # nothing fits: never negative


def test_shards_take_the_tightest_of_memory_merge_and_crypto() -> None:
    f = cm.Fleet(8, 64, 1.0)
    need = cm.shards(COSTS, f, 70e9, ram_B=128e9, loop_share=0.5, io_cores=1.0)
    assert need["by_memory"] == math.ceil(70e9 * (13 + 4 + 12) / (128e9 - 250e6))
    assert need["shards"] == max(need["by_memory"], need["by_merge"], need["by_crypto"])
    assert cm.shards(COSTS, f, 1e6, 128e9, 0.5, 1.0)["shards"] == 1
    fast = cm.shards(COSTS, cm.Fleet(8, 64, 0.01), 70e9, 128e9, 0.5, 1.0)
    assert fast["by_merge"] > need["by_merge"] and fast["shards"] >= need["shards"]


def test_fit_line() -> None:
    a, b = cm.fit_line([1.0, 2.0, 4.0, 8.0], [3.0, 5.0, 9.0, 17.0])
    assert (a, b) == (pytest.approx(1.0), pytest.approx(2.0))
    with pytest.raises(ValueError, match="two distinct"):
        cm.fit_line([4.0, 4.0], [1.0, 2.0])
