"""Judging contributions before they move the global model (docs/algorithm.md, "Judging
contributions").

Pure: numpy on the round's Gram matrix, no I/O. The merge already takes, per fragment, the Gram
matrix G[m, n] = <v_m, v_n> of the round's outer gradients (syncer/fused.py), so both tests are
free:

- **size**: ||v_m|| (times its backlog factor) against the median of the fragment's recent
  regular accepted norms. An honest outer gradient is a few inner steps' progress; a damaged
  model (weights scaled, an exponent bit flipped) pushes its whole weights' worth: orders of
  magnitude more. Rejected above `size` times the median.
- **direction**: each regular contribution's mean cosine with the round's other regular ones
  (`whole`: a fresh, whole sync period that is not a learner process's first, syncer/screening.py),
  against how much those others agree among themselves this round. Learners that start from the
  same global model and train on the same distribution move the same way, by how much depends on
  the model, the batch and the stage of training (honest cosines measured from 0.03 to 0.5), so
  the only yardstick is the round itself: its `signal` = its mean cosine / the others' mean
  pairwise cosine is about 1 for an honest contribution, about 0 for noise, about -1 for a flipped
  sign. Measured on the test fleet (gpt-tiny, 256-token batches, 2 of 4 learners at half speed,
  kills and restarts; 16,335 contributions), an honest signal fell below 0 for 0.7% and below
  -0.5 for 0.04%, never below -1. The least agreeing contribution is rejected when its signal is
  below `AGAINST` and its cosine below -`bound` (`bound` = `agree` / sqrt(n): `agree` standard
  deviations of a random direction's cosine, 0.017 on a 30k-value fragment at the default 3), and
  the rest are judged again, so one bad contribution does not drag the honest ones' scores down.
  The signal is only measured where the others agree clearly (at least 2 x `bound` and
  `MIN_SIGNAL`), with 3+ regular contributions: a round of two cannot say which of its two is
  wrong; there, one whose cosine is below -max(bound, `AGAINST_TYPICAL` x the fragment's typical
  cosine) is rejected only when it has recent rejections (`suspects`). Noise is as aligned as
  an honest contribution is now and then, so it is merged, and the learner's record decides
  (syncer/quarantine.py).
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HISTORY = 32  # accepted norms and round cosines kept per fragment
WARMUP = 4  # accepted rounds of 2+ before a fragment's typical cosine counts
MIN_SIGNAL = 0.02  # the others agreeing less than this say nothing about direction
AGAINST = -0.5  # rejected: a signal below this (pointing against the others, half as much as they agree)
AGAINST_TYPICAL = 0.5  # a round of two: a suspect's cosine below -max(bound, this x the typical one)


@dataclass
class Verdict:
    """What the judge made of one contribution."""

    learner: str
    ok: bool
    size: float | None  # norm / the fragment's recent median (None: nothing to compare yet)
    agree: float | None  # mean cosine with the round's others (None: alone, or not judged by direction)
    reason: str = ""  # why it was rejected: "size" or "direction"
    bound: float | None = None  # the noise bound its cosine was judged against (None: no direction test)
    others: float | None = None  # the others' mean pairwise cosine (None: fewer than 2, or not agreeing)

    @property
    def signal(self) -> float | None:
        """Its cosine relative to the others' among themselves (about 1 honest, 0 noise, -1 a
        flipped sign), for the learner's record (syncer/quarantine.py); None: not measured."""
        return None if self.agree is None or not self.others else self.agree / self.others

    def describe(self, typical: float | None, bound: float | None) -> str:
        """One line with the numbers that condemned it."""
        if self.reason == "size":
            return f"norm {self.size:.3g}x the fragment's recent median"
        if self.others:
            return (
                f"mean cosine {self.agree:.3f} with the round's others, who agree at {self.others:.3f} "
                f"among themselves ({self.signal:.2f}x; rejected below {AGAINST:g}x and -{bound or 0:.3f})"
            )
        shown = "n/a" if typical is None else f"{typical:.3f}"
        return f"mean cosine {self.agree:.3f} with the round's other (bound {bound or 0:.3f}, typical {shown})"


