"""The syncer's round clock (round_clock = "syncer"): calls on the fleet's phase, rounds that
wait for the called fleet, and the backlog bound, driven through the pure core."""

from __future__ import annotations

import pytest
import torch

from syncer import merge
from syncer.clock import LINK_S, RoundClock
from syncer.core import Outbox
from syncer.wire import quant
from syncer.wire.protocol import Message
from tests.unit.coreharness import Harness, events_of, make_settings, rounds_of, sent_of


def test_the_clock_calls_each_fragment_every_H_fleet_steps_staggered_by_H_over_P() -> None:
    clock = RoundClock(H=8, fragments=4)
    calls: list[tuple[int, int]] = []  # (tick, fragment)
    for tick in range(41):  # half a step a tick (exact in binary): 20 fleet steps
        for p in clock.advance(tick * 0.25, [0.5, 0.5, 0.5]):
            calls.append((tick, p))
    # fragment p at phase (p + 1) * 2 + 8k: ticks 4, 8, 12, 16, then again 8 steps (16 ticks) later
    assert calls[:6] == [(4, 0), (8, 1), (12, 2), (16, 3), (20, 0), (24, 1)]
    assert [p for _, p in calls].count(0) == 3  # phases 2, 10, 18 within 20 steps


def test_the_clock_runs_at_the_median_step_time_and_stands_still_without_learners() -> None:
    clock = RoundClock(H=4, fragments=1)
    assert clock.advance(0.0, [0.1, 0.1, 10.0]) == []
    assert clock.advance(0.39, [0.1, 0.1, 10.0]) == []  # 3.9 steps of the median learner
    assert clock.advance(0.41, [0.1, 0.1, 10.0]) == [0]
    assert clock.advance(5.0, []) == []  # nobody training: no phase, no call
    assert clock.phase == pytest.approx(4.1)
    assert clock.advance(5.1, [0.1]) == []  # resumes from where it stood
    # a long gap calls each fragment once, not once per period missed
    assert clock.advance(50.0, [0.1]) == [0]


def test_the_window_is_tau_fleet_steps_with_gamma_as_margin() -> None:
    clock = RoundClock(H=8, fragments=2)
    assert clock.window(tau=2, gamma=0.5) == LINK_S  # no step time known yet
    clock.advance(0.0, [0.1, 0.1, 5.0])
    assert clock.window(tau=2, gamma=0.5) == pytest.approx(1.5 * 2 * 0.1 + LINK_S)
    assert clock.steps_per_period(0.2) == pytest.approx(4.0)  # half the fleet's speed: H/2 steps


def test_a_learners_seconds_per_step_are_measured_from_its_heartbeats() -> None:
    """Step time alone leaves out what a learner does between steps; the clock uses the real rate."""
    h = Harness(make_settings(round_clock="syncer"))
    h.join_all()
    for i, now in enumerate((1.0, 2.0, 3.0, 4.0)):
        h.send("a", Message("heartbeat", {"step": 50 * i, "tokens": 0, "state": "running", "step_time": 0.01}), now)
    info = h.core.fleet.learners["a"]
    assert info.seconds_per_step() == pytest.approx(0.02)  # 50 steps a second, not 100
    h.send("a", Message("heartbeat", {"step": 3, "tokens": 0, "state": "running", "step_time": 0.01}), 5.0)
    h.send("a", Message("heartbeat", {"step": 103, "tokens": 0, "state": "running", "step_time": 0.01}), 7.0)
    assert info.seconds_per_step() == pytest.approx(0.02)  # measured again after the counter restarted


def test_heartbeats_that_queued_while_the_syncer_was_busy_do_not_read_as_a_burst_of_steps() -> None:
    """After a 16 s stall the syncer handles 16 queued heartbeats at once: on its own clock that
    looked like 16 s of steps in no time (the round clock then ran fast, bench/loadgen); on the
    learner's clock (`sent_at`) the rate stays what it was."""
    h = Harness(make_settings(round_clock="syncer"))
    h.join_all()
    info = h.core.fleet.learners["a"]

    def beat(step: int, sent_at: object, now: float) -> None:
        meta = {"step": step, "tokens": 0, "state": "running", "step_time": 0.01, "sent_at": sent_at}
        h.send("a", Message("heartbeat", meta), now)

    for t in range(5):  # 50 steps a second, heard as sent
        beat(50 * t, 100.0 + t, 1.0 + t)
    assert info.seconds_per_step() == pytest.approx(0.02)
    for t in range(5, 21):  # the syncer was stuck from 5.0 to 21.0: all of these arrive at 21.0
        beat(50 * t, 100.0 + t, 21.0)
    for t in range(21, 25):
        beat(50 * t, 100.0 + t, 1.0 + t)
    assert info.seconds_per_step() == pytest.approx(0.02)
    beat(50 * 25, "soon", 26.0)  # a heartbeat without a usable clock falls back to the syncer's
    beat(50 * 26, 99.0, 27.0)  # a clock that goes back restarts the measurement instead of a negative rate
    assert info.seconds_per_step() > 0


