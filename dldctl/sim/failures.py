"""When chips fail: a Poisson process whose rate varies from period to period (pure, numpy only).

A fleet does not fail at a constant rate. Failure logs of large machines show failures in bursts
(a bad firmware roll-out, a hot week, a batch of weak parts, a software bug that hits every
node): the number of failures per day is far more variable than a constant-rate Poisson process
allows, and the time between failures has a decreasing hazard rather than an exponential one
(docs/simulate.md, "Failures"). The simulator models that as a *mixed* Poisson process: the
horizon is cut into periods (`rate_period_s`, an hour by default), each period's rate is the mean
rate (chips / MTBI) times a multiplier drawn from a gamma distribution of mean 1 and coefficient
of variation `rate_cv`, and failures inside a period are Poisson at that rate. `rate_cv = 0` is
the constant-rate process. The multipliers are the fleet's: every learner of a run sees the same
bad hours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RateProfile:
    """The fleet's failure-rate multiplier for each period of the horizon (mean 1)."""

    period_s: float
    multipliers: np.ndarray  # one per period; constant 1 for a constant-rate process

    @classmethod
    def constant(cls, horizon_s: float) -> RateProfile:
        """One period covering the whole horizon at the mean rate."""
        return cls(max(horizon_s, 1e-9), np.ones(1))

    def periods(self, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
        """(start, length) of each period, the last one cut at the horizon."""
        starts = np.arange(self.multipliers.size) * self.period_s
        lengths = np.minimum(self.period_s, horizon_s - starts)
        return starts, np.maximum(lengths, 0.0)


def rate_profile(horizon_s: float, period_s: float, cv: float, rng: np.random.Generator) -> RateProfile:
    """Draw the multipliers of one run: gamma with mean 1 and coefficient of variation `cv`.

    With cv = 0 nothing is drawn (the generator is left untouched), so a constant-rate run makes
    exactly the draws it always did.
    """
    if cv <= 0.0:
        return RateProfile.constant(horizon_s)
    count = max(1, math.ceil(horizon_s / period_s))
    shape = 1.0 / (cv * cv)
    return RateProfile(period_s, rng.gamma(shape, 1.0 / shape, size=count))


def failure_times(
    rate_per_s: float, horizon_s: float, rng: np.random.Generator, profile: RateProfile | None = None
) -> np.ndarray:
    """Sorted failure times on [0, horizon_s) of a Poisson process of mean rate `rate_per_s`.

    Per period: a Poisson count at that period's rate, then that many uniform times inside it
    (the same process as summing exponential gaps, by conditional uniformity). Without a profile
    the rate is constant: one count and one uniform draw, two numpy calls.
    """
    if rate_per_s <= 0.0:
        return np.empty(0)
    if profile is None or profile.multipliers.size == 1:
        scale = 1.0 if profile is None else float(profile.multipliers[0])
        count = rng.poisson(rate_per_s * scale * horizon_s)
        return np.sort(rng.uniform(0.0, horizon_s, size=count))
    starts, lengths = profile.periods(horizon_s)
    counts = rng.poisson(rate_per_s * profile.multipliers * lengths)
    offsets = rng.uniform(0.0, 1.0, size=int(counts.sum()))
    times = np.repeat(starts, counts) + offsets * np.repeat(lengths, counts)
    return np.sort(times)
