"""How a closing round becomes the next version of its fragment: the merge and the outer step.

A part of the core (syncer/core.py composes it; syncer/roundbook.py says which rounds close):
cap each contribution's backlog (`cap_backlogs`), screen them (`screened`), merge the outer
gradients with their clipping and fleet-scale factors, take the outer Nesterov step and publish
the result bit-exactly (`step`, cache-blocked through syncer/fused.py, or `_step_reference` on
whole fp32 fragments). It owns what the steps remember from round to round: the norm history of
robust clipping and which backlogs were announced. The round's share of a sync period is
returned with the step, never kept. The model and the merge kernel are passed in. No I/O.
"""

from __future__ import annotations

import collections
import math
from typing import Any, NamedTuple

import numpy as np
import torch

from syncer import fused, merge
from syncer.clock import RoundClock
from syncer.common.settings import RunSettings
from syncer.fleet import Ledger
from syncer.globalmodel import GlobalModel, Outbox
from syncer.rounds import Contribution, backlog_factor
from syncer.screening import Screen
from syncer.wire import codec, quant, thin

PERIOD_SLACK = 0.2  # a contribution of at least 80% of its learner's sync period is a whole one


class Step(NamedTuple):
    """A published step: the update blob learners apply, its crc32 (None: not computed), and the
    round's share of a sync period (merge.partial_momentum; the round's metric reports it)."""

    blob: bytes
    crc: int | None
    share: float