@dataclass
class Judge:
    """The thresholds (0 turns a test off) and each fragment's recent history."""

    size: float = 16.0
    agree: float = 3.0
    norms: collections.defaultdict[int, collections.deque[float]] = field(
        default_factory=lambda: collections.defaultdict(lambda: collections.deque(maxlen=HISTORY))
    )
    cosines: collections.defaultdict[int, collections.deque[float]] = field(
        default_factory=lambda: collections.defaultdict(lambda: collections.deque(maxlen=HISTORY))
    )

    def typical(self, p: int) -> float | None:
        """Fragment p's typical cosine between honest contributions (None: too few rounds yet)."""
        recent = self.cosines[p]
        return statistics.median(recent) if len(recent) >= WARMUP else None

    def bound(self, p: int, numel: int) -> float | None:
        """The mean cosine below which a contribution of fragment p is rejected (None: no test)."""
        typical, bound = self.typical(p), self.agree / math.sqrt(max(1, numel))
        if self.agree <= 0 or typical is None or typical < max(MIN_SIGNAL, 2 * bound):
            return None
        return bound

    def judge(
        self,
        p: int,
        learners: Sequence[str],
        gram: np.ndarray,
        backlog: Sequence[float],
        suspects: set[str],
        numel: int,
        whole: Sequence[bool],
    ) -> list[Verdict]:
        """Verdicts for the round's contributions (in `learners` order) from their (M, M) Gram
        matrix over the fragment's `numel` values; `suspects` are learners with recent rejections
        (they lose a round of two); `whole`: which span at least half a sync period (the only
        ones judged by direction). The accepted ones' norms and mean cosine join the history."""
        gram = np.asarray(gram, dtype=np.float64)
        raw = np.sqrt(np.maximum(gram.diagonal(), 0.0))
        cos = _cosines(gram, raw)  # once: the tests below index it (a few microseconds a round)
        norms = raw * np.asarray(backlog, dtype=np.float64)
        sizes = self._sizes(p, norms)
        verdicts = [Verdict(lid, True, s, None) for lid, s in zip(learners, sizes)]
        for v in verdicts:
            if self.size > 0 and v.size is not None and not (v.size <= self.size):  # NaN fails too
                v.ok, v.reason = False, "size"
        noise = self.agree / math.sqrt(max(1, numel)) if self.agree > 0 else None
        bound = self.bound(p, numel)
        floor = None if bound is None else -max(bound, AGAINST_TYPICAL * (self.typical(p) or 0.0))
        self._directions(verdicts, cos, [v.learner in suspects for v in verdicts], (noise, floor), whole)
        for v in verdicts:
            v.bound = noise if v.agree is not None else None
        full = [i for i, v in enumerate(verdicts) if v.ok and whole[i]]
        self.norms[p].extend(float(norms[i]) for i in full)  # the reference: regular contributions only
        if len(full) >= 2:
            self.cosines[p].append(_mean_offdiag(cos[full][:, full]))
        return verdicts

    def _sizes(self, p: int, norms: np.ndarray) -> list[float | None]:
        """Each norm against the fragment's recent median (this round's with 3+ and no history)."""
        history = list(self.norms[p])
        if len(history) >= WARMUP:
            reference = statistics.median(history)
        elif len(norms) >= 3:
            reference = float(np.median(norms))
        else:
            return [None] * len(norms)
        if not reference > 0:
            return [None] * len(norms)
        return [float(n) / reference for n in norms]

    def _directions(
        self,
        verdicts: list[Verdict],
        cos: np.ndarray,
        suspects: list[bool],
        limits: tuple[float | None, float | None],
        whole: Sequence[bool],
    ) -> None:
        """Reject the least agreeing whole contribution while it points against the others
        (`_against`), judging the rest again each time. `limits`: the noise bound (None: the test
        is off) and a round of two's floor (None: no test there)."""
        while True:
            alive = [i for i, v in enumerate(verdicts) if v.ok and whole[i]]
            if len(alive) < 2:
                return
            sub = cos[alive][:, alive]
            means = (sub.sum(axis=1) - sub.diagonal()) / (len(alive) - 1)
            others = _others(means, limits[0])
            for i, a, o in zip(alive, means.tolist(), others):
                verdicts[i].agree, verdicts[i].others = a, o
            worst = _against(means, others, limits, [suspects[i] for i in alive])
            if worst is None:
                return
            verdicts[alive[worst]].ok, verdicts[alive[worst]].reason = False, "direction"

    def state_dict(self) -> dict[str, Any]:
        """Each fragment's history (a checkpoint keeps it, as it keeps the clip's)."""
        return {
            "norms": {str(p): list(d) for p, d in self.norms.items()},
            "cosines": {str(p): list(d) for p, d in self.cosines.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, target in (("norms", self.norms), ("cosines", self.cosines)):
            for p, values in (state.get(key) or {}).items():
                target[int(p)].extend(float(x) for x in values if math.isfinite(float(x)))


def _others(means: np.ndarray, noise: float | None) -> list[float | None]:
    """For each of 3+ contributions with mean cosines `means`, the mean pairwise cosine of the
    others among themselves (the pairs without it: (sum - 2 x its own) / (n - 2)); None where
    they do not agree clearly (below 2 x the noise bound and MIN_SIGNAL), or fewer than 3."""
    n = len(means)
    if n < 3 or noise is None:
        return [None] * n
    total, gate = float(means.sum()), max(MIN_SIGNAL, 2.0 * noise)
    return [o if (o := (total - 2.0 * float(m)) / (n - 2)) >= gate else None for m in means]


def _against(
    means: np.ndarray, others: list[float | None], limits: tuple[float | None, float | None], suspects: list[bool]
) -> int | None:
    """Which contribution (an index into `means`) points against the others, if one does: of
    3+, the lowest signal below AGAINST with a cosine below -bound; of two, the one suspect
    below the fragment's floor (either could be the wrong one otherwise)."""
    noise, floor = limits
    if len(means) >= 3:
        judged = [k for k, o in enumerate(others) if o is not None]
        if noise is None or not judged:
            return None
        worst = min(judged, key=lambda k: float(means[k]) / (others[k] or 1.0))
        signal = float(means[worst]) / (others[worst] or 1.0)
        return worst if signal < AGAINST and means[worst] < -noise else None
    named = [k for k in range(len(means)) if suspects[k]]
    if floor is None or not float(means.min()) < floor or len(named) != 1:
        return None
    return named[0]


def _cosines(gram: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """Cosine matrix of a Gram matrix whose diagonal's roots are `norms` (0 where a norm is 0)."""
    zero = norms == 0
    safe = np.where(zero, 1.0, norms)
    result: np.ndarray = gram / np.outer(safe, safe)
    if zero.any():
        result[zero, :] = 0.0
        result[:, zero] = 0.0
    return result


def _mean_offdiag(cos: np.ndarray) -> float:
    """Mean of the off-diagonal entries (the round's mean pairwise cosine)."""
    m = len(cos)
    return float((cos.sum() - cos.trace()) / (m * (m - 1)))
