"""The pure parts of the shard benchmarks: bench/shard_scaling.py's runs, ratio and reading of
what limited them, and bench/shard_transfer.py's rows and targets (the runs themselves start
syncer processes: tests/integration/test_loadgen.py and test_shard_transfer_bench.py run them
small)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from bench import shard_scaling, shard_transfer
from bench.loadgen_fleet import LoadConfig


def _args(**kw: Any) -> argparse.Namespace:
    base = {
        "model": "gpt2-124m",
        "learners": 2,
        "procs": 1,
        "H": 4,
        "fragments": 4,
        "step_time": 0.05,
        "window_s": None,
        "settle_s": 35.0,
        "shards": "1,2",
        "repeat": 2,
        "decode": "none",
        "set": "",
        "curve": False,
        "ceiling_s": 0.0,
        "syncer_threads": 1,
        "tmp": None,
        "keep": False,
        "quick": True,
    }
    return argparse.Namespace(**{**base, **kw})


def test_the_scaling_runs_alternate_and_keep_checkpoints_off_unless_set() -> None:
    runs = shard_scaling.configs(_args())
    assert [c.shards for c in runs] == [1, 2, 1, 2]
    assert all(c.overrides["checkpoint_s"] == 0 and c.overrides["insecure"] is True for c in runs)
    assert runs[0].window_s == 30.0 and runs[0].schedule.offered_rate == 20.0
    assert runs[0].overrides["max_backlog"] == 0 and runs[0].settle_s == 35.0
    curve = shard_scaling.configs(_args(set="checkpoint_s=30", repeat=1, curve=True))
    assert curve[0].overrides["checkpoint_s"] == 30.0 and curve[0].overrides["insecure"] is False


def _level(
    shards: int, mparams: float, rate: float, loops: list[float], gen: float = 0.1, others: float = 0.0
) -> dict[str, Any]:
    parts = [
        {
            "stats": {"params_per_s": mparams * 1e6 / shards},
            "syncer": {"cpu_cores": loop + 0.1, "threads": {"loop": loop}},
        }
        for loop in loops
    ]
    level: dict[str, Any] = {
        "shard_count": shards,
        "stats": {"params_per_s": mparams * 1e6, "achieved_rate": rate},
        "syncer": parts[0]["syncer"],
        "generator": {"cpu_cores": gen, "lag": {"p99": 0.01}},
        "machine": {"busy_cores": sum(loops) + 0.1 * len(loops) + gen + others, "others_cores": others},
    }
    if shards > 1:
        level["shards"] = parts
    return level


def test_the_scaling_ratio_is_of_medians_and_saturation_is_judged_against_the_offer() -> None:
    cfg = LoadConfig(H=4, fragments=4, step_time=0.05)  # 20 rounds/s offered
    levels = [_level(1, 100, 3.0, [0.95]), _level(2, 170, 5.0, [0.9, 0.9]), _level(1, 110, 3.2, [0.96])]
    v = shard_scaling.verdict(levels, cfg)
    assert v["ratio"] == pytest.approx(170 / 105) and not v["met"]
    per_core_1 = (100 / 0.95 + 110 / 0.96) / 2
    assert v["per_loop_core_ratio"] == pytest.approx((170 / 1.8) / per_core_1)
    assert v["saturated_1"] and v["saturated_2"]
    assert not shard_scaling.verdict([_level(1, 100, 19.5, [0.5])], cfg)["saturated_1"]  # kept up: not saturated
    assert shard_scaling.verdict([_level(1, 100, 3.0, [0.9]), _level(2, 190, 6.0, [0.9, 0.9])], cfg)["met"]


def test_the_limits_name_a_busy_loop_and_a_full_machine() -> None:
    notes = shard_scaling.limits(
        [_level(1, 100, 3.0, [0.95]), _level(2, 150, 5.0, [0.6, 0.6], gen=0.5), _level(1, 90, 3.0, [0.7], others=0.5)]
    )
    assert "loop is CPU-bound (0.95 cores)" in notes[0]
    assert notes[1].startswith("2 shard(s): ") and "cores are used up" in notes[1]
    assert "other processes took 0.50 cores" in notes[2]


def _series(count: int, total: float, shard_s: list[float], tcp_s: list[float]) -> shard_transfer.Series:
    per = [int(400e6 / count)] * count
    fetch = shard_transfer.Fetch(per_shard=shard_s, total=total, shard_cpu=[0.2] * count, learner_cpu=0.4)
    return shard_transfer.Series(count, per, [fetch, fetch], [tcp_s[0]] * 2, [tcp_s, tcp_s])


def test_a_transfer_row_compares_each_shard_with_a_raw_stream_of_the_same_concurrency() -> None:
    row = shard_transfer.row(_series(2, 0.5, [0.4, 0.5], [0.1, 0.125]))
    assert row["MB"] == 400.0 and row["aggregate MB/s"] == pytest.approx(800.0)
    assert row["per shard MB/s"] == "500 / 400"
    assert row["tcp S streams MB/s"] == pytest.approx(3200.0)  # 400 MB when the slower stream is done
    assert row["per shard vs tcp stream"] == pytest.approx(0.25)  # both shards at 1/4 of their streams
    assert row["aggregate vs tcp S streams"] == pytest.approx(0.25)
    assert row["shard cores"] == pytest.approx(0.8) and row["learner cores"] == pytest.approx(0.8)


def test_the_transfer_targets_are_judged_on_the_sharded_rows() -> None:
    one = {"shards": 1, "per shard vs tcp stream": 0.1, "aggregate MB/s": 2000.0}
    two = {"shards": 2, "per shard vs tcp stream": 0.35, "aggregate MB/s": 900.0}
    four = {"shards": 4, "per shard vs tcp stream": 0.31, "aggregate MB/s": 1100.0}
    v = shard_transfer.verdict([one, two, four])
    assert v["worst_shard_vs_tcp"] == 0.31 and v["vs_tcp_met"]
    assert v["best_aggregate_shards"] == 4 and v["aggregate_met"]
    assert shard_transfer.verdict([one]) == {}
