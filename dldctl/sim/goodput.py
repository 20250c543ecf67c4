"""Goodput and uptime of one training job at fleet scale under three ways of handling failures.

A pure discrete-event simulation: parameters and a numpy `Generator` go in, numbers come out. It
simulates failure *events*, never chips: the chips of a job (or of one learner) fail as one
Poisson process of mean rate chips / MTBI whose rate varies from hour to hour (`failures.py`), so
a million chips cost no more than the failures they have.

The three strategies (docs/simulate.md states each assumption and its reason), each with exactly
one time constant that `calibrate.py` fits to a reference table:

- **data-parallel** (no elasticity): every failure stops the whole job; it restarts from its last
  checkpoint, which takes `restart_s`. All chips must come up together, so a failure during the
  restart starts the restart over. Work since the last checkpoint is lost; the job checkpoints at
  the Young/Daly interval for its failure rate and `checkpoint_cost_s` unless told otherwise.
- **elastic data-parallel**: a failure costs the in-flight step and one whole-job
  reconfiguration pause (`reconfig_s`) that drops every replica found failed before it ends, so
  a failure during a pause costs no second pause. The job runs without the failed replica
  (`failure_domain` chips) until it is back (`recovery_s` after the failure); the replica heals
  from a peer while the others train, so growing back costs no pause.
- **Decoupled DiLoCo**: M learners of N/M chips, each one an elastic job of its own (pause
  `learner_reconfig_s`); a failure touches only its learner. Work done while fewer than `quorum`
  learners are up is merged later, so the quorum shapes uptime (global progress), not goodput.

goodput = useful chip-time / provisioned chip-time; uptime = share of wall time during which the
global model makes progress. Step-time jitter is folded in as the expected slowdown of a
synchronous step that waits for the slowest of its data-parallel replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from dldctl.sim.errors import check
from dldctl.sim.failures import RateProfile, failure_times, rate_profile
from dldctl.sim.intervals import StepFunction, absorbing_pauses, time_with_at_least, union

YEAR_S = 365.25 * 86400.0
DATA_PARALLEL = "data_parallel"
ELASTIC = "elastic_data_parallel"
DILOCO = "decoupled_diloco"
STRATEGIES = (DATA_PARALLEL, ELASTIC, DILOCO)
MAX_EXPECTED_FAILURES = 5_000_000  # a run holds a few float arrays of this length


# The defaults of the three time constants: fitted by `dldctl simulate calibrate` to the
# Decoupled DiLoCo paper's goodput table at 150k chips (bench/sim_vs_paper.py, BENCHMARKS.md).
CALIBRATED_RESTART_S = 52.9
CALIBRATED_RECONFIG_S = 24.6
CALIBRATED_LEARNER_RECONFIG_S = 20.6


@dataclass(frozen=True)
class FleetParams:
    """One job on one fleet. Times in seconds; defaults and their sources are in docs/simulate.md."""

    chips: int
    learners: int = 1
    mtbi_s: float = YEAR_S  # mean time between interruptions, per chip
    step_time_s: float = 6.0
    step_jitter: float = 0.0  # coefficient of variation of one replica's step time
    recovery_s: float = 1800.0  # failure until the failed replica is back in service
    reconfig_s: float = CALIBRATED_RECONFIG_S  # elastic job: the pause to drop failed replicas
    restart_s: float = CALIBRATED_RESTART_S  # non-elastic job: restart from the last checkpoint
    checkpoint_every_s: float | None = None  # None: the Young/Daly interval for the failure rate
    checkpoint_cost_s: float = 1.0  # the time a checkpoint blocks a data-parallel job
    failure_domain: int = 128  # chips one failure takes out (its model-parallel replica)
    quorum: int = 1
    horizon_s: float = 24 * 3600.0
    learner_reconfig_s: float | None = CALIBRATED_LEARNER_RECONFIG_S  # None: reconfig_s
    rate_cv: float = 1.0  # coefficient of variation of the fleet's failure rate between periods
    rate_period_s: float = 3600.0  # how long one failure rate holds

    def __post_init__(self) -> None:
        check(self.problems())

    def problems(self) -> list[tuple[str, str]]:
        """(field, problem) for every value out of range; empty when the set is valid."""
        every = self.checkpoint_every_s
        learner = self.learner_reconfig_s
        checks = [
            ("chips", self.chips >= 1, "must be >= 1"),
            ("learners", 1 <= self.learners <= self.chips, "must be between 1 and chips"),
            ("mtbi_s", self.mtbi_s > 0, "must be > 0"),
            ("step_time_s", self.step_time_s > 0, "must be > 0"),
            ("step_jitter", self.step_jitter >= 0, "must be >= 0"),
            ("recovery_s", self.recovery_s >= 0, "must be >= 0"),
            ("reconfig_s", self.reconfig_s >= 0, "must be >= 0"),
            ("learner_reconfig_s", learner is None or learner >= 0, "must be >= 0"),
            ("restart_s", self.restart_s >= 0, "must be >= 0"),
            ("checkpoint_every_s", every is None or every > 0, "must be > 0"),
            ("checkpoint_cost_s", 0 <= self.checkpoint_cost_s < math.inf, "must be >= 0 and finite"),
            ("failure_domain", self.failure_domain >= 1, "must be >= 1"),
            ("quorum", 1 <= self.quorum <= self.learners, "must be between 1 and learners"),
            ("horizon_s", 0 < self.horizon_s < math.inf, "must be > 0 and finite"),
            ("rate_cv", 0 <= self.rate_cv <= 10, "must be between 0 and 10"),
            ("rate_period_s", 0 < self.rate_period_s < math.inf, "must be > 0 and finite"),
        ]
        problems = [(name, why) for name, ok, why in checks if not ok]
        if not problems and self.expected_failures() > MAX_EXPECTED_FAILURES:
            problems.append(
                (
                    "horizon_s",
                    f"gives {self.expected_failures():.3g} failures per run "
                    f"with these chips and MTBI, over the {MAX_EXPECTED_FAILURES:.0e} "
                    "a run can hold: shorten it",
                )
            )
        return problems

    def expected_failures(self) -> float:
        """Mean number of chip failures in the whole fleet over the horizon."""
        return self.chips * self.horizon_s / self.mtbi_s

    def learner_pause_s(self) -> float:
        """A learner's reconfiguration pause: its own constant, or the elastic job's."""
        return self.reconfig_s if self.learner_reconfig_s is None else self.learner_reconfig_s

    def checkpoint_interval_s(self) -> float:
        """Work between two checkpoints of the data-parallel job: the user's, or Young/Daly's.

        Young/Daly: sqrt(2 x checkpoint cost x the job's mean time between failures), the
        interval that minimizes checkpoint time plus lost work; never below one step (a job
        checkpoints between steps) and infinite when nothing fails.
        """
        if self.checkpoint_every_s is not None:
            return self.checkpoint_every_s
        if math.isinf(self.mtbi_s):
            return math.inf
        return max(self.step_time_s, math.sqrt(2.0 * self.checkpoint_cost_s * self.mtbi_s / self.chips))


@dataclass(frozen=True)
class RunResult:
    """One strategy, one random draw."""

    strategy: str
    goodput: float
    uptime: float
    failures: int


def expected_max_normal(n: int) -> float:
    """E[max of n iid standard normals], by Blom's approximation (exact 0 for n = 1)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def straggler_efficiency(chips: int, params: FleetParams) -> float:
    """Share of a synchronous job's time spent on the mean step, the rest waiting for stragglers.

    Each data-parallel replica's step takes step_time * (1 + jitter * Z); a synchronous step ends
    with the slowest of the job's replicas.
    """
    replicas = max(1, chips // params.failure_domain)
    return 1.0 / (1.0 + params.step_jitter * expected_max_normal(replicas))


def learner_sizes(chips: int, learners: int) -> list[int]:
    """Chips per learner: as even as possible, the first ones take the remainder."""
    base, extra = divmod(chips, learners)
    return [base + (1 if i < extra else 0) for i in range(learners)]


def fleet_profile(params: FleetParams, rng: np.random.Generator) -> RateProfile:
    """The run's failure-rate multipliers, shared by every unit of the fleet (drawn first)."""
    return rate_profile(params.horizon_s, params.rate_period_s, params.rate_cv, rng)


def simulate_data_parallel(params: FleetParams, rng: np.random.Generator) -> RunResult:
    """A non-elastic synchronous job: each failure costs a restart and the work since the checkpoint."""
    profile = fleet_profile(params, rng)
    return data_parallel_timeline(params, failure_times(params.chips / params.mtbi_s, params.horizon_s, rng, profile))


def data_parallel_timeline(params: FleetParams, t: np.ndarray) -> RunResult:
    """Account a non-elastic job given its sorted failure times `t`.

    After the failure at t_i the restart ends at t_i + restart_s unless the next failure comes
    first (which starts it over), so the run after failure i lasts max(0, gap_i - restart_s). A run
    is cycles of C seconds of work and one checkpoint of cost d; of a run of length r,
    floor(r / (C + d)) * C survives the next failure. The run still going at the horizon keeps its
    work, less the checkpoints it wrote.
    """
    horizon = params.horizon_s
    c, d = params.checkpoint_interval_s(), params.checkpoint_cost_s
    starts = np.concatenate(([0.0], t + params.restart_s))
    ends = np.append(t, horizon)
    runs = np.maximum(0.0, ends - starts)
    kept = np.floor(runs[:-1] / (c + d)) * c if math.isfinite(c) else np.zeros(runs.size - 1)
    last = runs[-1] - (math.floor(runs[-1] / (c + d)) * d if math.isfinite(c) else 0.0)
    useful_s = float(np.sum(kept)) + last
    uptime = useful_s / horizon
    goodput = uptime * straggler_efficiency(params.chips, params)
    return RunResult(DATA_PARALLEL, goodput, uptime, int(t.size))


@dataclass(frozen=True)
class UnitRun:
    """What one elastic unit (a whole elastic job, or one learner) did over the horizon."""

    useful_chip_s: float
    down_starts: np.ndarray  # disjoint intervals with no progress (paused, or no chips left)
    down_ends: np.ndarray
    failures: int


def _elastic_unit(
    chips: int, pause_s: float, params: FleetParams, profile: RateProfile, rng: np.random.Generator
) -> UnitRun:
    """Simulate one elastic data-parallel unit of `chips` chips: draw its failures, account them."""
    t = failure_times(chips / params.mtbi_s, params.horizon_s, rng, profile)
    # Each failure lands somewhere in a step: the part of that step already done is lost.
    lost = rng.uniform(0.0, params.step_time_s, size=t.size)
    return elastic_timeline(chips, pause_s, params, t, lost)


def elastic_timeline(chips: int, pause_s: float, params: FleetParams, t: np.ndarray, lost: np.ndarray) -> UnitRun:
    """Account one elastic unit given its failure times `t` and the in-flight step time `lost`.

    A failure while the unit runs wastes the step in flight (started lost_i earlier) and pauses
    the unit for `pause_s`; failures during a pause are dropped by the same reconfiguration.
    Each failure's replica (`domain` chips) is out until t_i + recovery; it rejoins without a
    pause. With every chip gone the unit makes no progress even when it is not pausing.
    """
    horizon = params.horizon_s
    pause_s_, pause_e = absorbing_pauses(t, lost, pause_s, horizon)
    domain = min(params.failure_domain, chips)
    back = t + params.recovery_s
    capacity = StepFunction(
        float(chips),
        np.concatenate((t, back)),
        np.concatenate((np.full(t.size, -domain), np.full(t.size, domain))),
        horizon,
        floor=0.0,
    )
    empty_s, empty_e = capacity.where_at_most(0.0)
    down_s, down_e = union(np.concatenate((pause_s_, empty_s)), np.concatenate((pause_e, empty_e)), 0.0, horizon)
    useful = capacity.total() - capacity.integral_over(down_s, down_e)
    return UnitRun(useful, down_s, down_e, int(t.size))


def _units(strategy: str, sizes: list[int], pause_s: float, params: FleetParams, rng: np.random.Generator) -> RunResult:
    """Independent elastic units of the given sizes under one fleet-wide rate profile."""
    horizon = params.horizon_s
    profile = fleet_profile(params, rng)
    units = [_elastic_unit(size, pause_s, params, profile, rng) for size in sizes]
    useful = sum(u.useful_chip_s * straggler_efficiency(size, params) for u, size in zip(units, sizes))
    quorum = params.quorum if strategy == DILOCO else 1
    up_s = time_with_at_least(quorum, len(units), [u.down_starts for u in units], [u.down_ends for u in units], horizon)
    failures = sum(u.failures for u in units)
    return RunResult(strategy, useful / (params.chips * horizon), up_s / horizon, failures)


def simulate_elastic(params: FleetParams, rng: np.random.Generator) -> RunResult:
    """Elastic data-parallel: the whole fleet is one elastic unit."""
    return _units(ELASTIC, [params.chips], params.reconfig_s, params, rng)


def simulate_diloco(params: FleetParams, rng: np.random.Generator) -> RunResult:
    """Decoupled DiLoCo: `learners` independent elastic units of about chips/learners each.

    With one learner and the same pause this is exactly the elastic job: same units, same draws.
    """
    sizes = learner_sizes(params.chips, params.learners)
    return _units(DILOCO, sizes, params.learner_pause_s(), params, rng)


SIMULATORS = {
    DATA_PARALLEL: simulate_data_parallel,
    ELASTIC: simulate_elastic,
    DILOCO: simulate_diloco,
}


def simulate(strategy: str, params: FleetParams, rng: np.random.Generator) -> RunResult:
    """Run one strategy once with the given generator."""
    if strategy not in SIMULATORS:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    return SIMULATORS[strategy](params, rng)
