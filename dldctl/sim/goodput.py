"""Goodput and uptime of one training job at fleet scale under three ways of handling failures.

A pure discrete-event simulation: parameters and a numpy `Generator` go in, numbers come out. It
simulates failure *events*, never chips: the chips of a job (or of one learner) fail as one
Poisson process of rate chips / MTBI, so a million chips cost no more than the failures they have.

The three strategies (docs/simulate.md states the assumptions at length):

- **data-parallel** (no elasticity): every failure stops the whole job; it restarts from its last
  checkpoint, which takes `restart_s`. All chips must come up together, so a failure during the
  restart starts the restart over. Work since the last checkpoint is lost.
- **elastic data-parallel**: a failure costs the in-flight step and a whole-job reconfiguration
  pause (`reconfig_s`); the job then runs without the failed replica (`failure_domain` chips)
  until it is back (`recovery_s` after the failure), then pauses again to scale back up.
- **Decoupled DiLoCo**: M learners of N/M chips, each one an elastic job of its own; a failure
  touches only its learner. Work done while fewer than `quorum` learners are up is merged later,
  so the quorum shapes uptime (global progress), not goodput.

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
from dldctl.sim.intervals import StepFunction, time_with_at_least, union

YEAR_S = 365.25 * 86400.0
DATA_PARALLEL = "data_parallel"
ELASTIC = "elastic_data_parallel"
DILOCO = "decoupled_diloco"
STRATEGIES = (DATA_PARALLEL, ELASTIC, DILOCO)
MAX_EXPECTED_FAILURES = 5_000_000  # a run holds a few float arrays of this length


@dataclass(frozen=True)
class FleetParams:
    """One job on one fleet. Times in seconds; defaults and their sources are in docs/simulate.md."""

    chips: int
    learners: int = 1
    mtbi_s: float = YEAR_S  # mean time between interruptions, per chip
    step_time_s: float = 6.0
    step_jitter: float = 0.0  # coefficient of variation of one replica's step time
    recovery_s: float = 1800.0  # failure until the failed replica is back in service
    reconfig_s: float = 20.0  # whole-job pause to shrink or grow an elastic job
    restart_s: float = 600.0  # non-elastic job: restart from the last checkpoint
    checkpoint_every_s: float = 1800.0
    failure_domain: int = 128  # chips one failure takes out (its model-parallel replica)
    quorum: int = 1
    horizon_s: float = 24 * 3600.0

    def __post_init__(self) -> None:
        check(self.problems())

    def problems(self) -> list[tuple[str, str]]:
        """(field, problem) for every value out of range; empty when the set is valid."""
        checks = [
            ("chips", self.chips >= 1, "must be >= 1"),
            ("learners", 1 <= self.learners <= self.chips, "must be between 1 and chips"),
            ("mtbi_s", self.mtbi_s > 0, "must be > 0"),
            ("step_time_s", self.step_time_s > 0, "must be > 0"),
            ("step_jitter", self.step_jitter >= 0, "must be >= 0"),
            ("recovery_s", self.recovery_s >= 0, "must be >= 0"),
            ("reconfig_s", self.reconfig_s >= 0, "must be >= 0"),
            ("restart_s", self.restart_s >= 0, "must be >= 0"),
            ("checkpoint_every_s", self.checkpoint_every_s > 0, "must be > 0"),
            ("failure_domain", self.failure_domain >= 1, "must be >= 1"),
            ("quorum", 1 <= self.quorum <= self.learners, "must be between 1 and learners"),
            ("horizon_s", 0 < self.horizon_s < math.inf, "must be > 0 and finite"),
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


@dataclass(frozen=True)
class RunResult:
    """One strategy, one random draw."""

    strategy: str
    goodput: float
    uptime: float
    failures: int


def failure_times(rate_per_s: float, horizon_s: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted event times of a Poisson process of the given rate on [0, horizon_s).

    Drawn as a Poisson count and then that many uniform times, which is the same process as
    summing exponential gaps (conditional uniformity), in two numpy calls.
    """
    if rate_per_s <= 0.0:
        return np.empty(0)
    count = rng.poisson(rate_per_s * horizon_s)
    return np.sort(rng.uniform(0.0, horizon_s, size=count))


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