def _fleet(**changes: object) -> Harness:
    """Three learners a, b, c at 10 ms a step, live and training, on the syncer's clock."""
    settings: dict[str, object] = {
        "round_clock": "syncer",
        "quorum": 1,
        "H": 8,
        "fragments": 2,
        "compression": "none",
        "merge": "mean",
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        **changes,
    }
    h = Harness(make_settings(**settings))
    h.join_all()
    for lid in ("a", "b", "c"):
        _beat(h, lid, 1.0)
    return h


def _beat(h: Harness, learner: str, now: float, step_time: float = 0.01) -> None:
    h.send(learner, Message("heartbeat", {"step": 10, "tokens": 160, "state": "running", "step_time": step_time}), now)


def _call_fragment(h: Harness, p: int, start: float, to: tuple[str, ...] = ("a", "b", "c")) -> float:
    """Tick in 1 ms steps until fragment p is called (to every learner in `to` at once); the time."""
    now = start
    while now < start + 1.0:
        now += 0.001
        calls = sent_of(h.tick(now), "call")
        if any(m["fragment"] == p for _, m in calls):
            assert calls[0][0] == list(to)  # every connected learner is called at once
            return now
    raise AssertionError(f"fragment {p} was never called")


def test_a_push_before_the_call_waits_for_the_fleet_instead_of_closing_alone() -> None:
    h = _fleet()
    h.tick(1.0)
    h.push("a", 0, h.delta(0, 1), now=1.001, c_steps=2, c_tokens=32, step_time=0.01)  # quorum 1 is met
    assert not rounds_of(h.tick(1.002))
    called = _call_fragment(h, 0, 1.002)
    assert not any(rounds_of(o) for o in h.outs)
    h.push("b", 0, h.delta(0, 2), now=called + 0.005, c_steps=8, c_tokens=128, step_time=0.01)
    assert not rounds_of(h.tick(called + 0.006))  # c is live and inside the window
    h.push("c", 0, h.delta(0, 3), now=called + 0.01, c_steps=8, c_tokens=128, step_time=0.01)
    # a's early push is no answer to this call: the round waits for a's answer (or its window)
    assert not rounds_of(h.tick(called + 0.011))
    h.push("a", 0, h.delta(0, 4), now=called + 0.012, c_steps=6, c_tokens=96, step_time=0.01)
    (record,) = rounds_of(h.tick(called + 0.013))  # every live learner answered: closes at once
    assert record["contributors"] == ["a", "b", "c"]
    assert record["tokens"] == 32 + 128 + 128 + 96  # a's early push and its answer, summed


def test_a_round_holding_only_early_work_waits_for_the_answers_to_its_call() -> None:
    """Every learner's backlog rest carried into the next round (after a syncer restart): the
    call must not close that round at once, or every answer lands in the round after, a period
    late, for good."""
    h = _fleet()
    h.tick(1.0)
    for lid in ("a", "b", "c"):
        h.push(lid, 0, h.delta(0, 1), now=1.001, c_steps=2, c_tokens=32, step_time=0.01)
    called = _call_fragment(h, 0, 1.002)
    assert not any(rounds_of(o) for o in h.outs)
    for i, lid in enumerate(("a", "b", "c")):
        h.push(lid, 0, h.delta(0, 2), now=called + 0.005 + 0.001 * i, c_steps=8, c_tokens=128, step_time=0.01)
    (record,) = rounds_of(h.tick(called + 0.009))
    assert record["tokens"] == 3 * (32 + 128)  # the answers made it into their own round
    assert 0 not in h.core.rounds  # nothing left a period behind