class OuterStep:
    """The merge and outer step of the rounds that close, and what they remember between rounds."""

    def __init__(
        self,
        settings: RunSettings,
        fleet: Ledger,
        round_clock: RoundClock,
        screen: Screen,
        counters: collections.Counter[str],
    ) -> None:
        self.s = settings
        self.fleet = fleet
        self.round_clock = round_clock
        self.screen = screen
        self.counters = counters  # the run's tallies (syncer/accounting.py): "clipped", "backlog_*"
        self.norm_history: collections.defaultdict[int, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=32)
        )
        self.backlogged: set[tuple[str, int]] = set()  # (learner, fragment) backlogs announced

    def cap_backlogs(self, p: int, contribs: list[Contribution], now: float, out: Outbox) -> list[Contribution]:
        """Set each contribution's backlog factor; the rest of a capped one is carried (max_carry) or dropped."""
        carried: list[Contribution] = []
        for c in contribs:
            c.backlog = self._backlog(c)
            if c.backlog >= 1.0:
                self.backlogged.discard((c.learner, p))
                continue
            self.counters["backlog_capped"] += 1
            carry = -1.0 if self.s.max_carry < 0 else self.s.max_carry / self.s.max_backlog
            rest = c.remainder(now, carry)
            kept = rest.c_steps if rest is not None else 0
            dropped = max(0, round(c.c_steps * (1.0 - c.backlog)) - kept)
            self.counters["backlog_dropped_steps"] += dropped
            if (c.learner, p) not in self.backlogged:  # once per backlog, not once per round that absorbs it
                self.backlogged.add((c.learner, p))
                out.event(
                    now,
                    "backlog",
                    c.learner,
                    f"fragment {p}: {c.c_steps} steps since its last merge, "
                    f"{c.backlog * c.c_steps:.0f} counted now (max_backlog {self.s.max_backlog:g} periods), "
                    f"{kept} carried to the next rounds, {dropped} dropped",
                )
            if rest is not None:
                carried.append(rest)
        return carried

    def _grams(self, p: int, contribs: list[Contribution], model: GlobalModel, kernel: Any) -> torch.Tensor | None:
        """(S, M, M) Gram matrices of the learners' outer gradients per segment, in one
        cache-blocked pass over their wire values (syncer/fused.py; a learner that pushed twice is
        the sum of its pushes: `_learner_grams`); None where nothing needs them, or where values
        are too large for an fp32 Gram (the reference path then)."""
        need = (
            (_rule(self.s.merge, contribs) == "rda" and len(contribs) > 1) or self.s.robust_clip > 0 or self.screen.on
        )
        if not need:
            return None
        parts = [q for c in contribs for q in c.parts]
        grams = fused.gram(parts, model.plan.segments(p), self.s.block, kernel)
        if grams is not None and len(parts) > len(contribs):
            grams = _learner_grams(grams, [i for i, c in enumerate(contribs) for _ in c.parts], len(contribs))
        return grams

    def screened(
        self, p: int, contribs: list[Contribution], model: GlobalModel, kernel: Any, now: float, out: Outbox
    ) -> tuple[list[Contribution], torch.Tensor | None]:
        """The contributions the screen accepts (syncer/screening.py) and their Gram matrices."""
        grams = self._grams(p, contribs, model, kernel)
        if not self.screen.on:
            return contribs, grams
        whole = grams.to(torch.float64).sum(0).numpy() if grams is not None else _gram64(contribs)
        numel = contribs[0].delta.numel
        backlog, parts = [self._backlog(c) for c in contribs], self._parts(contribs)
        kept = self.screen.screen(p, contribs, whole, backlog, parts, (numel, model.versions[p]), now, out)
        if len(kept) == len(contribs) or grams is None:
            return kept, grams
        index = [i for i, c in enumerate(contribs) if any(c is k for k in kept)]
        return kept, grams[:, index][:, :, index]

    def step(
        self,
        p: int,
        contribs: list[Contribution],
        model: GlobalModel,
        kernel: Any,
        now: float,
        grams: torch.Tensor | None,
        want_crc: bool = True,
    ) -> Step:
        """Merge, Nesterov and publish fragment p of `model` in place; returns the update blob, the
        new crc32 (None unless `want_crc`: updates carry it every `checksum_every` versions) and the
        round's share of a sync period.

        Cache-blocked (syncer/fused.py): the contributions stay in their wire precision; `grams`
        (`_grams`: norms for clipping and RDA) was the first pass, a second merges, steps and
        publishes a slice at a time. Without them where norms are needed (values too large for
        an fp32 Gram), the reference path.
        """
        m = model
        parts = [q for c in contribs for q in c.parts]
        owner = [i for i, c in enumerate(contribs) for _ in c.parts]  # the learner of each push
        segments = m.plan.segments(p)
        rule = _rule(self.s.merge, contribs)
        need_norms = (rule == "rda" and len(contribs) > 1) or self.s.robust_clip > 0
        if need_norms and grams is None:
            return self._step_reference(p, contribs, m, now, want_crc)
        sqnorms = torch.diagonal(grams, dim1=1, dim2=2).t().tolist() if grams is not None else None
        factors = self._clipped(p, sqnorms, [c.backlog for c in contribs])
        scale, share = self._fleet_scale(contribs, now)
        kinds = [kind for _, _, kind in segments]
        if grams is None:  # plain mean, no clipping: the coefficients need no norms
            grams = torch.zeros(len(segments), len(contribs), len(contribs), dtype=torch.float64)
        coefs = merge.coefficients(grams, [c.weight for c in contribs], kinds, rule, factors=factors, scale=scale)
        if len(parts) > len(contribs):  # every push of a learner gets its learner's coefficient
            coefs = coefs[:, owner].contiguous()
        blob, crc = fused.publish(
            parts,
            coefs,
            segments,
            m.theta[p],
            m.momentum[p],
            m.residual[p],
            self.s.outer_lr,
            self.s.outer_momentum,
            self.s.compression,
            self._update_block(len(parts)),
            kernel,
            want_crc,
            self.s.zstd,
            share,
        )
        return Step(blob, crc, share)

    def _step_reference(
        self, p: int, contribs: list[Contribution], m: GlobalModel, now: float, want_crc: bool = True
    ) -> Step:
        """`step` on whole fp32 fragments (merge.merge, nesterov_change_, quantize_roundtrip).

        Every buffer is updated in place:
            residual <- residual + (theta' - theta)      the change to publish, then
            theta    <- theta + dequantize(q)            what every learner computes from the blob
            residual <- change - dequantize(q)           error feedback for the next round
        """
        deltas = [c.values().contiguous() for c in contribs]
        segments = m.plan.segments(p)
        rule = _rule(self.s.merge, contribs)
        rda = rule == "rda" and len(deltas) > 1
        sqnorms = merge.segment_sqnorms(deltas, segments) if rda or self.s.robust_clip > 0 else None
        factors = self._clipped(p, sqnorms, [c.backlog for c in contribs])
        scale, share = self._fleet_scale(contribs, now)
        merged = merge.merge(
            deltas,
            [c.weight for c in contribs],
            segments,
            rule,
            factors=factors,
            scale=scale,
            sqnorms=sqnorms,
            out=deltas[0],
        )
        change = merge.nesterov_change_(
            m.residual[p], merged, m.momentum[p], self.s.outer_lr, self.s.outer_momentum, share
        )
        q, applied = quant.quantize_roundtrip(
            change, self.s.compression, self._update_block(sum(len(c.parts) for c in contribs)), out=merged
        )
        blob = codec.encode_quantized(q, self.s.zstd)  # before `change` moves on: q may share its memory ("none")
        m.theta[p].add_(applied)  # a separate fp32 add, exactly as learners apply the blob
        change.sub_(applied)  # m.residual[p] is `change`: now the carried residual
        return Step(blob, m.crc(p) if want_crc else None, share)

    def _update_block(self, pushes: int) -> int:
        """The update's block field. For topk, room for every push's kept values (`topk_keep`
        times the pushes merged, at most the whole chunk): the merge of sparse outer gradients
        is their union, and the update carries all of it (what SparseLoCo's peers gather from
        each other), so only its 2-bit rounding waits in the residual, not whole coordinates."""
        keep = min(thin.TOPK_CHUNK, self.s.topk_keep * max(1, pushes))
        return quant.wire_block(self.s.compression, self.s.block, keep)

    def _fleet_scale(self, contribs: list[Contribution], now: float) -> tuple[float, float]:
        """(the merged outer gradient's scale, the round's share of a sync period for the momentum,
        merge.partial_momentum). On the syncer's clock with fleet_scale both come from the fleet's
        period (`_fleet_share`); else the share is the merge-weighted mean of the contributions'
        parts, and the scale the round's share of the live fleet's tokens per period on the
        learners' clocks (1.0 with fleet_scale off)."""
        for c in contribs:
            self.fleet.observe_rate(c.learner, c.c_tokens / c.c_steps)
        if self.s.fleet_scale and self.s.syncer_clock:  # one round per period: parts and finished share it
            return self._fleet_share(contribs)
        total = sum(c.weight for c in contribs)
        share = sum(c.weight * f for c, f in zip(contribs, self._parts(contribs))) / total if total > 0 else 1.0
        if not self.s.fleet_scale or self.s.syncer_clock:
            return 1.0, share
        members = self.fleet.live(now) | {c.learner for c in contribs} | self.fleet.finished()
        period = sum(self.fleet.tokens_per_step(m, self.s.seq_len) for m in members) * self.s.H
        return min(1.0, merge.fleet_fraction(sum(c.c_tokens for c in contribs), period)), share

    def _clipped(self, p: int, sqnorms: list[list[float]] | None, backlog: list[float]) -> list[float] | None:
        """Factors per contribution, folded into the merge (merge.merge(factors=...)): no delta is
        copied. The backlog factors (`_backlog`), then robust clipping of the norms they leave,
        from per-segment norms; None when neither changes anything."""
        if self.s.robust_clip <= 0 or sqnorms is None:
            return backlog if any(b < 1.0 for b in backlog) else None
        norms = [math.sqrt(sum(sq)) * b for sq, b in zip(sqnorms, backlog)]
        factors = merge.clip_factors(norms, list(self.norm_history[p]), self.s.robust_clip)
        self.counters["clipped"] += sum(1 for f in factors if f < 1.0)
        self.norm_history[p].extend(n * min(1.0, f) for n, f in zip(norms, factors))
        return [b * f for b, f in zip(backlog, factors)]

    def _backlog(self, c: Contribution) -> float:
        """The share of a contribution that counts now (rounds.backlog_factor)."""
        return backlog_factor(c.c_steps, self._period_steps(c), self.s.max_backlog)

    def _period_steps(self, c: Contribution) -> float:
        """The steps c's learner trains per sync period: H on its own clock, by its measured speed
        on the syncer's."""
        info = self.fleet.learners.get(c.learner)
        own = info.seconds_per_step() if info is not None else c.step_time
        return self.round_clock.steps_per_period(own) if self.s.syncer_clock else float(self.s.H)

    def _parts(self, contribs: list[Contribution]) -> list[float]:
        """Each contribution's share of its learner's sync period, at most 1. One within
        PERIOD_SLACK of its period counts as whole (speed estimates jitter); a finishing learner's
        last steps or a joiner's first are a part."""
        return [min(1.0, c.c_steps / max(1e-9, self._period_steps(c) * (1.0 - PERIOD_SLACK))) for c in contribs]

    def _fleet_share(self, contribs: list[Contribution]) -> tuple[float, float]:
        """(scale of the merged outer gradient, share of a period) of a round on the syncer's
        clock, from its contributions' parts p (`_parts`) and N = its learners plus those that
        finished their budget (a finished learner stays in the fleet's average as a member that
        no longer moves):

            share = sum(p) / N                      the round's part of one fleet period
            scale = sum(p)^2 / (N * sum(p^2))       token-weighted mean -> the members' average

        With outer gradients about proportional to their parts, `scale` turns the round's
        token-weighted mean into the average over the N members, as synchronous DiLoCo's round
        is: the run ends with the fleet's average, not its last learners' steps at full weight.
        A round of whole periods (or of equal parts) without finished learners is (1, share):
        dead learners shrink nothing."""
        done = len(self.fleet.finished() - {c.learner for c in contribs})
        parts = self._parts(contribs)
        total, squares, members = sum(parts), sum(p * p for p in parts), len(contribs) + done
        scale = total * total / (members * squares) if squares > 0 else 1.0
        return min(1.0, scale), min(1.0, total / members)


