"""How a closing round becomes the next version of its fragment: a mixin of SyncerCore.

`SyncerCore._close` (syncer/core.py) orders the work; the steps are here: cap each
contribution's backlog (`_cap_backlogs`), merge the outer gradients with their clipping and
fleet-scale factors, take the outer Nesterov step and publish the result bit-exactly (`_step`,
cache-blocked through syncer/fused.py, or `_step_reference` on whole fp32 fragments), then
account for the round (`_account`: fleet counters, merge-time estimate, the round's metric).
No I/O, like the rest of the core: the merge time is measured with the core's injected clock.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from syncer import fused, merge
from syncer.clock import RoundClock
from syncer.common import smallmath
from syncer.common.settings import RunSettings
from syncer.fleet import Ledger
from syncer.globalmodel import GlobalModel, Outbox
from syncer.rounds import Contribution, Round, backlog_factor
from syncer.screening import Screen
from syncer.wire import codec

PERIOD_SLACK = 0.2  # a contribution of at least 80% of its learner's sync period is a whole one


class OuterStep:
    """The merge and outer step of SyncerCore; the attributes are the core's (set in its __init__)."""

    s: RunSettings
    kernel: Any  # syncer.native.Kernel or None (torch round step)
    model: GlobalModel | None
    fleet: Ledger
    round_clock: RoundClock
    clock: Callable[[], float]
    counters: collections.Counter[str]
    outer_steps: int
    since_checkpoint: int
    t_sync: float | None
    recent_rounds: collections.deque[dict[str, Any]]
    _norm_history: collections.defaultdict[int, collections.deque[float]]
    _backlogged: set[tuple[str, int]]
    screen: Screen
    _share: float = 1.0  # the closing round's share of a sync period (`_fleet_scale`)

    def _cap_backlogs(self, p: int, contribs: list[Contribution], now: float, out: Outbox) -> list[Contribution]:
        """Set each contribution's backlog factor; the rest of a capped one is carried (max_carry) or dropped."""
        carried: list[Contribution] = []
        for c in contribs:
            c.backlog = self._backlog(c)
            if c.backlog >= 1.0:
                self._backlogged.discard((c.learner, p))
                continue
            self.counters["backlog_capped"] += 1
            carry = -1.0 if self.s.max_carry < 0 else self.s.max_carry / self.s.max_backlog
            rest = c.remainder(now, carry)
            kept = rest.c_steps if rest is not None else 0
            dropped = max(0, round(c.c_steps * (1.0 - c.backlog)) - kept)
            self.counters["backlog_dropped_steps"] += dropped
            if (c.learner, p) not in self._backlogged:  # once per backlog, not once per round that absorbs it
                self._backlogged.add((c.learner, p))
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

    def _grams(self, p: int, contribs: list[Contribution]) -> torch.Tensor | None:
        """(S, M, M) Gram matrices of the learners' outer gradients per segment, in one
        cache-blocked pass over their wire values (syncer/fused.py; a learner that pushed twice is
        the sum of its pushes: `_learner_grams`); None where nothing needs them, or where values
        are too large for an fp32 Gram (the reference path then)."""
        assert self.model is not None
        need = (self.s.merge == "rda" and len(contribs) > 1) or self.s.robust_clip > 0 or self.screen.on
        if not need:
            return None
        parts = [q for c in contribs for q in c.parts]
        grams = fused.gram(parts, self.model.plan.segments(p), self.s.block, self.kernel)
        if grams is not None and len(parts) > len(contribs):
            grams = _learner_grams(grams, [i for i, c in enumerate(contribs) for _ in c.parts], len(contribs))
        return grams

    def _screened(
        self, p: int, contribs: list[Contribution], now: float, out: Outbox
    ) -> tuple[list[Contribution], torch.Tensor | None]:
        """The contributions the screen accepts (syncer/screening.py) and their Gram matrices."""
        grams = self._grams(p, contribs)
        if not self.screen.on:
            return contribs, grams
        whole = grams.to(torch.float64).sum(0).numpy() if grams is not None else _gram64(contribs)
        numel = contribs[0].delta.numel
        backlog, parts = [self._backlog(c) for c in contribs], self._parts(contribs)
        version = self.model.versions[p] if self.model is not None else 0
        kept = self.screen.screen(p, contribs, whole, backlog, parts, (numel, version), now, out)
        if len(kept) == len(contribs) or grams is None:
            return kept, grams
        index = [i for i, c in enumerate(contribs) if any(c is k for k in kept)]
        return kept, grams[:, index][:, :, index]

    def _step(
        self, p: int, contribs: list[Contribution], now: float, grams: torch.Tensor | None, want_crc: bool = True
    ) -> tuple[bytes, int | None]:
        """Merge, Nesterov and publish fragment p in place; returns the update blob and the new
        crc32 (None unless `want_crc`: updates carry it every `checksum_every` versions).

        Cache-blocked (syncer/fused.py): the contributions stay in their wire precision; `grams`
        (`_grams`: norms for clipping and RDA) was the first pass, a second merges, steps and
        publishes a slice at a time. Without them where norms are needed (values too large for
        an fp32 Gram), the reference path.
        """
        m = self.model
        assert m is not None  # only a round of an initialized model closes (`_close`)
        parts = [q for c in contribs for q in c.parts]
        owner = [i for i, c in enumerate(contribs) for _ in c.parts]  # the learner of each push
        segments = m.plan.segments(p)
        need_norms = (self.s.merge == "rda" and len(contribs) > 1) or self.s.robust_clip > 0
        if need_norms and grams is None:
            return self._step_reference(p, contribs, now, want_crc)
        sqnorms = torch.diagonal(grams, dim1=1, dim2=2).t().tolist() if grams is not None else None
        factors = self._clipped(p, sqnorms, [c.backlog for c in contribs])
        scale, self._share = self._fleet_scale(contribs, now)
        kinds = [kind for _, _, kind in segments]
        if grams is None:  # plain mean, no clipping: the coefficients need no norms
            grams = torch.zeros(len(segments), len(contribs), len(contribs), dtype=torch.float64)
        coefs = merge.coefficients(
            grams, [c.weight for c in contribs], kinds, self.s.merge, factors=factors, scale=scale
        )
        if len(parts) > len(contribs):  # every push of a learner gets its learner's coefficient
            coefs = coefs[:, owner].contiguous()
        return fused.publish(
            parts,
            coefs,
            segments,
            m.theta[p],
            m.momentum[p],
            m.residual[p],
            self.s.outer_lr,
            self.s.outer_momentum,
            self.s.compression,
            self.s.block,
            self.kernel,
            want_crc,
            self.s.zstd,
            self._share,
        )

    def _step_reference(
        self, p: int, contribs: list[Contribution], now: float, want_crc: bool = True
    ) -> tuple[bytes, int | None]:
        """`_step` on whole fp32 fragments (merge.merge, nesterov_change_, quantize_roundtrip).

        Every buffer is updated in place:
            residual <- residual + (theta' - theta)      the change to publish, then
            theta    <- theta + dequantize(q)            what every learner computes from the blob
            residual <- change - dequantize(q)           error feedback for the next round
        """
        m = self.model
        assert m is not None  # only a round of an initialized model closes (`_close`)
        deltas = [c.values().contiguous() for c in contribs]
        segments = m.plan.segments(p)
        rda = self.s.merge == "rda" and len(deltas) > 1
        sqnorms = merge.segment_sqnorms(deltas, segments) if rda or self.s.robust_clip > 0 else None
        factors = self._clipped(p, sqnorms, [c.backlog for c in contribs])
        scale, self._share = self._fleet_scale(contribs, now)
        merged = merge.merge(
            deltas,
            [c.weight for c in contribs],
            segments,
            self.s.merge,
            factors=factors,
            scale=scale,
            sqnorms=sqnorms,
            out=deltas[0],
        )
        change = merge.nesterov_change_(
            m.residual[p], merged, m.momentum[p], self.s.outer_lr, self.s.outer_momentum, self._share
        )
        q, applied = codec.quantize_roundtrip(change, self.s.compression, self.s.block, out=merged)
        blob = codec.encode_quantized(q, self.s.zstd)  # before `change` moves on: q may share its memory ("none")
        m.theta[p].add_(applied)  # a separate fp32 add, exactly as learners apply the blob
        change.sub_(applied)  # m.residual[p] is `change`: now the carried residual
        return blob, m.crc(p) if want_crc else None

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
        factors = merge.clip_factors(norms, list(self._norm_history[p]), self.s.robust_clip)
        self.counters["clipped"] += sum(1 for f in factors if f < 1.0)
        self._norm_history[p].extend(n * min(1.0, f) for n, f in zip(norms, factors))
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

    def _account(
        self,
        rnd: Round,
        contribs: list[Contribution],
        weights: list[float],
        now: float,
        out: Outbox,
        blob_bytes: int,
        t0: float,
    ) -> None:
        """The round's merge in the fleet's counters, the merge-time estimate and the metrics."""
        assert self.model is not None  # only a round of an initialized model closes (`_close`)
        version = self.model.versions[rnd.fragment]
        total_w = sum(weights) or 1.0
        # each fragment is 1/P of the model; a shard's fragments stand for the whole model in its
        # accounting, so shard 0's goodput and merged tokens are the run's (balanced shards)
        parts = self.model.plan.count
        for c, w in zip(contribs, weights):
            self.fleet.merged(c.learner, round(c.c_tokens * c.backlog), c.c_time * c.backlog, parts, w, now)
        self.outer_steps += 1
        self.since_checkpoint += 1
        dt = self.clock() - t0
        self.t_sync = smallmath.ema(self.t_sync, dt, 0.8)
        grace_used = max(0.0, now - rnd.quorum_at) if rnd.quorum_at is not None else 0.0
        self.recent_rounds.append({"contributors": len(contribs), "grace_s": rnd.grace_s, "grace_used_s": grace_used})
        out.metrics.append(
            {
                "t": now,
                "kind": "round",
                "fragment": rnd.fragment,
                "version": version,
                "contributors": [c.learner for c in contribs],
                "weights": {c.learner: round(w / total_w, 4) for c, w in zip(contribs, weights)},
                "tokens": sum(c.c_tokens for c in contribs),
                "wait_quorum_s": max(0.0, (rnd.quorum_at or now) - (rnd.called_at or rnd.first_at or now)),
                "grace_s": rnd.grace_s,
                "grace_used_s": grace_used,
                "bytes_in": sum(c.nbytes for c in contribs),
                "bytes_out": blob_bytes,
                "merge_s": dt,
                "live": len(self.fleet.live(now)),
                "quorum": self.s.quorum,
                "staleness": max(version - 1 - c.base_version for c in contribs),
                "period_share": round(self._share, 4),
                "judged": self.screen.last,  # [norm / median, mean cosine, regular, signal] (syncer/judge.py)
            }
        )


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
