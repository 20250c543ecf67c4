"""The pure parts of the torchft DiLoCo baseline (bench/torchft_diloco.py, bench/torchft_worker.py):
the kill plan, the window, token accounting, the eval curve, the rejoin times, the choice of
final model, the CLI schedule; and (only where torchft is installed) the worker's fragment
split and config checks. No process is started.
"""

from __future__ import annotations

import json
import random

import pytest

from bench import torchft_diloco as tf

TOK = 256  # tokens per step: batch 8 x seq 32


def ev(event: str, t: float, group: int, inc: int = 0, trained: int = 0, **extra: object) -> dict:
    return {"event": event, "time": t, "group": group, "incarnation": inc, "tokens_trained": trained, **extra}


def sync(t: float, group: int, trained: int, credited: int, inc: int = 0, committed: bool = True) -> dict:
    return ev("sync", t, group, inc, trained, credited=credited, committed=committed)


def test_kill_plan_draws_victims_like_the_other_baselines() -> None:
    rng = random.Random(7)
    expected = [rng.randrange(4) for _ in range(3)]
    plan = tf.kill_plan([30.0, 5.5, 12.0], 4, 7)
    assert [t for t, _ in plan] == [5.5, 12.0, 30.0]
    assert [v for _, v in plan] == expected
    assert tf.kill_plan([], 4, 7) == []


def test_window_starts_when_every_group_has_trained_a_step() -> None:
    events = [ev("boot", 0.5, 0), ev("start", 1.0, 0), ev("start", 2.0, 1), ev("start", 9.0, 1, inc=1)]
    assert tf.window_start(events, 2) == 2.0
    assert tf.window_start(events, 3) is None
    assert tf.window_start([], 1) is None


def test_token_accounting_inside_the_window() -> None:
    events = [
        ev("start", 0.5, 0, trained=TOK),
        sync(1.0, 0, 8 * TOK, 8 * TOK),  # before the window
        ev("start", 2.0, 1, trained=TOK),  # opens it
        sync(3.0, 0, 16 * TOK, 8 * TOK),
        sync(3.0, 1, 8 * TOK, 8 * TOK),
        sync(4.0, 0, 24 * TOK, 0, committed=False),
        sync(4.0, 1, 16 * TOK, 0, committed=False),
        ev("start", 5.0, 1, inc=1, trained=TOK),
        sync(6.0, 1, 8 * TOK, 0, inc=1),  # healed: credits 0
        sync(7.0, 0, 32 * TOK, 8 * TOK),
        sync(11.0, 0, 40 * TOK, 8 * TOK),  # the last one is after the end
    ]
    assert tf.committed_in(events, 2.0, 10.0) == 24 * TOK
    # group 0 from its sync at 1.0; group 1's first life from 0; the second life from 0
    assert tf.trained_in(events, 2.0, 10.0) == (32 - 8) * TOK + 16 * TOK + 8 * TOK
    res = tf.summarize(events, 2.0, 10.0, [], restarts=0)
    assert res["tokens_committed"] == 24 * TOK and res["window_s"] == 8.0
    assert res["tokens_per_s"] == pytest.approx(24 * TOK / 8.0)
    assert res["syncs"] == 6 and res["syncs_committed"] == 4
    json.dumps(res)  # JSON-ready


def test_curve_counts_committed_tokens_up_to_each_eval() -> None:
    events = [
        ev("eval", 1.0, 0, eval_loss=5.4, manager_step=0),
        sync(3.0, 1, 8 * TOK, 8 * TOK),
        ev("eval", 3.5, 0, eval_loss=3.0, manager_step=4),
        ev("eval", 3.6, 1, eval_loss=9.9),
        ev("eval", 20.0, 0, eval_loss=2.0),
    ]
    points = tf.curve(events, 2.0, 10.0)
    assert [(p["t"], p["tokens"], p["eval_loss"]) for p in points] == [(-1.0, 0, 5.4), (1.5, 8 * TOK, 3.0)]


def test_rejoin_times_follow_the_victims_next_incarnation() -> None:
    kill = {"time": 10.0, "victim": 1, "incarnation": 0, "t": 4.0}
    events = [
        sync(10.5, 1, 0, 0),
        ev("start", 16.0, 1, inc=1),
        ev("heal", 16.5, 1, inc=1),
        sync(16.6, 1, 8 * TOK, 0, inc=1),
        sync(17.0, 2, 0, 0),
    ]
    (done,) = tf.rejoins([kill], events)
    assert done["to_first_step_s"] == 6.0 and done["to_heal_s"] == 6.5
    assert done["to_commit_s"] == pytest.approx(6.6)
    (never,) = tf.rejoins([kill], [])
    assert never["to_heal_s"] is None


def test_final_model_is_the_most_committed_then_group_zero() -> None:
    assert tf.pick_final([{"group": 1, "manager_step": 9}, {"group": 0, "manager_step": 9}])["group"] == 0
    assert tf.pick_final([{"group": 0, "manager_step": 0}, {"group": 2, "manager_step": 9}])["group"] == 2
    assert tf.pick_final([]) is None


def test_cli_schedule() -> None:
    from bench.ddp_baseline import failure_schedule

    assert tf.schedule_for(100.0, 0, 1, quick=False) == []
    assert tf.schedule_for(30.0, 20.0, 1, quick=True) == [15.0]
    assert tf.schedule_for(100.0, 20.0, 3, quick=False) == failure_schedule(100.0, 20.0, 3)


def test_worker_fragments_and_config(tmp_path: object) -> None:
    pytest.importorskip("torchft")
    from bench import torchft_worker as w

    sizes = [("a", 10), ("b", 40), ("c", 30), ("d", 20)]
    groups = w.balanced_fragments(sizes, 2)
    assert sorted(n for g in groups for n in g) == ["a", "b", "c", "d"]
    assert sorted(sum(dict(sizes)[n] for n in g) for g in groups) == [50, 50]
    assert w.balanced_fragments(sizes, 1) == [["a", "b", "c", "d"]]
    with pytest.raises(ValueError):
        w.balanced_fragments(sizes, 5)
    assert w.check_schedule(32, 4) == 8
    for H, P in ((30, 4), (2, 4), (32, 0)):
        with pytest.raises(ValueError):
            w.check_schedule(H, P)
    cfg = {"settings": {"model": "gpt-tiny", "H": 32}, "replicas": 4, "stop_file": "stop", "fragments": 4}
    assert w.load_config(json.dumps(cfg)).settings["lr"] > 0
    with pytest.raises(ValueError, match="unknown"):
        w.load_config(json.dumps({**cfg, "typo": 1}))