def simulate_data_parallel(params: FleetParams, rng: np.random.Generator) -> RunResult:
    """A non-elastic synchronous job: each failure costs a restart and the work since the checkpoint."""
    return data_parallel_timeline(params, failure_times(params.chips / params.mtbi_s, params.horizon_s, rng))


def data_parallel_timeline(params: FleetParams, t: np.ndarray) -> RunResult:
    """Account a non-elastic job given its sorted failure times `t`.

    After the failure at t_i the restart ends at t_i + restart_s unless the next failure comes
    first (which starts it over), so the run after failure i lasts max(0, gap_i - restart_s); of a
    run of length r, floor(r / C) * C survives the next failure. The run still going at the horizon
    keeps all its work.
    """
    horizon = params.horizon_s
    c = params.checkpoint_every_s
    starts = np.concatenate(([0.0], t + params.restart_s))
    ends = np.append(t, horizon)
    runs = np.maximum(0.0, ends - starts)
    kept = np.floor(runs[:-1] / c) * c
    useful_s = float(np.sum(kept)) + runs[-1]
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


def _elastic_unit(chips: int, params: FleetParams, rng: np.random.Generator) -> UnitRun:
    """Simulate one elastic data-parallel unit of `chips` chips: draw its failures, account them."""
    t = failure_times(chips / params.mtbi_s, params.horizon_s, rng)
    # Each failure lands somewhere in a step: the part of that step already done is lost.
    lost = rng.uniform(0.0, params.step_time_s, size=t.size)
    return elastic_timeline(chips, params, t, lost)


def elastic_timeline(chips: int, params: FleetParams, t: np.ndarray, lost: np.ndarray) -> UnitRun:
    """Account one elastic unit given its failure times `t` and the in-flight step time `lost`.

    Failure i at t_i: the step in flight (started lost_i earlier) is wasted, the unit pauses until
    t_i + reconfig; it runs short of `domain` chips until t_i + recovery, then pauses reconfig
    again to take them back. Overlapping pauses merge.
    """
    horizon = params.horizon_s
    back = t + params.recovery_s
    pause_s, pause_e = union(
        np.concatenate((t - lost, back)),
        np.concatenate((t + params.reconfig_s, back + params.reconfig_s)),
        0.0,
        horizon,
    )
    domain = min(params.failure_domain, chips)
    capacity = StepFunction(
        float(chips),
        np.concatenate((t, back)),
        np.concatenate((np.full(t.size, -domain), np.full(t.size, domain))),
        horizon,
        floor=0.0,
    )
    # With every chip gone the unit makes no progress even when it is not pausing.
    empty_s, empty_e = capacity.where_at_most(0.0)
    down_s, down_e = union(np.concatenate((pause_s, empty_s)), np.concatenate((pause_e, empty_e)), 0.0, horizon)
    useful = capacity.total() - capacity.integral_over(down_s, down_e)
    return UnitRun(useful, down_s, down_e, int(t.size))


def _units(strategy: str, sizes: list[int], quorum: int, params: FleetParams, rng: np.random.Generator) -> RunResult:
    """Independent elastic units of the given sizes; progress needs `quorum` of them up."""
    horizon = params.horizon_s
    units = [_elastic_unit(size, params, rng) for size in sizes]
    useful = sum(u.useful_chip_s * straggler_efficiency(size, params) for u, size in zip(units, sizes))
    up_s = time_with_at_least(quorum, len(units), [u.down_starts for u in units], [u.down_ends for u in units], horizon)
    failures = sum(u.failures for u in units)
    return RunResult(strategy, useful / (params.chips * horizon), up_s / horizon, failures)


def simulate_elastic(params: FleetParams, rng: np.random.Generator) -> RunResult:
    """Elastic data-parallel: the whole fleet is one elastic unit."""
    return _units(ELASTIC, [params.chips], 1, params, rng)


def simulate_diloco(params: FleetParams, rng: np.random.Generator) -> RunResult:
    """Decoupled DiLoCo: `learners` independent elastic units of about chips/learners each.

    With one learner this is exactly the elastic job: same units, same draws.
    """
    return _units(DILOCO, learner_sizes(params.chips, params.learners), params.quorum, params, rng)


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