def test_a_called_round_closes_at_its_window_without_the_straggler_whose_push_waits_for_the_next() -> None:
    h = _fleet()
    h.tick(1.0)
    called = _call_fragment(h, 0, 1.0)
    deadline = h.core.rounds[0].deadline
    assert deadline == pytest.approx(called + 1.5 * 2 * 0.01 + LINK_S)
    h.push("a", 0, h.delta(0, 1), now=called + 0.005, step_time=0.01)
    h.push("b", 0, h.delta(0, 2), now=called + 0.006, step_time=0.01)
    assert not rounds_of(h.tick(deadline - 0.001))
    (record,) = rounds_of(h.tick(deadline + 0.001))
    assert record["contributors"] == ["a", "b"]
    h.push("c", 0, h.delta(0, 3), now=deadline + 0.002, step_time=0.01)  # late: kept, not a round
    assert not rounds_of(h.tick(deadline + 0.003))
    assert h.core.rounds[0].contributions.keys() == {"c"}


def test_a_live_learner_that_pushes_nothing_is_waited_for_twice_then_not_until_it_pushes() -> None:
    """c heartbeats but pushes nothing (a learner reloading after every step): every round waited
    for it until its deadline, and every merge reached the fleet a period late."""
    h = _fleet()
    now = 1.0
    closed_at = []
    for turn in range(4):
        p = turn % 2
        called = _call_fragment(h, p, now)
        deadline = h.core.rounds[p].deadline
        for lid in ("a", "b", "c"):
            _beat(h, lid, called)
        h.push("a", p, h.delta(p, 1), now=called + 0.002, step_time=0.01)
        h.push("b", p, h.delta(p, 2), now=called + 0.003, step_time=0.01)
        now = called + 0.004
        while not rounds_of(h.tick(now)):
            now += 0.001
        closed_at.append((now < deadline, turn))
    assert closed_at == [(False, 0), (False, 1), (True, 2), (True, 3)]  # twice at the deadline, then at once
    called = _call_fragment(h, 0, now)
    h.push("c", 0, h.delta(0, 3), now=called + 0.001, step_time=0.01)  # c pushes again: waited for again
    h.push("a", 0, h.delta(0, 1), now=called + 0.002, step_time=0.01)
    h.push("b", 0, h.delta(0, 2), now=called + 0.003, step_time=0.01)
    (record,) = rounds_of(h.tick(called + 0.004))
    assert record["contributors"] == ["a", "b", "c"] and h.core.missed["c"] == 0


def test_a_call_nobody_answered_is_made_again_at_the_fragments_next_turn() -> None:
    """A call can be lost (after a hang every learner had a new socket and the calls went to
    the old ones); the open round must be called again, or the fragment is never merged again."""
    h = _fleet()
    first = _call_fragment(h, 0, 1.0)
    assert h.core.rounds[0].called_at == pytest.approx(first)
    second = _call_fragment(h, 0, first)  # nobody answered: called again, a period on
    assert second - first == pytest.approx(0.08, abs=0.002)
    assert h.core.rounds[0].deadline == pytest.approx(second + 1.5 * 2 * 0.01 + LINK_S)  # a fresh window
    assert h.core.counters["recalls"] == 1
    h.push("a", 0, h.delta(0, 1), now=second + 0.001, step_time=0.01)
    (record,) = rounds_of(h.tick(h.core.rounds[0].deadline + 0.001))
    assert record["contributors"] == ["a"]


def test_a_call_made_again_goes_only_to_those_not_in_the_round() -> None:
    h = _fleet(quorum=2)
    first = _call_fragment(h, 0, 1.0)
    h.push("a", 0, h.delta(0, 1), now=first + 0.001, step_time=0.01)  # below quorum 2: stays open
    now = first + 0.002
    while now < first + 1.0:
        now += 0.001
        calls = [m for m in sent_of(h.tick(now), "call") if m[1]["fragment"] == 0]
        if calls:
            assert calls[0][0] == ["b", "c"]
            return
    raise AssertionError("fragment 0 was never called again")


def test_on_the_syncer_clock_a_partial_round_is_not_shrunk_by_fleet_scale() -> None:
    h = _fleet(fleet_scale=True, seq_len=1)
    theta0 = h.core.model.theta[0].clone()
    called = _call_fragment(h, 0, 1.0)
    d = h.delta(0, 1)
    h.push("a", 0, d, now=called + 0.001, c_steps=8, c_tokens=128, step_time=0.01)
    h.tick(h.core.rounds[0].deadline + 0.001)
    torch.testing.assert_close(h.core.model.theta[0], theta0 - d, rtol=0, atol=1e-7)  # one whole outer step


def _backlog_of_40_periods(**changes: object) -> tuple[Harness, torch.Tensor, torch.Tensor, Outbox]:
    """A push spanning 40 sync periods (320 steps at H = 8), merged in a round of its own."""
    h = _fleet(max_backlog=2.0, robust_clip=0.0, **changes)
    theta0 = h.core.model.theta[0].clone()
    called = _call_fragment(h, 0, 1.0)
    d = h.delta(0, 1)
    h.push("a", 0, d, now=called + 0.001, c_steps=320, c_tokens=320 * 16, step_time=0.01)
    return h, theta0, d, h.tick(h.core.rounds[0].deadline + 0.001)


