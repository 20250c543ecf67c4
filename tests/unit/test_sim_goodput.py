"""The fleet simulator against hand-computed timelines and closed-form expectations.

Closed forms used (lambda = chips / MTBI, the unit's failure rate; constant rate unless said):
- data-parallel: a run after a failure lasts max(0, gap - R); with gaps Exp(lambda) the long-run
  kept share is lambda * e^(-lambda R) * C e^(-lambda C) / (1 - e^(-lambda C)).
- elastic: a failure that finds the unit running pauses it from t - u (u ~ U(0, step), the step in
  flight) to t + R and absorbs every failure before t + R: an alternating renewal process with
  run time Exp(lambda) and pause R, so uptime = 1 - (R + step/2) / (1/lambda + R); failures cost
  `domain` chips for `rec` each, about domain * lambda * rec / chips of the capacity.
- bursty rate: the same renewal formula averaged over the gamma-distributed rate of each period.
- DiLoCo: learners are independent at a constant rate, so uptime with quorum K is
  P(Binomial(M, p) >= K).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from dldctl.sim.errors import ParamError
from dldctl.sim.failures import failure_times, rate_profile
from dldctl.sim.goodput import (
    DATA_PARALLEL,
    DILOCO,
    ELASTIC,
    YEAR_S,
    FleetParams,
    expected_max_normal,
    learner_sizes,
    simulate,
    simulate_data_parallel,
    simulate_diloco,
    simulate_elastic,
)
from dldctl.sim.intervals import StepFunction, absorbing_pauses, time_with_at_least, union
from dldctl.sim.montecarlo import Spread, monte_carlo, sweep
from dldctl.units import format_duration, parse_count, parse_count_list, parse_duration, parse_sweep

pytestmark = pytest.mark.timeout(60)


class ScriptedRng:
    """A stand-in Generator that returns scripted failure times and in-flight step losses."""

    def __init__(self, times: list[float], lost: list[float] | None = None) -> None:
        self.times = np.array(times, dtype=float)
        self.lost = np.array(lost if lost is not None else [0.0] * len(times), dtype=float)
        self.calls = 0

    def poisson(self, lam: float) -> int:
        return int(self.times.size)

    def uniform(self, lo: float, hi: float, size: int) -> np.ndarray:
        self.calls += 1
        return self.times.copy() if self.calls % 2 == 1 else self.lost.copy()


def mean_over_seeds(strategy: str, params: FleetParams, seeds: int = 5) -> tuple[float, float]:
    runs = [simulate(strategy, params, np.random.default_rng(s)) for s in range(seeds)]
    return float(np.mean([r.goodput for r in runs])), float(np.mean([r.uptime for r in runs]))


# --- hand-computed timelines -------------------------------------------------------------------


def test_data_parallel_timeline_by_hand() -> None:
    # Failures at 1000 s and 5000 s, restart 600 s, checkpoints every 300 s of a run:
    # run 0..1000 keeps 900; run 1600..5000 (3400 s) keeps 3300; run 5600..10000 keeps all 4400.
    p = FleetParams(chips=1000, restart_s=600, checkpoint_every_s=300, checkpoint_cost_s=0, horizon_s=10_000, rate_cv=0)
    r = simulate_data_parallel(p, ScriptedRng([1000, 5000]))
    assert r.goodput == pytest.approx((900 + 3300 + 4400) / 10_000)
    assert r.uptime == pytest.approx(0.86)
    assert r.failures == 2


def test_data_parallel_failure_during_restart_starts_it_over() -> None:
    # The failure at 1300 s hits the restart begun at 1000 s: the job runs again only from 1900 s.
    p = FleetParams(chips=1000, restart_s=600, checkpoint_every_s=100, checkpoint_cost_s=0, horizon_s=10_000, rate_cv=0)
    r = simulate_data_parallel(p, ScriptedRng([1000, 1300]))
    assert r.uptime == pytest.approx((1000 + (10_000 - 1900)) / 10_000)


def test_data_parallel_checkpoints_cost_their_time_by_hand() -> None:
    # Cycles of 300 s of work + 10 s of checkpoint: the run 0..1000 holds 3 cycles (930 s) and
    # keeps 900; the last run 1600..10000 (8400 s) writes 27 checkpoints and keeps 8400 - 270.
    p = FleetParams(
        chips=1000, restart_s=600, checkpoint_every_s=300, checkpoint_cost_s=10, horizon_s=10_000, rate_cv=0
    )
    r = simulate_data_parallel(p, ScriptedRng([1000]))
    assert r.uptime == pytest.approx((900 + 8400 - 270) / 10_000)


def test_checkpoint_interval_is_young_daly_unless_set() -> None:
    # 100,000 chips at 1 year each fail every 315.6 s; a 2 s checkpoint: sqrt(2 * 2 * 315.6) s.
    p = FleetParams(chips=100_000, checkpoint_cost_s=2.0)
    assert p.checkpoint_interval_s() == pytest.approx(math.sqrt(4 * YEAR_S / 100_000))
    assert replace(p, checkpoint_every_s=900.0).checkpoint_interval_s() == 900.0
    assert replace(p, checkpoint_cost_s=0.0).checkpoint_interval_s() == p.step_time_s  # never below a step
    assert replace(p, mtbi_s=math.inf).checkpoint_interval_s() == math.inf


def test_elastic_timeline_by_hand() -> None:
    # One failure at 1000 s, 3 s into a step; 100 chips out until 1500 s; 20 s pauses each way.
    p = FleetParams(chips=1000, failure_domain=100, reconfig_s=20, recovery_s=500, horizon_s=10_000, rate_cv=0)
    r = simulate_elastic(p, ScriptedRng([1000], lost=[3.0]))
    # Paused 997..1020 (all chips idle), 100 short 1020..1500, then back without a pause.
    lost = 1000 * 3 + 1000 * 20 + 100 * (1500 - 1020)
    assert r.goodput == pytest.approx(1 - lost / (1000 * 10_000))
    assert r.uptime == pytest.approx(1 - 23 / 10_000)


def test_failures_during_a_pause_join_it() -> None:
    # Failures at 1000 and 1010 (inside the first pause, to 1020) and 1030 (after it).
    p = FleetParams(chips=1000, failure_domain=100, reconfig_s=20, recovery_s=500, horizon_s=10_000, rate_cv=0)
    r = simulate_elastic(p, ScriptedRng([1000, 1010, 1030], lost=[3.0, 5.0, 4.0]))
    assert r.uptime == pytest.approx(1 - (23 + 24) / 10_000)  # 997..1020 and 1026..1050
    starts, ends = absorbing_pauses(np.array([1000.0, 1010.0, 1030.0]), np.array([3.0, 5.0, 4.0]), 20.0, 10_000)
    assert starts.tolist() == [997.0, 1026.0] and ends.tolist() == [1020.0, 1050.0]
    # The lost in-flight step never reaches back into the previous pause; a zero pause absorbs nothing.
    starts, ends = absorbing_pauses(np.array([10.0, 21.0]), np.array([0.0, 5.0]), 10.0, 100)
    assert starts.tolist() == [10.0] and ends.tolist() == [31.0]
    starts, _ = absorbing_pauses(np.array([5.0, 5.0, 7.0]), np.zeros(3), 0.0, 100)
    assert starts.size == 0


def test_learner_smaller_than_failure_domain_stops_until_repaired() -> None:
    # A learner of 64 chips loses all of them: no progress from the failure until it is back.
    p = FleetParams(chips=64, failure_domain=128, learner_reconfig_s=10, recovery_s=300, horizon_s=10_000, rate_cv=0)
    r = simulate_diloco(p, ScriptedRng([2000], lost=[0.0]))
    assert r.uptime == pytest.approx(1 - 300 / 10_000)
    assert r.goodput == pytest.approx(1 - 300 / 10_000)


# --- closed forms --------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [DATA_PARALLEL, ELASTIC, DILOCO])
def test_no_failures_goodput_and_uptime_are_one(strategy) -> None:
    p = FleetParams(chips=2_400_000, learners=16, mtbi_s=math.inf)
    r = simulate(strategy, p, np.random.default_rng(0))
    assert (r.goodput, r.uptime, r.failures) == (1.0, 1.0, 0)


def test_poisson_counts_match_their_mean() -> None:
    rate, horizon = 0.05, 1000.0  # mean 50 failures per run
    counts = []
    rng = np.random.default_rng(123)
    for _ in range(2000):
        t = failure_times(rate, horizon, rng)
        assert np.all(np.diff(t) >= 0) and (t.size == 0 or (t[0] >= 0 and t[-1] < horizon))
        counts.append(t.size)
    counts = np.array(counts)
    # Standard error of the mean is sqrt(50 / 2000) = 0.16; Poisson variance equals the mean.
    assert counts.mean() == pytest.approx(50, abs=0.7)
    assert counts.var(ddof=1) == pytest.approx(50, rel=0.12)


def test_poisson_gaps_are_exponential() -> None:
    t = failure_times(2.0, 20_000.0, np.random.default_rng(7))
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(0.5, rel=0.02)
    assert np.mean(gaps > 1.0) == pytest.approx(math.exp(-2.0), abs=0.01)


def test_data_parallel_matches_renewal_closed_form() -> None:
    lam, restart, ckpt = 1 / 3600, 600.0, 900.0
    p = FleetParams(
        chips=1000,
        mtbi_s=1000 / lam,
        restart_s=restart,
        checkpoint_every_s=ckpt,
        checkpoint_cost_s=0,
        horizon_s=2000 * 3600.0,
        rate_cv=0,
    )
    expected = lam * math.exp(-lam * restart) * ckpt * math.exp(-lam * ckpt) / (1 - math.exp(-lam * ckpt))
    goodput, _ = mean_over_seeds(DATA_PARALLEL, p, seeds=4)
    assert goodput == pytest.approx(expected, abs=0.01)


def test_data_parallel_fine_checkpoints_give_exp_minus_lambda_r() -> None:
    lam, restart = 1 / 1800, 1800.0  # lambda * R = 1: e^-1 of the time is kept
    p = FleetParams(
        chips=500,
        mtbi_s=500 / lam,
        restart_s=restart,
        checkpoint_every_s=1e-3,
        checkpoint_cost_s=0,
        horizon_s=4000 * 3600.0,
        rate_cv=0,
    )
    goodput, _ = mean_over_seeds(DATA_PARALLEL, p, seeds=3)
    assert goodput == pytest.approx(math.exp(-1), abs=0.01)


def renewal_uptime(lam: Any, pause: float, step: float) -> Any:
    """Alternating renewal: runs Exp(lam) long, each ended by a pause plus the step in flight."""
    return 1 - (pause + step / 2) / (1 / lam + pause)


def test_elastic_matches_renewal_closed_form() -> None:
    n, lam, step, reconf, rec, dom = 10_000, 1 / 100, 6.0, 40.0, 600.0, 16
    p = FleetParams(
        chips=n,
        mtbi_s=n / lam,
        step_time_s=step,
        reconfig_s=reconf,
        recovery_s=rec,
        failure_domain=dom,
        horizon_s=500 * 3600.0,
        rate_cv=0,
    )
    uptime_cf = renewal_uptime(lam, reconf, step)  # 0.68 (the old double-pause rule: 0.43)
    goodput, uptime = mean_over_seeds(ELASTIC, p, seeds=4)
    assert uptime == pytest.approx(uptime_cf, abs=0.004)
    assert goodput == pytest.approx(uptime_cf * (1 - dom * lam * rec / n), abs=0.006)


def test_bursty_rate_is_the_renewal_formula_averaged_over_the_rate() -> None:
    # cv = 1: each hour's rate is exponential around the mean; the time average of the renewal
    # uptime over that distribution, by quadrature, against the simulated elastic job.
    n, lam, step, reconf = 10_000, 1 / 60, 6.0, 30.0
    p = FleetParams(
        chips=n, mtbi_s=n / lam, step_time_s=step, reconfig_s=reconf, failure_domain=1, horizon_s=400 * 3600.0
    )
    u = np.linspace(1e-6, 40.0, 400_001)
    weights = np.exp(-u) / np.exp(-u).sum()
    expected = float(np.sum(weights * np.clip(renewal_uptime(lam * u, reconf, step), 0, 1)))
    constant = renewal_uptime(lam, reconf, step)
    _, uptime = mean_over_seeds(ELASTIC, p, seeds=3)
    assert uptime == pytest.approx(expected, abs=0.01)
    assert expected > constant + 0.05  # bursts cost less than a steady rate: failures share pauses


def test_failure_rate_profile_is_overdispersed_with_the_mean_kept() -> None:
    rng = np.random.default_rng(5)
    rate, period, horizon = 0.01, 3600.0, 2000 * 3600.0  # 36 failures per period on average
    profile = rate_profile(horizon, period, 1.0, rng)
    t = failure_times(rate, horizon, rng, profile)
    counts = np.histogram(t, bins=np.arange(0, horizon + period, period))[0]
    assert counts.mean() == pytest.approx(36, rel=0.06)
    # Gamma-mixed Poisson: variance = m + cv^2 m^2 (Poisson alone: m).
    assert counts.var() == pytest.approx(36 + 36**2, rel=0.2)
    # cv = 0 draws nothing: the generator is where it was.
    a, b = np.random.default_rng(9), np.random.default_rng(9)
    assert rate_profile(horizon, period, 0.0, a).multipliers.tolist() == [1.0]
    assert a.random() == b.random()


@pytest.mark.parametrize("quorum", [1, 2, 4])
def test_diloco_quorum_uptime_is_binomial(quorum) -> None:
    m, per_learner, lam = 4, 4096, 1 / 3000
    step, reconf = 6.0, 300.0
    p = FleetParams(
        chips=m * per_learner,
        learners=m,
        quorum=quorum,
        mtbi_s=per_learner / lam,
        step_time_s=step,
        learner_reconfig_s=reconf,
        recovery_s=1200.0,
        horizon_s=300 * 3600.0,
        rate_cv=0,
    )
    up = renewal_uptime(lam, reconf, step)
    expected = sum(math.comb(m, k) * up**k * (1 - up) ** (m - k) for k in range(quorum, m + 1))
    _, uptime = mean_over_seeds(DILOCO, p, seeds=3)
    assert uptime == pytest.approx(expected, abs=0.015)


def test_quorum_changes_uptime_not_goodput() -> None:
    base = FleetParams(chips=1_200_000, learners=8, horizon_s=6 * 3600.0)
    g1, u1 = mean_over_seeds(DILOCO, base, seeds=3)
    g8, u8 = mean_over_seeds(DILOCO, replace(base, quorum=8), seeds=3)
    assert g1 == g8
    assert u8 < u1 - 0.3


# --- relations between strategies ---------------------------------------------------------------


@pytest.mark.parametrize("chips", [1000, 150_000, 1_200_000])
def test_one_learner_is_elastic_data_parallel_on_the_same_chips(chips) -> None:
    p = FleetParams(chips=chips, learners=1, horizon_s=12 * 3600.0, learner_reconfig_s=None)
    for seed in range(3):
        a = simulate_elastic(p, np.random.default_rng(seed))
        b = simulate_diloco(p, np.random.default_rng(seed))
        assert (a.goodput, a.uptime, a.failures) == (b.goodput, b.uptime, b.failures)


def test_m_learners_on_n_chips_behave_like_one_elastic_job_on_n_over_m() -> None:
    # The paper's rule of thumb; here it holds because each learner is an elastic job.
    n, m = 1_200_000, 8
    same = dict(horizon_s=48 * 3600.0, learner_reconfig_s=None)
    g_diloco, _ = mean_over_seeds(DILOCO, FleetParams(chips=n, learners=m, **same))
    g_small, _ = mean_over_seeds(ELASTIC, FleetParams(chips=n // m, **same), seeds=10)
    assert g_diloco == pytest.approx(g_small, abs=0.015)


@pytest.mark.parametrize(
    ("strategy", "chips"),
    [
        (DATA_PARALLEL, [1_000, 4_000, 16_000, 64_000]),
        (ELASTIC, [75_000, 150_000, 300_000, 600_000, 1_200_000]),
        (DILOCO, [150_000, 300_000, 600_000, 1_200_000, 2_400_000]),
    ],
)
def test_goodput_falls_as_chips_rise(strategy, chips) -> None:
    goodputs = [mean_over_seeds(strategy, FleetParams(chips=n, learners=8, horizon_s=12 * 3600.0))[0] for n in chips]
    assert all(a > b for a, b in itertools.pairwise(goodputs)), goodputs


def test_more_learners_more_goodput_at_scale() -> None:
    goodputs = [
        mean_over_seeds(DILOCO, FleetParams(chips=2_400_000, learners=m, horizon_s=6 * 3600.0))[0]
        for m in (1, 2, 4, 8, 16)
    ]
    assert all(a < b for a, b in itertools.pairwise(goodputs)), goodputs
    assert goodputs[-1] > 0.85 and goodputs[0] < 0.5


def test_stragglers_cost_synchronous_jobs_more() -> None:
    p = FleetParams(chips=1_200_000, learners=16, mtbi_s=math.inf, step_jitter=0.05)
    replicas = 1_200_000 // 128
    dp = simulate_data_parallel(p, np.random.default_rng(0))
    assert dp.goodput == pytest.approx(1 / (1 + 0.05 * expected_max_normal(replicas)))
    assert dp.uptime == 1.0
    diloco = simulate_diloco(p, np.random.default_rng(0))
    assert dp.goodput < diloco.goodput < 1.0


def test_expected_max_normal_close_to_exact_values() -> None:
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=0.05)
    assert expected_max_normal(10) == pytest.approx(1.5388, rel=0.02)
    assert expected_max_normal(10_000) > expected_max_normal(1000) > expected_max_normal(100)


# --- Monte Carlo and sweep ---------------------------------------------------------------------


def test_monte_carlo_is_deterministic_and_spread_is_ordered() -> None:
    p = FleetParams(chips=60_000, learners=4, horizon_s=6 * 3600.0)
    a = monte_carlo(p, range(6))
    b = monte_carlo(p, range(6))
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
    for s in a:
        g = s.goodput
        assert g.min <= g.p10 <= g.p50 <= g.p90 <= g.max and g.n == 6 and g.std > 0
    assert [s.strategy for s in a] == [DATA_PARALLEL, ELASTIC, DILOCO]
    assert [s.learners for s in a] == [None, None, 4]


def test_spread_of_known_values() -> None:
    s = Spread.of([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (s.mean, s.min, s.max, s.p50, s.n) == (3.0, 1.0, 5.0, 3.0, 5)
    assert s.std == pytest.approx(math.sqrt(2.5))
    assert s.p10 == pytest.approx(1.4) and s.p90 == pytest.approx(4.6)


def test_sweep_shape_and_common_random_numbers() -> None:
    base = FleetParams(chips=1, horizon_s=3 * 3600.0, learner_reconfig_s=None)  # a learner pauses as the job
    out = sweep(base, [150_000, 300_000], [1, 2, 4], range(2))
    assert len(out) == 2 * (2 + 3)
    by_key = {(s.strategy, s.chips, s.learners): s for s in out}
    for n in (150_000, 300_000):
        assert by_key[(ELASTIC, n, None)].goodput == by_key[(DILOCO, n, 1)].goodput
        # Both data-parallel strategies see the same failures.
        assert by_key[(ELASTIC, n, None)].failures == by_key[(DATA_PARALLEL, n, None)].failures


def test_full_default_sweep_is_fast() -> None:
    import time

    start = time.perf_counter()
    sweep(FleetParams(chips=1), [150_000, 300_000, 600_000, 1_200_000, 2_400_000], [1, 2, 4, 8, 16], range(3))
    assert time.perf_counter() - start < 10.0


# --- parameters, helpers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(chips=0), "chips"),
        (dict(chips=10, learners=11), "learners"),
        (dict(chips=10, learners=2, quorum=3), "quorum"),
        (dict(chips=10, mtbi_s=0), "mtbi_s"),
        (dict(chips=10, checkpoint_every_s=0), "checkpoint_every_s"),
        (dict(chips=10, horizon_s=math.inf), "horizon_s"),
        (dict(chips=10**12), "horizon_s"),
    ],
)
def test_bad_parameters_name_their_field(kwargs, field) -> None:
    with pytest.raises(ParamError) as info:
        FleetParams(**kwargs)
    assert info.value.field == field


def test_learner_sizes_cover_the_fleet_evenly() -> None:
    sizes = learner_sizes(1_000_003, 16)
    assert sum(sizes) == 1_000_003 and max(sizes) - min(sizes) == 1
    assert learner_sizes(8, 8) == [1] * 8


def test_default_mtbi_is_one_year() -> None:
    assert FleetParams(chips=1).mtbi_s == YEAR_S == 365.25 * 86400


def test_union_merges_overlaps_and_clips() -> None:
    s, e = union(np.array([5.0, 0.0, 2.0, 20.0, -3.0]), np.array([7.0, 3.0, 4.0, 30.0, 1.0]), 0.0, 25.0)
    assert s.tolist() == [0.0, 5.0, 20.0] and e.tolist() == [4.0, 7.0, 25.0]


def test_step_function_integrals() -> None:
    f = StepFunction(10.0, np.array([2.0, 5.0]), np.array([-4.0, -10.0]), hi=8.0, floor=0.0)
    # 10 on [0,2), 6 on [2,5), 0 on [5,8)
    assert f.total() == pytest.approx(20 + 18)
    assert f.integral_over(np.array([1.0]), np.array([3.0])) == pytest.approx(10 + 6)
    s, e = f.where_at_most(0.0)
    assert s.tolist() == [5.0] and e.tolist() == [8.0]


def test_time_with_at_least_k_up() -> None:
    downs_s = [np.array([0.0, 6.0]), np.array([2.0])]
    downs_e = [np.array([3.0, 7.0]), np.array([5.0])]
    # Down counts over [0,10): 1 on [0,2), 2 on [2,3), 1 on [3,5), 0 on [5,6), 1 on [6,7), 0 on [7,10)
    assert time_with_at_least(2, 2, downs_s, downs_e, 10.0) == pytest.approx(4.0)
    assert time_with_at_least(1, 2, downs_s, downs_e, 10.0) == pytest.approx(9.0)


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("30s", 30), ("5m", 300), ("1.5h", 5400), ("1d", 86400), ("800ms", 0.8)]
)
def test_parse_duration(text, seconds) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


def test_parse_counts_and_sweep() -> None:
    assert parse_count("1.2M") == 1_200_000 and parse_count("150k") == 150_000
    assert parse_count("0.3M") == 300_000
    assert parse_count_list("1,2,4,2") == [1, 2, 4]
    assert parse_sweep("chips=150000,2.4M") == ("chips", [150_000, 2_400_000])
    for bad in ("5parsecs", "-1", ""):
        with pytest.raises(ValueError):
            parse_duration(bad)
    for bad in ("1.5", "-3", "x"):
        with pytest.raises(ValueError):
            parse_count(bad)
    with pytest.raises(ValueError):
        parse_sweep("learners=1,2")
    assert format_duration(600) == "10m" and format_duration(20) == "20s"
