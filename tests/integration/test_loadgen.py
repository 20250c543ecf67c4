"""bench/loadgen.py end to end, small: a real syncer process and 3 synthetic learners in 2 worker
processes (real DEALER sockets, the run's CURVE keys, the real learner link) on gpt-tiny shapes.
Rounds are merged on the syncer's clock, every learner's pushes come back as replies, and the
window's latencies, rates and the syncer's CPU and memory are measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.loadgen_fleet import LoadConfig, LoadFleet

pytestmark = pytest.mark.timeout(120)


def test_synthetic_learners_drive_a_real_syncer(tmp_path: Path) -> None:
    cfg = LoadConfig(
        shape="gpt-tiny",
        H=8,
        fragments=4,
        step_time=0.05,  # a round every 0.1 s
        procs=2,
        variants=2,
        window_s=4.0,
        settle_s=1.0,
        declared=3,
        tmp=str(tmp_path),
    )
    with LoadFleet(cfg) as fleet:
        fleet.start()
        fleet.resize(3)
        level = fleet.measure(3)
        assert fleet.run.metrics("round"), "the syncer recorded rounds"
    st, syncer, gen = level["stats"], level["syncer"], level["generator"]
    assert st["rounds"] >= 10  # 40 offered in the window; a loaded machine gets fewer
    assert st["contributors_mean"] > 1.5  # the fleet gathers in its rounds
    assert st["replies"] >= st["rounds"]
    assert st["latency"]["n"] > 0 and 0 < st["latency"]["p50"] < 2.0
    assert st["sent_latency"]["n"] > 0 and st["merge_s"]["n"] == st["rounds"]
    assert st["achieved_rate"] > 0 and st["params_per_s"] > 0
    assert syncer["cpu_cores"] > 0 and syncer["rss_mb_max"] > 0 and syncer["hwm_mb"] >= syncer["rss_mb_end"] > 0
    assert gen["cpu_cores"] > 0
    assert gen["links"]["bad_messages"] == 0
    assert not list(tmp_path.iterdir()), "the run directory is removed"