def test_a_backlog_of_many_periods_counts_as_max_backlog_periods_and_carries_max_carry() -> None:
    """After an outage a learner's push spans 40 sync periods: it is merged as 2 periods' worth
    (max_backlog), its outer gradient and its weight scaled by 2/40; 2 more periods of it
    (max_carry) wait for the next round, the other 36 are dropped, and one event says so."""
    h, theta0, d, out = _backlog_of_40_periods()
    torch.testing.assert_close(h.core.model.theta[0], theta0 - d * (16 / 320), rtol=0, atol=1e-7)
    (event,) = events_of(out, "backlog")
    assert event["target"] == "a" and "320 steps" in event["detail"] and "16 counted now" in event["detail"]
    assert "16 carried to the next rounds, 288 dropped" in event["detail"]
    assert h.core.fleet.learners["a"].merged_tokens == pytest.approx(16 * 16 / 2)  # 16 steps over P = 2
    assert h.core.counters["backlog_capped"] == 1 and h.core.counters["backlog_dropped_steps"] == 288
    rest = h.core.rounds[0].contributions["a"]
    assert (rest.c_steps, rest.c_tokens) == (16, 16 * 16)
    torch.testing.assert_close(quant.dequantize(rest.delta), d * (16 / 320), rtol=0, atol=1e-7)
    drained = Outbox()
    assert h.core.flush(10.0, drained) == 1
    assert not events_of(drained, "backlog") and 0 not in h.core.rounds  # absorbed: nothing left
    assert h.core.fleet.learners["a"].merged_tokens == pytest.approx(2 * 16 * 16 / 2)
    torch.testing.assert_close(h.core.model.theta[0], theta0 - d * (32 / 320), rtol=0, atol=1e-6)


def test_with_max_carry_minus_one_the_whole_backlog_waits_for_the_next_rounds() -> None:
    h, theta0, d, out = _backlog_of_40_periods(max_carry=-1.0)
    (event,) = events_of(out, "backlog")
    assert "304 carried to the next rounds, 0 dropped" in event["detail"]
    rest = h.core.rounds[0].contributions["a"]
    assert (rest.c_steps, rest.c_tokens) == (304, 304 * 16)
    torch.testing.assert_close(quant.dequantize(rest.delta), d * (304 / 320), rtol=0, atol=1e-7)
    drained = Outbox()
    assert h.core.flush(10.0, drained) == 1  # down closes each round once: no burst of the whole backlog
    assert not events_of(drained, "backlog")  # one event per backlog, not one per round that absorbs it
    torch.testing.assert_close(h.core.model.theta[0], theta0 - d * (32 / 320), rtol=0, atol=1e-6)


def test_max_carry_zero_drops_the_rest_of_a_backlog() -> None:
    h, theta0, d, out = _backlog_of_40_periods(max_carry=0.0)
    assert "0 carried to the next rounds, 304 dropped" in events_of(out, "backlog")[0]["detail"]
    assert 0 not in h.core.rounds
    torch.testing.assert_close(h.core.model.theta[0], theta0 - d * (16 / 320), rtol=0, atol=1e-7)


def test_on_the_learners_clocks_nothing_is_called() -> None:
    h = Harness(make_settings(round_clock="learner", quorum=1))
    h.join_all()
    for now in (1.0, 2.0, 3.0, 4.0):
        for lid in ("a", "b", "c"):
            _beat(h, lid, now)
        assert not sent_of(h.tick(now), "call")


