"""bench/loadgen.py's pure parts (the run itself starts a syncer and worker processes: it is a
benchmark, and tests/integration/test_loadgen.py runs it small): the model shapes' manifests, the
push schedule, the latency and rate definitions, the search's stop rule and its next fleet size,
the versions-only replica of the synthetic learners, the shards they link to, and how the
shards' numbers add up."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from bench import loadgen_core as core
from bench import loadgen_measure as measure
from bench.loadgen_link import LeanReplica, Shard, check_shards
from syncer.wire import codec, fragments
from workload.presets import param_shapes


@pytest.mark.parametrize(("shape", "target"), [("gpt2-124m", 124e6), ("gpt2-350m", 355e6), ("gpt2-774m", 774e6)])
def test_the_gpt2_shapes_have_their_parameter_counts(shape: str, target: float) -> None:
    n = core.param_count(core.manifest(shape))
    assert abs(n - target) / target < 0.01, n


def test_the_shapes_follow_the_presets_formulas() -> None:
    for name in ("gpt-tiny", "gpt-medium"):
        assert core.gpt_shapes(core.SHAPES[name]) == param_shapes(name)
    assert core.gpt_shapes(core.SHAPES["gpt2-124m"]) == param_shapes("gpt2-124m", vocab_size=core.GPT2_VOCAB)
    specs = core.manifest("gpt2-350m")
    assert {s.name for s in specs if s.kind == "embedding"} == set(core.EMBEDDINGS)
    assert len(specs) == 2 + 24 * 12 + 2  # wte, wpe; 12 tensors a layer; ln_f
    assert fragments.plan(specs, 4).imbalance() < 1.05  # balanced: the syncer cuts it the same way
    with pytest.raises(ValueError, match="unknown model shape"):
        core.manifest("gpt5")


def test_the_schedule_is_the_learners_and_the_offered_load_follows_from_it() -> None:
    s = core.Schedule(H=8, fragments=4, step_time=0.5)
    assert [s.due(step) for step in range(1, 9)] == [[], [0], [], [1], [], [2], [], [3]]  # learner/outer.py
    assert s.due(10) == [0] and s.due(16) == [3]
    assert s.sync_period_s == 4.0 and s.round_interval_s == 1.0
    assert s.offered_rate == 1.0  # P rounds every H steps
    assert s.offered_params_per_s(1000) == 250.0  # the whole model every H steps
    h64 = core.Schedule(H=64, fragments=4, step_time=1.0)
    assert h64.round_interval_s == 16.0 and h64.offered_rate == pytest.approx(1 / 16)


def test_percentiles() -> None:
    assert core.percentile([], 50) is None
    assert core.percentile([3.0], 99) == 3.0
    assert core.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert core.percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    assert core.spread([1.0, 2.0, 3.0], scale=2.0) == {"p50": 4.0, "p99": pytest.approx(5.96), "max": 6.0, "n": 3.0}


def test_the_achieved_rate_of_a_steady_stream_does_not_depend_on_where_the_window_cuts_it() -> None:
    closes = [10.0 + 4.0 * k for k in range(40)]  # one round every 4 s
    for start in (10.5, 12.0, 13.9, 21.3):
        assert core.achieved_rate(closes, start, start + 30.0, 4.0) == pytest.approx(0.25)


def test_a_stall_at_the_edge_of_the_window_counts_against_the_rate() -> None:
    closes = [0.0, 4.0, 8.0, 12.0]  # then nothing: the syncer stalled
    assert core.achieved_rate(closes, 0.0, 40.0, 4.0) == pytest.approx(3 / (12 + 24))
    assert core.achieved_rate([30.0, 34.0, 38.0], 0.0, 40.0, 4.0) == pytest.approx(2 / (8 + 26))
    assert core.achieved_rate([5.0], 0.0, 10.0, 4.0) == 0.1
    assert core.achieved_rate([], 0.0, 10.0, 4.0) == 0.0


def _reply(learner: str, p: int, v: int, pushed: float, received: float, missed: int = 0) -> core.Reply:
    return core.Reply(learner, p, v, pushed, received, missed)


def test_merge_latency_runs_from_the_last_push_to_the_last_contributor_holding_the_update() -> None:
    replies = [
        _reply("learner-0", 0, 5, pushed=100.0, received=100.9),
        _reply("learner-1", 0, 5, pushed=100.4, received=100.6),
        _reply("learner-0", 1, 5, pushed=104.0, received=104.3),
    ]
    timings = core.round_timings(replies)
    r = timings[(0, 5)]
    assert (r.last_push, r.first_received, r.last_received, r.seen) == (100.4, 100.6, 100.9, 2)
    assert r.latency == pytest.approx(0.5) and r.first_latency == pytest.approx(0.2)
    assert timings[(1, 5)].latency == pytest.approx(0.3)
    record = {"fragment": 0, "version": 5, "t": 100.45, "merge_s": 0.1}  # closed, then merged for 0.1 s
    assert core.sent_latencies([record, {"fragment": 2, "version": 1, "t": 0.0}], timings) == [pytest.approx(0.15)]
    assert core.Reply.from_dict({**vars(replies[0]), "missed": 2}).missed == 2


def test_a_window_summarizes_rounds_replies_and_checkpoint_stalls() -> None:
    sizes = [100, 200]
    records = [
        {"t": 9.0, "fragment": 0, "version": 1, "contributors": ["learner-0"], "merge_s": 0.1},  # before the window
        {"t": 12.0, "fragment": 0, "version": 2, "contributors": ["learner-0", "learner-1"], "merge_s": 0.2},
        {"t": 16.0, "fragment": 1, "version": 1, "contributors": ["learner-0", "learner-1"], "merge_s": 0.4},
    ]
    replies = [
        _reply("learner-0", 0, 2, 11.5, 12.3),
        _reply("learner-1", 0, 2, 11.8, 12.4, missed=1),
        _reply("learner-0", 1, 1, 15.0, 17.0),
        _reply("learner-1", 1, 1, 15.2, 17.1),
    ]
    stalls = [(15.5, 1.0)]  # a checkpoint held the loop while fragment 1's round waited
    st = core.window_stats(records, replies, sizes, 10.0, 20.0, core.Schedule(8, 2, 1.0), stalls)
    assert st.rounds == 2 and st.replies == 4
    assert st.params_per_s == pytest.approx(30.0) and st.contribution_params_per_s == pytest.approx(60.0)
    assert st.contributors_mean == 2.0
    assert st.missed == 1 and st.missed_share == 0.25
    assert st.latency["n"] == 2 and st.latency["max"] == pytest.approx(1.9)
    assert st.latency_clear["n"] == 1 and st.latency_clear["max"] == pytest.approx(0.6)
    assert st.merge_s["max"] == pytest.approx(0.4)
    assert core.overlaps(10.0, 11.0, [(11.5, 1.0)]) is False and core.overlaps(13.0, 14.0, [(11.5, 1.0)], pad=1.0)


def test_checkpoint_stalls_are_read_from_the_syncers_log() -> None:
    log = (
        "2026-12-02 22:00:11 global model initialized: 124475904 parameters from learner-0\n"
        "2026-12-02 22:00:27 checkpoint at outer step 2: ckpt-0001-000000002-1.pt, 1.5 GB in 11.79 s\n"
        "2026-12-02 22:00:57 checkpoint at outer step 10: ckpt-0001-000000010-2.pt, 1.5 GB in 10.48 s "
        "(2 checkpoints since the last line)\n"
    )
    t0 = time.mktime(time.strptime("2026-12-02 22:00:00", "%Y-%m-%d %H:%M:%S"))
    assert [s for _, s in core.checkpoint_stalls(log, t0, t0 + 60)] == [11.79, 10.48]
    assert core.checkpoint_stalls(log, t0 + 40, t0 + 60) == [(t0 + 57, 10.48)]
    assert core.checkpoint_stalls(log, t0 + 35, t0 + 50) == [(t0 + 27, 11.79)]  # begun before, still running
    assert core.stalled_seconds([(t0 + 27, 11.79), (t0 + 57, 10.48)], t0 + 35, t0 + 60) == pytest.approx(6.79)


def test_the_stop_rule() -> None:
    rule = core.StopRule(max_latency_s=16.0)
    ok = core.WindowStats(
        rounds=8,
        achieved_rate=0.0625,
        params_per_s=1.0,
        contribution_params_per_s=4.0,
        contributors_mean=4.0,
        latency={"p50": 1.0, "p99": 3.0, "max": 3.0, "n": 8.0},
        latency_clear={"p50": 1.0, "p99": 3.0, "max": 3.0, "n": 8.0},
        sent_latency={},
        merge_s={},
        replies=32,
        missed=1,
        missed_share=1 / 32,
    )
    offered = 1 / 16
    assert rule.problems(ok, offered) == []
    slow = core.WindowStats(**{**vars(ok), "achieved_rate": 0.05})
    assert "rounds/s" in rule.problems(slow, offered)[0]
    late = core.WindowStats(**{**vars(ok), "latency": {"p50": 1.0, "p99": 17.0, "max": 20.0, "n": 8.0}})
    assert "latency p99" in rule.problems(late, offered)[0]
    missing = core.WindowStats(**{**vars(ok), "missed_share": 0.2})
    assert "missed their round" in rule.problems(missing, offered)[0]
    assert rule.problems(core.WindowStats(**{**vars(ok), "rounds": 0}), offered) == ["no round merged"]


def test_the_search_doubles_then_bisects_once_and_reports_the_largest_size_sustained() -> None:
    assert core.next_learners([], 2, 16, 1) == 2
    assert core.next_learners([(2, True)], 2, 16, 1) == 4
    assert core.next_learners([(2, True), (4, True), (8, True)], 2, 12, 1) == 12  # capped
    assert core.next_learners([(2, True), (4, True), (8, True), (16, True)], 2, 16, 1) is None
    history = [(2, True), (4, True), (8, False)]
    assert core.next_learners(history, 2, 16, 1) == 6
    assert core.next_learners([*history, (6, True)], 2, 16, 1) is None  # refine = 1: one bisection
    assert core.next_learners([*history, (6, True)], 2, 16, 2) == 7
    assert core.next_learners([(2, False)], 2, 16, 3) == 1
    assert core.next_learners([(2, False), (1, False)], 2, 16, 3) is None  # nothing between 0 and 1
    assert core.sustained([*history, (6, True)]) == 6
    assert core.sustained([(2, False)]) == 0


def test_the_lean_replica_tracks_versions_without_holding_values() -> None:
    sizes = [6, 4]
    r = LeanReplica(sizes, decode=True)
    r.refetch_all()
    r.epoch = 1
    assert r.requests(0.0, 4, 8) == [(0, 0, -1), (1, 0, -1)]  # the version first, then the rest
    assert not r.on_state(0, 3, 0, np.zeros(4, dtype=np.float32))
    assert r.requests(0.0, 4, 8) == [(0, 4, 3)]
    blob = codec.encode(torch.ones(6) * 0.01)
    assert r.on_update(0, 3, 4, blob) == "buffered"  # applied once the fetch is complete
    assert r.on_state(0, 3, 4, np.zeros(2, dtype=np.float32))
    assert r.versions[0] == 4 and r.latest[0] is not None and r.latest[0].numel() == 0  # no values kept
    assert r.on_state(1, 7, 0, np.zeros(4, dtype=np.float32)) and r.complete()
    assert r.on_update(1, 7, 8, codec.encode(torch.ones(4))) == "applied"
    assert r.on_update(1, 7, 8, codec.encode(torch.ones(4))) == "stale"
    assert r.on_update(1, 9, 10, codec.encode(torch.ones(4))) == "gap" and 1 in r.fetches
    assert r.applied == [(0, 4), (1, 8)] and r.decoded == 2
    with pytest.raises(codec.CodecError):
        r.on_update(0, 4, 5, codec.encode(torch.ones(3)))  # a blob of the wrong size is caught by decoding


def test_the_shards_must_own_every_fragment_once() -> None:
    check_shards((Shard("tcp://127.0.0.1:1", (0, 1, 2, 3)),), 4)  # unsharded
    check_shards((Shard("tcp://127.0.0.1:1", (0, 3)), Shard("tcp://127.0.0.1:2", (1, 2))), 4)
    for bad in [
        (Shard("tcp://127.0.0.1:1", (0, 1)), Shard("tcp://127.0.0.1:2", (1, 2, 3))),  # 1 twice
        (Shard("tcp://127.0.0.1:1", (0, 1)), Shard("tcp://127.0.0.1:2", (2,))),  # 3 nowhere
        (),
    ]:
        with pytest.raises(ValueError, match="own fragments"):
            check_shards(bad, 4)


def test_a_reply_names_its_shard_and_rounds_are_global() -> None:
    r = core.Reply.from_dict(
        {"learner": "learner-0", "fragment": 3, "version": 2, "pushed_at": 1.0, "received_at": 2.0}
    )
    assert r.shard == 0  # replies of an unsharded syncer
    s1 = core.Reply.from_dict({**vars(r), "shard": 1, "fragment": 1})
    assert s1.shard == 1
    assert set(core.round_timings([r, s1])) == {(3, 2), (1, 2)}  # global fragments: no clash between shards


def _numbers(cpu: float, loop: float, rss: float, hwm: float, ckpt: list[float], share: float) -> dict[str, object]:
    return {
        "cpu_cores": cpu,
        "threads": {"loop": loop, "zmq": cpu - loop, "other": 0.0},
        "rss_mb_max": rss,
        "rss_mb_end": rss,
        "hwm_mb": hwm,
        "counters": {"dropped_sends": 1, "dropped_pushes": 0, "disconnects": 2, "rejected": 0, "live": 4},
        "checkpoints": {"count": len(ckpt), "seconds": ckpt, "share": share},
    }


def test_the_shards_numbers_add_up_to_the_syncers() -> None:
    parts = [_numbers(1.0, 0.9, 1000.0, 1500.0, [2.0], 0.1), _numbers(0.5, 0.4, 800.0, 900.0, [], 0.0)]
    rss = [[900.0, 500.0], [1000.0, 800.0], [950.0, 790.0]]  # samples at the same times: (shard 0, shard 1)
    total = measure.combine(parts, rss, rounds=30, span=10.0)
    assert total["cpu_cores"] == 1.5 and total["threads"]["loop"] == pytest.approx(1.3)
    assert total["cpu_s_per_round"] == pytest.approx(0.5)  # 15 CPU seconds over 30 rounds
    assert total["rss_mb_max"] == 1800.0 and total["rss_mb_end"] == 1740.0 and total["hwm_mb"] == 2400.0
    assert total["counters"]["disconnects"] == 4 and total["counters"]["live"] == 8
    assert total["checkpoints"] == {"count": 1, "seconds": [2.0], "share": 0.05}
    unknown = {**parts[1], "counters": {"unknown": "no answer"}}
    assert measure.combine([parts[0], unknown], rss, 30, 10.0)["counters"][1] == {"unknown": "no answer"}


def test_threads_are_told_apart_and_this_process_is_measured() -> None:
    assert measure.thread_kind(10, 10, "python") == "loop"
    assert measure.thread_kind(10, 11, "ZMQbg/IO/0") == "zmq"
    assert measure.thread_kind(10, 12, "python") == "other"
    t0 = measure.thread_cpu(os.getpid())
    busy_until = time.thread_time() + 0.2  # 0.2 s of this thread's CPU: ~20 of /proc's 10 ms ticks
    while time.thread_time() < busy_until:  # (a fixed loop took under one tick on a fast core once)
        sum(i * i for i in range(10_000))
    cores = measure.thread_delta(t0, measure.thread_cpu(os.getpid()), 1.0)
    assert cores["loop"] > 0 and set(cores) == {"loop", "zmq", "other"}
    assert measure.proc_cpu(os.getpid()) >= cores["loop"]
    assert measure.thread_cpu(2**22 + 12345) == {} and measure.proc_cpu(2**22 + 12345) == 0.0


def _stats(rounds: int, rate: float) -> dict[str, object]:
    spread = {"p50": 0.1, "p99": 0.2, "max": 0.3, "n": 4.0}
    return vars(
        core.WindowStats(rounds, rate, 1e6 * rounds, 2e6 * rounds, 2.0, spread, spread, spread, spread, 8, 0, 0.0)
    )


def _syncer(cores: float) -> dict[str, object]:
    return {
        "cpu_cores": cores,
        "threads": {"loop": cores / 2, "zmq": cores / 4, "other": 0.0},
        "cpu_s_per_round": 1.0,
        "rss_mb_max": 100.0,
        "hwm_mb": 120.0,
        "checkpoints": {"count": 0, "seconds": [], "share": 0.0},
    }


def test_a_sharded_level_has_a_row_for_the_whole_syncer_then_one_per_shard() -> None:
    from bench import loadgen
    from bench.loadgen_fleet import LoadConfig

    cfg = LoadConfig(H=8, fragments=4, step_time=0.5, window_s=10.0, shards=2)  # 1 round/s offered
    part = {"stats": _stats(5, 0.5), "syncer": _syncer(0.4)}
    level = {
        "learners": 3,
        "stats": _stats(10, 1.0),
        "syncer": _syncer(0.8),
        "generator": {"cpu_cores": 0.1, "lag": {"p99": 0.01}, "links": {"reconnects": 0}},
        "join_s": 2.0,
        "shards": [{**part, "shard": 0, "fragments": [0, 3]}, {**part, "shard": 1, "fragments": [1, 2]}],
    }
    loadgen.judge(level, cfg, core.StopRule(max_latency_s=1.0))
    rows = loadgen.level_rows(level, cfg)
    assert [r["shard"] for r in rows] == ["all", "0", "1"]
    assert [r["offered/s"] for r in rows] == [1.0, 0.5, 0.5]  # a shard is offered its fragments' share
    assert all(r["verdict"] == "kept up" for r in rows)
    assert rows[0]["gen_cpu"] == 0.1 and rows[1]["gen_cpu"] == "-" and rows[1]["loop_cores"] == 0.2
    assert "shard" not in loadgen.level_rows({k: v for k, v in level.items() if k != "shards"}, cfg)[0]
