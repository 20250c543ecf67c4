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
  (`whole`: a fresh, whole sync period that is not a learner process's first, syncer/screening.py).
  Learners that start from the same global model and train on the same distribution move the
  same way; a flipped sign points against the others, and noise is orthogonal to them: the
  cosine of a random direction in n dimensions is about N(0, 1/n). `bound` = `agree` / sqrt(n)
  (`agree` standard deviations of a random direction's: 0.017 on a 30k-value fragment at the
  default 3). The least agreeing contribution is rejected when its mean cosine is below
  -max(bound, `AGAINST` x the typical cosine): it points against the others beyond what noise
  does (an embedding fragment's honest cosines, over the few rows a batch touches, spread
  wider than 1/sqrt(n): down to -0.038 measured), and the rest are judged again, so one bad
  contribution does not drag the honest ones' scores down with it. One inside +-bound is as
  aligned as noise: an honest one is, now and then (1 in 700 on a heterogeneous fleet under
  the chaos monkey), so it is merged, and the learner's record decides (its median cosine over
  its last contributions, syncer/quarantine.py). A round of two cannot say which of its two
  is wrong: the one with recent rejections is, else neither.

A fragment judges direction only once `WARMUP` accepted rounds show a typical cosine (their
median) of at least twice that bound and `MIN_SIGNAL`: where honest learners do not agree
clearly, the test says nothing.
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
MIN_SIGNAL = 0.02  # a typical cosine below this says nothing about direction
AGAINST = 0.5  # rejected alone: a mean cosine below -max(bound, this x the typical one)


@dataclass
class Verdict:
    """What the judge made of one contribution."""

    learner: str
    ok: bool
    size: float | None  # norm / the fragment's recent median (None: nothing to compare yet)
    agree: float | None  # mean cosine with the round's others (None: alone, or not judged by direction)
    reason: str = ""  # why it was rejected: "size" or "direction"
    bound: float | None = None  # the noise bound its cosine was judged against (None: no direction test)

    @property
    def signal(self) -> float | None:
        """Its cosine in units of the noise bound (< 1: no more aligned than noise), for the
        learner's record (syncer/quarantine.py)."""
        return None if self.agree is None or not self.bound else self.agree / self.bound

    def describe(self, typical: float | None, bound: float | None) -> str:
        """One line with the numbers that condemned it."""
        if self.reason == "size":
            return f"norm {self.size:.3g}x the fragment's recent median"
        shown = "n/a" if typical is None else f"{typical:.3f}"
        return f"mean cosine {self.agree:.3f} with the round's others (bound {bound or 0:.3f}, typical {shown})"


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
        bound = self.bound(p, numel)
        floor = None if bound is None else -max(bound, AGAINST * (self.typical(p) or 0.0))
        self._directions(verdicts, cos, suspects, floor, whole)
        for v in verdicts:
            v.bound = bound if v.agree is not None else None
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
        self, verdicts: list[Verdict], cos: np.ndarray, suspects: set[str], floor: float | None, whole: Sequence[bool]
    ) -> None:
        """Reject the least agreeing whole contribution while its mean cosine is below `floor`:
        it points against the others beyond what noise does. (One about as aligned as noise is
        not rejected alone: honest ones are, now and then; the learner's record judges that.)"""
        while True:
            alive = [i for i, v in enumerate(verdicts) if v.ok and whole[i]]
            if len(alive) < 2:
                return
            sub = cos[alive][:, alive]
            means = (sub.sum(axis=1) - sub.diagonal()) / (len(alive) - 1)
            for i, a in zip(alive, means.tolist()):
                verdicts[i].agree = a
            if floor is None:
                return
            worst = int(np.argmin(means))
            if not means[worst] < floor:
                return
            if len(alive) == 2:
                named = [i for i in alive if verdicts[i].learner in suspects]
                if len(named) != 1:
                    return  # either could be the wrong one: neither is rejected
                worst = alive.index(named[0])
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