def _answer_call(h: Harness, lids: tuple[str, ...], start: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Call fragment 0 and let `lids` answer with a whole period each: (theta before, the mean delta)."""
    theta0 = h.core.model.theta[0].clone()
    called = _call_fragment(h, 0, start, lids)
    deltas = [h.delta(0, i + 1) for i in range(len(lids))]
    for lid, d in zip(lids, deltas):
        h.push(lid, 0, d, now=called + 0.001, c_steps=8, c_tokens=128, step_time=0.01)
    h.tick(h.core.rounds[0].deadline + 0.001)
    return theta0, torch.stack(deltas).mean(0)


@pytest.mark.parametrize("finished", [True, False])
def test_a_learner_that_finished_its_budget_stays_in_the_average(finished: bool) -> None:
    """c's bye says its budget is spent: the rounds after it hold a and b, and each moves the
    model by 2/3 of their mean, as a synchronous round with c's zero progress would; a learner
    that stopped for another reason (killed, removed) leaves the rest a whole step."""
    h = _fleet(fleet_scale=True)
    meta = {"reason": "learner finished its budget", "finished": True} if finished else {"reason": "learner stopping"}
    h.send("c", Message("bye", meta), 1.0)
    assert h.core.fleet.finished() == ({"c"} if finished else set())
    theta0, mean = _answer_call(h, ("a", "b"), 1.0)
    torch.testing.assert_close(h.core.model.theta[0], theta0 - mean * (2 / 3 if finished else 1.0), rtol=0, atol=1e-6)
    h.hello("c", 5.0)  # back (a new budget): a member again, not a finished one
    assert h.core.fleet.finished() == set()
    h.core.fleet.ending = True  # `dldctl down` began: any bye now is a finished learner
    h.send("c", Message("bye", {"reason": "learner stopping"}), 5.0)
    assert h.core.fleet.finished() == {"c"}


def test_a_round_of_a_partial_window_takes_a_partial_momentum_step() -> None:
    """Nesterov 0.7 / 0.9: a learner's last 2 steps (of H = 8) as it finishes are a quarter of a
    period, so the momentum decays by 0.9^0.25 and looks ahead by 0.225, not by 0.9."""
    h = _fleet(outer_lr=0.7, outer_momentum=0.9)
    h.core.model.momentum[0].fill_(1.0)
    theta0 = h.core.model.theta[0].clone()
    called = _call_fragment(h, 0, 1.0)
    for lid in ("a", "b", "c"):
        h.push(lid, 0, torch.zeros_like(theta0), now=called + 0.001, c_steps=2, c_tokens=32, step_time=0.01)
    (record,) = rounds_of(h.tick(called + 0.002))
    assert record["period_share"] == pytest.approx(2 / (8 * 0.8))
    decay, look = merge.partial_momentum(0.9, record["period_share"])
    torch.testing.assert_close(h.core.model.momentum[0], torch.full_like(theta0, decay))
    torch.testing.assert_close(h.core.model.theta[0], theta0 - 0.7 * look * decay, rtol=0, atol=1e-6)


def test_the_last_partial_windows_count_as_their_part_of_the_fleets_period() -> None:
    """c finished; a answers with a whole period, b with its last 2 steps (of 8, a part of
    p = 2 / (0.8 x 8)): the round is (1 + p) / 3 of the fleet's period and its token-weighted
    mean is scaled by (1 + p)^2 / (3 (1 + p^2)), to about the three members' average, instead
    of a whole step on a's and b's mean."""
    h = _fleet(fleet_scale=True)
    h.send("c", Message("bye", {"reason": "learner finished its budget", "finished": True}), 1.0)
    theta0 = h.core.model.theta[0].clone()
    called = _call_fragment(h, 0, 1.0, ("a", "b"))
    da, db = h.delta(0, 1), h.delta(0, 2)
    h.push("a", 0, da, now=called + 0.001, c_steps=8, c_tokens=128, step_time=0.01)
    h.push("b", 0, db, now=called + 0.001, c_steps=2, c_tokens=32, step_time=0.01)
    (record,) = rounds_of(h.tick(called + 0.002))
    p = 2 / 6.4
    assert record["period_share"] == pytest.approx((1 + p) / 3, abs=1e-4)
    scale = (1 + p) ** 2 / (3 * (1 + p * p))
    torch.testing.assert_close(h.core.model.theta[0], theta0 - (0.8 * da + 0.2 * db) * scale, rtol=0, atol=1e-6)


def test_a_round_of_equal_partial_windows_is_a_whole_step_on_their_mean() -> None:
    """Synchronous DiLoCo's last round: every learner's last 2 steps. Their mean is the fleet's
    average (a whole step on it), and the momentum looks ahead by the round's part of a period."""
    h = _fleet(fleet_scale=True)
    theta0 = h.core.model.theta[0].clone()
    called = _call_fragment(h, 0, 1.0)
    deltas = [h.delta(0, i) for i in range(3)]
    for lid, d in zip(("a", "b", "c"), deltas):
        h.push(lid, 0, d, now=called + 0.001, c_steps=2, c_tokens=32, step_time=0.01)
    (record,) = rounds_of(h.tick(called + 0.002))
    assert record["period_share"] == pytest.approx(2 / 6.4, abs=1e-4)
    torch.testing.assert_close(h.core.model.theta[0], theta0 - torch.stack(deltas).mean(0), rtol=0, atol=1e-6)
