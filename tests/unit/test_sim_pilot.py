"""The pilot-run planner's pure core (dldctl/sim/pilot.py): goodput under a monkey, the wire."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dldctl.sim.errors import ParamError
from dldctl.sim.pilot import (
    FaultCost,
    GoodputPilot,
    Hit,
    Spares,
    WirePilot,
    account,
    draw_hits,
    next_spare,
    predict_goodput,
    predict_wire,
)


def pilot(goodput: float = 0.9, faults: tuple[FaultCost, ...] = (FaultCost("pause", 5.0),) * 10) -> GoodputPilot:
    return GoodputPilot(learners=4, window_s=200.0, goodput=goodput, faults=faults)


def test_a_fault_costs_its_down_time_and_lost_work_of_the_fleet_time() -> None:
    g, landed = account(1.0, 4, 100.0, [Hit(10.0, 0, 8.0, 2.0)])
    assert landed == 1
    assert g == pytest.approx(1 - 10.0 / 400.0)


def test_a_fault_on_a_learner_without_a_process_is_absorbed_and_one_that_is_down_extends_it() -> None:
    """A kill at 10 (no process for 1 s, down 8 s); a kill at 10.5 finds no process; a pause at 12
    (down 8 s) lands on the restarted process and keeps it down until 20; another learner's at 13."""
    hits = [
        Hit(10.0, 0, 8.0, 0.0, "kill", gone_s=1.0),
        Hit(10.5, 0, 8.0, 0.0, "kill", gone_s=1.0),
        Hit(12.0, 0, 8.0, 0.0, "pause"),
        Hit(13.0, 1, 8.0, 0.0, "pause"),
    ]
    g, landed = account(1.0, 2, 100.0, hits)
    assert landed == 3
    assert g == pytest.approx(1 - (10.0 + 8.0) / 200.0)


def test_down_time_past_the_horizon_is_cut_at_it() -> None:
    g, _ = account(0.5, 1, 100.0, [Hit(95.0, 0, 30.0, 0.0), Hit(101.0, 0, 1.0, 0.0)])
    assert g == pytest.approx(0.5 * (1 - 5.0 / 100.0))


def test_the_efficiency_reproduces_the_pilots_own_goodput() -> None:
    p = pilot(0.8)
    assert p.cost_share() == pytest.approx(50.0 / 800.0)
    assert p.efficiency() == pytest.approx(0.8 / (1 - 50.0 / 800.0))
    hits = [Hit(float(i * 20), i % 4, 5.0, 0.0) for i in range(10)]  # its own schedule, no overlaps
    assert account(p.efficiency(), 4, 200.0, hits)[0] == pytest.approx(0.8)
    assert p.mtbf_s == pytest.approx(20.0)
    assert p.kinds() == {"pause": 10}


def test_without_faults_the_prediction_is_the_efficiency_exactly() -> None:
    pred = predict_goodput(pilot(0.8), 16, math.inf, 3600.0, range(5))
    assert pred.goodput.mean == pytest.approx(pilot(0.8).efficiency())
    assert pred.goodput.min == pred.goodput.max
    assert pred.faults.mean == 0.0


def test_a_rare_fault_prediction_matches_the_closed_form() -> None:
    """At a low rate (little absorption) the mean is e x (1 - rate x mean cost / learners)."""
    faults = (FaultCost("kill", 4.0, 1.0), FaultCost("pause", 5.0), FaultCost("kill", 6.0, 1.0))
    p = GoodputPilot(4, 300.0, 0.9, faults)
    pred = predict_goodput(p, 8, 200.0, 36_000.0, range(40))
    kinds = {"kill": (5.0 + 7.0) / 2, "pause": 5.0}  # a kind drawn uniformly, then a fault of it
    mean_cost = sum(kinds.values()) / 2
    expected = p.efficiency() * (1 - mean_cost / 200.0 / 8)
    assert pred.goodput.mean == pytest.approx(expected, rel=2e-3)
    assert pred.faults.mean == pytest.approx(180.0, rel=0.05)


def test_more_faults_or_fewer_learners_cost_more_and_seeds_repeat() -> None:
    p = pilot(0.9)
    base = predict_goodput(p, 4, 20.0, 600.0, range(30)).goodput.mean
    assert predict_goodput(p, 4, 10.0, 600.0, range(30)).goodput.mean < base
    assert predict_goodput(p, 2, 20.0, 600.0, range(30)).goodput.mean < base
    again = predict_goodput(p, 4, 20.0, 600.0, range(30)).goodput.mean
    assert again == base


def test_draws_use_only_the_kinds_and_costs_the_pilot_saw() -> None:
    faults = (FaultCost("kill", 3.0, 0.5), FaultCost("pause", 5.0))
    hits = draw_hits(GoodputPilot(2, 100.0, 0.9, faults), 3, 1.0, 500.0, np.random.default_rng(0))
    assert 400 < len(hits) < 600
    assert {(h.down_s, h.lost_s) for h in hits} == {(3.0, 0.5), (5.0, 0.0)}
    assert {h.victim for h in hits} == {0, 1, 2}
    assert [h.t for h in hits] == sorted(h.t for h in hits)


def test_bad_plans_name_the_field() -> None:
    with pytest.raises(ParamError, match="learners"):
        predict_goodput(pilot(), 0, 10.0, 100.0, [0])
    with pytest.raises(ParamError, match="horizon_s"):
        predict_goodput(pilot(), 4, 10.0, math.inf, [0])
    with pytest.raises(ParamError, match="goodput"):
        GoodputPilot(4, 100.0, 1.5, ())