def _rule(merge_rule: str, contribs: list[Contribution]) -> str:
    """The round's merge rule: the run's, but the mean where a contribution is sparse (topk).
    RDA gives the merged direction the contributions' mean norm; sparse outer gradients keep
    different coordinates, are near orthogonal (mean cosine ~0.03 in a 4-learner gpt-tiny
    run), and RDA would scale their merge ~2x (sqrt(M) / M of the mean norm): a larger
    outer step, not the same merge. The mean of the sparse parts is what SparseLoCo applies."""
    if merge_rule == "rda" and any(q.mode == "topk" for c in contribs for q in c.parts):
        return "mean"
    return merge_rule


def _gram64(contribs: list[Contribution]) -> np.ndarray:
    """(M, M) Gram matrix of the outer gradients in float64, for values an fp32 Gram cannot hold
    (a damaged learner's: weights scaled, an exponent bit flipped)."""
    values = [c.values().to(torch.float64) for c in contribs]
    gram = np.empty((len(values), len(values)))
    for i, u in enumerate(values):
        for j in range(i, len(values)):
            gram[i, j] = gram[j, i] = float(torch.dot(u, values[j]))
    return gram


def _learner_grams(grams: torch.Tensor, owner: list[int], count: int) -> torch.Tensor:
    """(S, M, M) Gram matrices of the learners' outer gradients from those of their pushes
    (S, P, P): <sum of m's pushes, sum of n's pushes> = the sum of the pushes' products."""
    onehot = torch.zeros(count, len(owner), dtype=grams.dtype)
    onehot[owner, range(len(owner))] = 1.0
    return onehot @ grams @ onehot.t()
