"""bench/loadgen.py end to end, small: a real syncer process and 3 synthetic learners in 2 worker
processes (real DEALER sockets, the run's CURVE keys, the real learner link) on gpt-tiny shapes.
Rounds are merged on the syncer's clock, every learner's pushes come back as replies, and the
window's latencies, rates and the syncer's CPU and memory are measured. Then the same against two
real shard processes of one run: every learner links to both, and both merge its pushes."""

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


def test_synthetic_learners_drive_two_real_shards(tmp_path: Path) -> None:
    cfg = LoadConfig(
        shape="gpt-tiny",
        H=8,
        fragments=4,
        step_time=0.05,
        procs=1,
        decode="none",
        variants=1,
        window_s=4.0,
        settle_s=1.0,
        declared=2,
        tmp=str(tmp_path),
        shards=2,
    )
    with LoadFleet(cfg) as fleet:
        fleet.start()
        assert sorted(p for owned in fleet.owned for p in owned) == [0, 1, 2, 3] and all(fleet.owned)
        fleet.resize(2)
        level = fleet.measure(2)
        for s, syncer in enumerate(fleet.syncers):
            assert syncer.status()["syncer"]["owned"] == list(fleet.owned[s]), "the shard owns what the map says"
    parts = level["shards"]
    assert [p["shard"] for p in parts] == [0, 1]
    for part in parts:
        st = part["stats"]
        assert st["rounds"] >= 3 and st["replies"] >= st["rounds"], part  # both shards merge and reply
        assert part["syncer"]["cpu_cores"] > 0 and part["syncer"]["rss_mb_max"] > 0
    replied = {(r.shard, r.fragment) for r in fleet.replies}
    assert {s for s, _ in replied} == {0, 1}
    assert all(p in fleet.owned[s] for s, p in replied), "each shard replies for its own fragments (global numbers)"
    total = level["stats"]
    assert total["rounds"] == sum(p["stats"]["rounds"] for p in parts)
    assert total["params_per_s"] == pytest.approx(sum(p["stats"]["params_per_s"] for p in parts))
    assert level["syncer"]["cpu_cores"] == pytest.approx(sum(p["syncer"]["cpu_cores"] for p in parts))
    assert level["generator"]["links"]["bad_messages"] == 0


def test_a_syncer_that_dies_stops_the_search_at_once_and_keeps_what_was_measured(tmp_path: Path) -> None:
    """A shard killed under the generator (the OOM killer, in a 774M search) used to leave the
    search waiting for joins that could never come, for up to an hour; now the next report
    from the workers names the shard and how it ended, and the search returns what it has."""
    import os
    import signal
    import time

    from bench import loadgen
    from bench.common import parse_args
    from bench.loadgen_core import StopRule
    from bench.loadgen_syncer import SyncerDied

    cfg = LoadConfig(
        shape="gpt-tiny", H=8, fragments=4, step_time=0.05, procs=1, variants=1, window_s=2.0,
        settle_s=0.5, declared=4, tmp=str(tmp_path),
    )  # fmt: skip
    args = parse_args("loadgen", "", loadgen._extra, ["--search", "--start-learners", "2", "--max-learners", "4"])
    with LoadFleet(cfg) as fleet:
        fleet.start()
        fleet.resize(2)
        os.kill(fleet.syncer_pid, signal.SIGKILL)  # the process this test's fleet started
        t0 = time.monotonic()
        with pytest.raises(SyncerDied, match=r"syncer \(pid \d+\) was killed by SIGKILL .*OOM"):
            fleet.resize(3)
        levels, best, stopped = loadgen.search(fleet, StopRule(10.0, 0.5, 0.05), args)
        assert time.monotonic() - t0 < 20, "noticed at the next report, not at the join deadline"
    assert levels == [] and best == 0
    assert stopped is not None and stopped["learners"] == 2 and "SIGKILL" in stopped["error"]
    assert not list(tmp_path.iterdir()), "the run directory is removed"