def wire(**kw: float) -> WirePilot:
    base = dict(sites=4, step_s=0.1, H=32, fragments=4, max_lag=2, up_bytes=10_000.0, down_bytes=10_000.0)
    base.update(kw)
    return WirePilot(blocked=0.01, time_to_target_s=50.0, **base)  # type: ignore[arg-type]


def test_a_learner_that_never_waits_keeps_its_pace_on_any_link_and_merges_pushes_on_a_thin_one() -> None:
    """max_lag 0: a push of 80 kbit every 0.8 s; at 1 Mbit/s the link is busy 10% of the time, at
    0.05 Mbit/s 200%: unsent pushes are merged into the next, the learner computes on."""
    free = wire(max_lag=0)
    ok, thin = predict_wire(free, 1e6), predict_wire(free, 0.05e6)
    assert ok.link_busy == pytest.approx(0.1) and not ok.coalesced
    assert thin.link_busy == pytest.approx(2.0) and thin.coalesced
    assert ok.busy == thin.busy == pytest.approx(0.99)  # the pilot's own floor
    assert thin.time_to_target_s == pytest.approx(50.0)


def test_a_fast_link_blocks_nothing_and_keeps_the_pilots_pace() -> None:
    pred = predict_wire(wire(), 1e9)
    assert pred.busy == pytest.approx(0.99) and pred.blocked == pytest.approx(0.01)  # the pilot's own floor
    assert pred.time_to_target_s == pytest.approx(50.0)


def test_a_learner_that_waits_is_blocked_by_what_the_round_trip_does_not_hide() -> None:
    """max_lag 2: 80 kbit up + 80 kbit down = 0.16 s at 1 Mbit/s; 2 steps hide 0.2 s: nothing.
    At 0.5 Mbit/s: 0.32 s, 0.12 s stalls per 0.8 s of steps: busy 0.8 / 0.92."""
    assert predict_wire(wire(), 1e6).blocked == pytest.approx(0.01)
    slow = predict_wire(wire(), 0.5e6)
    assert slow.busy == pytest.approx(0.99 * 0.8 / 0.92)
    assert slow.time_to_target_s == pytest.approx(50.0 / (0.8 / 0.92))


def test_a_capped_syncer_shares_its_egress_among_the_sites() -> None:
    """The replies to all 4 sites share the syncer's 1 Mbit/s: 0.08 + 4 x 0.08 = 0.4 s, 0.2 s stall."""
    pred = predict_wire(wire(), 1e6, 1e6)
    assert pred.busy == pytest.approx(0.99 * 0.8 / 1.0)
    assert pred.link_busy == pytest.approx(0.32 / 0.8)  # the busier way: the replies down
    with pytest.raises(ParamError, match="link_bps"):
        predict_wire(wire(), 0.0)


def test_a_kill_soon_after_another_on_its_host_waits_for_the_next_spare() -> None:
    """Warm 1 s, a delay of 1 s, a start-up of 5 s, the 30 s retry guard: after a kill at 0 the
    host's next spare starts at 1 and is ready at 6; a kill at 2 on the same host waits 4 s for
    it, one on the other host does not; the spare after that may start only at 31, so a kill at
    20 starts a fresh process (1 + 5 s) and one at 40 finds the spare started at 31 ready."""
    spares = Spares(per_host=2, cold_start_s=5.0, delay_s=1.0, retry_s=30.0)
    kills = [(0.0, 0), (2.0, 1), (3.0, 2), (20.0, 1), (40.0, 0)]
    g, _ = account(1.0, 4, 100.0, [Hit(t, v, 1.0, 0.0, "kill") for t, v in kills], spares)
    assert g == pytest.approx(1 - (1 + 4 + 1 + 6 + 1) / 400.0)
    early = account(1.0, 4, 100.0, [Hit(0.0, 0, 1.0, 0.0, "kill"), Hit(0.5, 1, 1.0, 0.0, "kill")], spares)[0]
    assert early == pytest.approx(1 - (1 + 6) / 400.0)  # no spare yet: a fresh process, 1 + 5 s
    paused = account(1.0, 4, 100.0, [Hit(0.0, 0, 1.0, 0.0, "kill"), Hit(2.0, 1, 5.0, 0.0, "pause")], spares)[0]
    assert paused == pytest.approx(1 - 6 / 400.0)  # a pause needs no spare


def test_the_next_spare_follows_the_supervisors_rule() -> None:
    assert next_spare(-math.inf, 10.0, 1.0, 30.0) == 11.0  # a spare long ready: a second after
    assert next_spare(5.0, 10.0, 1.0, 30.0) == 35.0  # the last one started at 5: not before 35
    assert next_spare(35.0, 20.0, 1.0, 30.0) == 35.0  # one is due at 35 already: still then


def test_with_spares_a_kill_costs_what_a_ready_spare_cost_in_the_pilot() -> None:
    faults = (FaultCost("kill", 1.0, 0.0, spare_ready=True), FaultCost("kill", 9.0, 0.0), FaultCost("pause", 5.0))
    p = GoodputPilot(4, 100.0, 0.9, faults, Spares(2, 5.0))
    hits = draw_hits(p, 4, 1.0, 300.0, np.random.default_rng(1))
    assert {h.down_s for h in hits if h.kind == "kill"} == {1.0}
    assert {h.down_s for h in hits if h.kind == "pause"} == {5.0}
    without = GoodputPilot(4, 100.0, 0.9, faults)
    assert {h.down_s for h in draw_hits(without, 4, 1.0, 300.0, np.random.default_rng(1)) if h.kind == "kill"} == {
        1.0,
        9.0,
    }
