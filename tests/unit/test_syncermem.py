"""syncer/common/memfit.py and dldctl/syncermem.py: a syncer shard's memory against its host's
(pure), the measurements its constants come from, and hostmem.py's answer on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dldctl import syncermem as sm
from syncer.common import hostmem
from syncer.common import memfit as mf
from syncer.wire import shards
from tests.unit.coreharness import Harness, make_settings, sent_of, tensor_manifest

ROOT = Path(__file__).resolve().parents[2]
MEMINFO = "MemTotal:       24683792 kB\nMemFree:         1000000 kB\nMemAvailable:   24160648 kB\n"


def test_the_constants_are_the_measured_ones() -> None:
    costs = json.loads((ROOT / "bench/results/capacity.json").read_text())["costs"]
    assert pytest.approx(costs["state_B"], rel=0.01) == mf.STATE_B
    assert pytest.approx(costs["base_B"], rel=0.05) == mf.BASE_B
    # a pending int4 push as the syncer holds it: packed codes and block scales, more than its zstd wire bytes
    assert mf.push_bytes("int4", 128) == pytest.approx(0.5 + 4 / 128) and mf.push_bytes("int4", 128) > costs["push_B"]
    assert mf.push_bytes("int8", 64) == pytest.approx(1 + 4 / 64) and mf.push_bytes("none", 128) == 4.0


def test_the_774m_search_lies_between_the_floor_and_the_full_estimate() -> None:
    """gpt2-774m, 16 learners, one shard: measured 12.4-13.7 GB steady, 15.1 GB peak (BENCHMARKS.md)."""
    floor, full, peak = mf.shard_need(774_090_240, 16, mf.push_bytes("int4", 128))
    assert floor == pytest.approx(9.54e9, rel=0.01) and full == pytest.approx(17.4e9, rel=0.01)
    assert floor < 12.4e9 and full > 13.7e9 and peak == pytest.approx(full + 12 * 774_090_240)


def test_shards_on_one_host_add_up_and_other_hosts_stand_alone() -> None:
    needs = sm.by_host(["local", "cpu-a", "local"], [100, 200, 300], 4, 0.5)
    assert [(n.host, n.shards, n.params) for n in needs] == [("local", (0, 2), 400), ("cpu-a", (1,), 200)]
    local = needs[0]
    assert local.floor == pytest.approx(2 * mf.BASE_B + 400 * 12.0)
    assert local.full == pytest.approx(2 * mf.BASE_B + 400 * (mf.STATE_B + 2.0))
    assert local.peak == pytest.approx(local.full + 400 * mf.CHECKPOINT_B)


def test_free_memory_is_the_smallest_limit_that_is_set() -> None:
    assert mf.meminfo_available(MEMINFO) == 24160648 * 1024
    assert mf.meminfo_available("MemTotal: 5 kB\n") is None
    assert mf.cgroup_room("max\n", "123\n") is None  # v2, no limit
    assert mf.cgroup_room("9223372036854771712\n", "23302144\n") is None  # v1, no limit
    assert mf.cgroup_room("", "") is None  # the root of a v2 tree has no memory.max
    assert mf.cgroup_room("1000000000\n", "300000000\n") == 700_000_000
    assert mf.cgroup_room("1000\n", "5000\n") == 0  # over its limit: nothing left
    # the inactive page cache is reclaimed before anything is killed: not counted as used
    v1 = "cache 900\ninactive_file 100\ntotal_inactive_file 600000000\ntotal_active_file 5\n"
    assert mf.cgroup_room("1000000000", "800000000", v1) == 800_000_000
    assert mf.cgroup_room("1000000000", "800000000", "anon 5\nfile 700000000\ninactive_file 300000000\n") == 500_000_000
    assert mf.cgroup_room("1000", "50", "inactive_file 900\n") == 1000  # never more than the limit
    assert mf.free({"meminfo": MEMINFO, "rooms": [["1000000000", "800000000", v1], ["max", "1", ""]]}) == (
        800_000_000,
        "cgroup limit",
    )
    assert mf.available(MEMINFO, [None, 700_000_000, None]) == (700_000_000, "cgroup limit")
    assert mf.available(MEMINFO, [None]) == (24160648 * 1024, "MemAvailable")
    assert mf.available("", []) == (None, "unknown")


def test_only_a_floor_above_the_free_memory_fails() -> None:
    need = sm.Need("local", (0,), 100_000_000, floor=1.45e9, full=2.0e9, peak=3.2e9)
    status, line = sm.verdict(need, int(1.0e9), "cgroup limit", 1)
    assert status == sm.DOES_NOT_FIT
    assert line == (
        "the syncer needs 1.4 GB to 2.0 GB (3.2 GB while checkpointing) for 100.0 M parameters; "
        "1.0 GB free (cgroup limit)"
    )
    assert sm.verdict(need, int(1.5e9), "MemAvailable", 1)[0] == sm.MAY_NOT_FIT
    assert "once every round" in sm.verdict(need, int(1.5e9), "MemAvailable", 1)[1]
    assert "checkpoint may not fit" in sm.verdict(need, int(2.5e9), "MemAvailable", 1)[1]
    assert sm.verdict(need, int(4e9), "MemAvailable", 1)[0] == sm.FITS
    assert sm.verdict(need, None, "not asked: host down", 1) == (
        sm.FITS,
        "the syncer needs 1.4 GB to 2.0 GB (3.2 GB while checkpointing) for 100.0 M parameters; "
        "free memory unknown (not asked: host down)",
    )
    two = sm.Need("local", (0, 1), 100, 1.0, 1.0, 1.0)
    assert sm.verdict(two, 10, "MemAvailable", 2)[1].startswith("syncer shards 0,1 need ")
    assert sm.verdict(sm.Need("h", (1,), 100, 1.0, 1.0, 1.0), 10, "x", 2)[1].startswith("syncer shard 1 needs ")


def test_an_even_split_when_the_plan_is_not_at_hand() -> None:
    assert sm.owned_even(10, 3) == [4, 3, 3] and sum(sm.owned_even(124_475_904, 4)) == 124_475_904
    assert sm.total_params([("a", (3, 4)), ("b", (5,))]) == 17


def test_this_machine_answers_with_its_free_memory() -> None:
    free, which = mf.free(hostmem.probe())
    meminfo = Path("/proc/meminfo").read_text()
    assert free is not None and 0 < free <= mf.meminfo_available(meminfo)  # type: ignore[operator]
    assert which in ("MemAvailable", "cgroup limit")
    with pytest.raises(ValueError, match="not a memory probe"):
        mf.free({"rooms": []})


def test_a_syncer_that_cannot_hold_the_model_says_why_in_one_line() -> None:
    assert mf.floor_problem(1_000_000, 10**10, "MemAvailable") is None
    line = mf.floor_problem(500_000_000, 2 * 10**9, "cgroup limit", "syncer shard 1")
    assert line == (
        "syncer shard 1 cannot hold this model: its 500.0 M parameters need 6.0 GB (three fp32 vectors) "
        "and its host has 2.0 GB free (cgroup limit); run more shards on other hosts "
        "([syncer] shards, shard_hosts) or give the syncer's host memory"
    )


def test_a_syncer_refuses_a_first_learner_whose_model_it_cannot_hold_and_allocates_nothing() -> None:
    h = Harness(make_settings())
    h.core.memory_free = (1000, "cgroup limit")  # less than three vectors of even this model
    out = h.hello("a", 1.0)
    [(to, error)] = sent_of(out, "error")
    assert to == ["a"] and error["fatal"] and error["reason"].startswith("the syncer cannot hold this model: its ")
    assert "(cgroup limit)" in error["reason"] and not sent_of(out, "welcome")
    assert h.core.rejected["manifest"] == 1 and h.core.model is None and h.core.upload.buffers == []
    h.core.memory_free = (10**10, "MemAvailable")  # the same model, room for it: the first learner uploads
    assert sent_of(h.hello("a", 2.0), "welcome")[0][1]["init_owner"]


def test_a_shard_counts_its_own_fragments_only() -> None:
    manifest = tensor_manifest()
    h = Harness(make_settings(fragments=4), manifest)
    h.core.shard, h.core.shards = 1, 2
    own = sum(shards.shard_plan(manifest, 4, 1, 2).sizes())
    h.core.memory_free = (12 * own - 1, "MemAvailable")  # one byte short of its three vectors
    [(_, error)] = sent_of(h.hello("a", 1.0), "error")
    assert error["reason"].startswith(f"syncer shard 1 cannot hold this model: its {own / 1e6:,.1f} M parameters")
    h.core.memory_free = (12 * own, "MemAvailable")
    assert sent_of(h.hello("a", 2.0), "welcome")


def test_shard_0_of_a_scored_sharded_run_holds_one_copy_of_the_whole_model_more() -> None:
    total = 100 + 200 + 300
    assert mf.scorer_bytes(total, 3, 32) == 4.0 * total
    assert mf.scorer_bytes(total, 1, 32) == 0.0 and mf.scorer_bytes(total, 3, 0) == 0.0  # itself / off
    plain = sm.by_host(["local", "cpu-a", "local"], [100, 200, 300], 4, 0.5)
    scored = sm.by_host(["local", "cpu-a", "local"], [100, 200, 300], 4, 0.5, scorer=mf.scorer_bytes(total, 3, 32))
    assert scored[0].floor - plain[0].floor == scored[0].peak - plain[0].peak == scored[0].scorer == 2400
    assert scored[1] == plain[1]  # shard 1's host holds no copy
    _, line = sm.verdict(scored[0], None, "unknown", 3)
    assert "to score the whole model on shard 0; global_eval_every = 0: none" in line
