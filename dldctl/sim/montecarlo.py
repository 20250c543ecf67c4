"""Monte Carlo spread and sweeps over the fleet simulator (pure: seeds in, summaries out).

Every strategy gets its own generator built from the same seed ("common random numbers"): the
data-parallel and elastic jobs see the very same failure times, and Decoupled DiLoCo with one
learner reproduces the elastic job exactly, so differences in a table come from the strategies,
not from luck.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from dldctl.sim.goodput import DILOCO, STRATEGIES, FleetParams, RunResult, simulate


@dataclass(frozen=True)
class Spread:
    """Mean and spread of one metric over Monte Carlo runs."""

    mean: float
    std: float
    p10: float
    p50: float
    p90: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        """Summarize a non-empty sequence of samples."""
        v = np.asarray(list(values), dtype=float)
        if v.size == 0:
            raise ValueError("Spread.of needs at least one value")
        p10, p50, p90 = np.percentile(v, [10, 50, 90])
        std = float(v.std(ddof=1)) if v.size > 1 else 0.0
        return cls(
            float(v.mean()), std, float(p10), float(p50), float(p90), float(v.min()), float(v.max()), int(v.size)
        )

    def to_dict(self) -> dict[str, float | int]:
        """JSON-ready form (the shape is documented in docs/simulate.md)."""
        return {
            "mean": self.mean,
            "std": self.std,
            "p10": self.p10,
            "p50": self.p50,
            "p90": self.p90,
            "min": self.min,
            "max": self.max,
            "n": self.n,
        }


@dataclass(frozen=True)
class Summary:
    """One strategy on one fleet size, over all seeds."""

    strategy: str
    chips: int
    learners: int | None  # None for the two data-parallel strategies
    goodput: Spread
    uptime: Spread
    failures: Spread

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (the shape is documented in docs/simulate.md)."""
        return {
            "strategy": self.strategy,
            "chips": self.chips,
            "learners": self.learners,
            "goodput": self.goodput.to_dict(),
            "uptime": self.uptime.to_dict(),
            "failures": self.failures.to_dict(),
        }


def summarize(strategy: str, params: FleetParams, runs: Sequence[RunResult]) -> Summary:
    """Fold the runs of one strategy into a Summary."""
    learners = params.learners if strategy == DILOCO else None
    return Summary(
        strategy,
        params.chips,
        learners,
        Spread.of(r.goodput for r in runs),
        Spread.of(r.uptime for r in runs),
        Spread.of(r.failures for r in runs),
    )


def monte_carlo(params: FleetParams, seeds: Sequence[int], strategies: Sequence[str] = STRATEGIES) -> list[Summary]:
    """Run each strategy once per seed and summarize; one Summary per strategy, in order."""
    if not seeds:
        raise ValueError("seeds: need at least one seed")
    out = []
    for strategy in strategies:
        runs = [simulate(strategy, params, np.random.default_rng(seed)) for seed in seeds]
        out.append(summarize(strategy, params, runs))
    return out


def sweep(base: FleetParams, chips: Sequence[int], learners: Sequence[int], seeds: Sequence[int]) -> list[Summary]:
    """Every chip count x (data-parallel, elastic, DiLoCo at each learner count).

    The two data-parallel strategies do not depend on the learner count, so they run once per
    chip count. `base.quorum` applies to every learner count (it must not exceed the smallest).
    """
    if not chips or not learners:
        raise ValueError("sweep needs at least one chip count and one learner count")
    out: list[Summary] = []
    for n in chips:
        fleet = replace(base, chips=n, learners=1, quorum=1)
        out.extend(monte_carlo(fleet, seeds, [s for s in STRATEGIES if s != DILOCO]))
        for m in learners:
            fleet = replace(base, chips=n, learners=m)
            out.extend(monte_carlo(fleet, seeds, [DILOCO]))
    return out
