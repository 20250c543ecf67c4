"""One fragment's open round: contributions collected until quorum and grace say it may close.

Pure bookkeeping (no I/O, clock passed in). A learner that contributes twice to one round has its
outer gradients summed and its counters added up. With the syncer's round clock (syncer/clock.py)
a round closes only once it has been called, and then within its window; with the learners'
own clocks (`round_clock = "learner"`) the first contribution starts it and the grace window of
ALGORITHM.md, counted from quorum, ends it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from syncer import merge
from syncer.wire import quant


@dataclass
class Contribution:
    """One learner's outer gradient for one fragment in one round, kept as it came on the wire:
    block scales and codes, int4 still packed two a byte with the native kernel
    (`quant.Quantized.packed`; one int8 a value without it), never fp32. A learner that pushes
    twice to one round has both pushes kept (`more`): the merge weighs their sum as one learner's
    outer gradient, and the round stays on the native kernel's path."""

    learner: str
    delta: quant.Quantized  # the first push
    c_steps: int
    c_tokens: int
    c_time: float
    step_time: float
    base_version: int
    arrived: float
    nbytes: int
    backlog: float = 1.0  # < 1: the contribution spans more sync periods than max_backlog allows
    more: list[quant.Quantized] = field(default_factory=list)  # the learner's further pushes, to be summed
    units: list[int] = field(default_factory=list)  # the work units its pushes carried (syncer/dataledger.py)
    incarnation: str = ""  # of the learner that pushed it
    seq: int = -1  # the highest sequence number of its pushes (syncer/receipts.py; -1: a carried share)

    @classmethod
    def of_push(
        cls,
        learner: str,
        incarnation: str,
        delta: quant.Quantized,
        meta: dict[str, Any],
        now: float,
        nbytes: int,
        units: list[int],
    ) -> Contribution:
        """A checked push message's contribution (its counters, base and sequence from `meta`)."""
        steps, tokens, seconds = int(meta["c_steps"]), int(meta["c_tokens"]), float(meta["c_time"])
        step_time, base = float(meta["step_time"]), int(meta["base_version"])
        return cls(
            learner,
            delta,
            steps,
            tokens,
            seconds,
            step_time,
            base,
            now,
            nbytes,
            units=units,
            incarnation=incarnation,
            seq=int(meta["seq"]),
        )

    @property
    def weight(self) -> float:
        """The token weight of the work that counts (a backlog is weighted as `backlog` of it)."""
        return merge.token_weight(self.c_tokens, self.c_steps) * self.backlog

    @property
    def parts(self) -> list[quant.Quantized]:
        """The pushes whose sum is this learner's outer gradient (one, unless it pushed again)."""
        return [self.delta, *self.more]

    def values(self) -> torch.Tensor:
        """The outer gradient in fp32: the sum of the parts' values (a new tensor)."""
        total = quant.dequantize(self.delta)
        for q in self.more:
            total.add_(quant.dequantize(q))
        return total

    def remainder(self, now: float, carry: float = -1.0) -> Contribution | None:
        """What of the share `1 - backlog` that a capped contribution could not count this round
        waits for the fragment's next rounds, as a contribution of its own (outer gradient and
        counters scaled alike): all of it with `carry` < 0, else at most `carry` times the share
        that counted (`carry` periods where that share is `max_backlog` periods); the rest is
        dropped. The scaled parts share the codes (never written) and carry scaled block scales."""
        if self.backlog >= 1.0:
            return None
        rest = 1.0 - self.backlog if carry < 0 else min(1.0 - self.backlog, carry * self.backlog)
        if rest * self.c_steps < 1.0:
            return None
        first, *more = (_scaled(q, rest) for q in self.parts)
        return Contribution(
            self.learner,
            first,
            max(1, round(self.c_steps * rest)),
            round(self.c_tokens * rest),
            self.c_time * rest,
            self.step_time,
            self.base_version,
            now,
            0,
            more=more,
            incarnation=self.incarnation,
        )

    def add(self, other: Contribution) -> None:
        """Add a further contribution of the same learner: its pushes join this one's parts (the
        merge sums them), its counters are added up."""
        self.more += other.parts
        self.units += other.units
        self.c_steps += other.c_steps
        self.c_tokens += other.c_tokens
        self.c_time += other.c_time
        self.step_time = other.step_time
        self.base_version = min(self.base_version, other.base_version)
        self.nbytes += other.nbytes
        self.seq = max(self.seq, other.seq)


def _scaled(q: quant.Quantized, factor: float) -> quant.Quantized:
    """`q` times `factor`: a mode with scales by its scales (the same codes and indices), fp32
    values otherwise."""
    if q.mode in quant.QMAX or q.mode == "topk":
        return dataclasses.replace(q, scales=q.scales * factor)
    values = torch.mul(quant.dequantize(q), factor)
    return quant.Quantized("none", values.numel(), q.block, values, values.new_empty(0))


@dataclass
class Round:
    """The open round of one fragment."""

    fragment: int
    contributions: dict[str, Contribution] = field(default_factory=dict)
    first_at: float | None = None
    quorum_at: float | None = None
    grace_s: float = 0.0
    called_at: float | None = None  # syncer clock: when the round was called
    deadline: float | None = None  # syncer clock: when it closes with whoever is in (>= quorum)
    answered: set[str] = field(default_factory=set)  # syncer clock: learners heard from since the call

    def call(self, now: float, window: float) -> None:
        """The syncer's clock calls this round: it may close from now on, at the latest at now + window."""
        self.called_at, self.deadline = now, now + window

    def add(self, c: Contribution, quorum: int, grace_fn: GraceFn) -> None:
        """Add (or sum in) a contribution; start the grace window when quorum is first reached."""
        if c.learner in self.contributions:
            self.contributions[c.learner].add(c)
        else:
            self.contributions[c.learner] = c
        if self.called_at is not None:
            self.answered.add(c.learner)
        if self.first_at is None:
            self.first_at = c.arrived
        if self.quorum_at is None and len(self.contributions) >= quorum:
            self.quorum_at = c.arrived
            t_step = sum(x.step_time for x in self.contributions.values()) / len(self.contributions)
            self.grace_s = grace_fn(t_step, self.quorum_at - self.first_at)

    def ready(self, now: float, quorum: int, live: set[str], called: bool = False) -> bool:
        """Whether the round may close now: every live learner in, or (learner clocks) quorum +
        grace expired, or (`called`, the syncer clock) its window since the call has passed.
        Never below quorum; a syncer-clock round that was not called never closes by itself.

        On the syncer's clock "in" means answered since the call: a contribution that waited in
        the round from before it (a late push of the previous period, a backlog's carried rest)
        is merged with the round but does not stand for that learner's answer. Counted as one, it
        closed the round at the call, the answer arrived after the close and waited for the next
        call, and so on: that learner's work was merged one period late for the rest of the run
        (every learner after a syncer restart: the global model ended 3-4% behind)."""
        if called:
            if self.called_at is None or len(self.contributions) < quorum:
                return False
            return (bool(live) and live.issubset(self.answered)) or now >= (self.deadline or now)
        all_in = bool(live) and live.issubset(self.contributions)
        return merge.should_close(now, len(self.contributions), quorum, self.quorum_at, self.grace_s, all_in)

    def recount(self, quorum: int, now: float) -> None:
        """Re-evaluate the quorum time after contributions were dropped."""
        if len(self.contributions) < quorum:
            self.quorum_at = None
        if not self.contributions:
            self.first_at = None

    def oldest(self) -> Contribution | None:
        return min(self.contributions.values(), key=lambda c: c.arrived, default=None)


def withdraw(rounds: Iterable[Round], learner: str, quorum: int, now: float) -> list[int]:
    """Take `learner`'s pushes out of the open rounds; the fragments they were in.

    For a lock-step fleet when a new incarnation of `learner` joins: it pushes in the fleet's
    fragment order from the versions it fetches, which do not count its previous incarnation's
    unmerged push. Left in, that push closed the round of fragment p just after the new
    incarnation fetched p as not yet merged; the new one then pushed p again while the others
    waited for its p + 1, and the fleet stood still until the run ended (a synchronous fleet,
    two learners killed within a second). One fragment's window of the dead learner's work is
    lost, as the rest of its unsent work is."""
    out = []
    for rnd in rounds:
        if rnd.contributions.pop(learner, None) is not None:
            rnd.answered.discard(learner)
            rnd.recount(quorum, now)
            out.append(rnd.fragment)
    return out


def drop_oldest(rounds: Iterable[Round], max_queue: int, quorum: int, now: float) -> list[tuple[str, int]]:
    """Past `max_queue` contributions pending in `rounds`, drop the oldest ones (memory stays
    bounded); returns (learner, fragment) of each dropped."""
    rounds = list(rounds)
    dropped = []
    while sum(len(r.contributions) for r in rounds) > max_queue:
        # each non-empty round with its oldest contribution; the oldest of those is dropped
        oldest = [(c, r) for r in rounds if (c := r.oldest()) is not None]
        victim, rnd = min(oldest, key=lambda cr: cr[0].arrived)
        del rnd.contributions[victim.learner]
        rnd.recount(quorum, now)
        dropped.append((victim.learner, rnd.fragment))
    return dropped


def backlog_factor(c_steps: int, period_steps: float, max_backlog: float) -> float:
    """The share of a contribution of `c_steps` inner steps that counts in one round: at most
    `max_backlog` sync periods of `period_steps` (0 = no bound). A learner's work piled up over an
    outage or a partition enters as that many periods' worth of its average direction per round
    (the rest is carried, `Contribution.remainder`), not as one giant step."""
    if max_backlog <= 0 or c_steps <= 0:
        return 1.0
    return min(1.0, max_backlog * period_steps / c_steps)


class GraceFn:
    """grace(t_step, t_quorum) with the syncer's settings and its current merge-time estimate."""

    def __init__(self, gamma: float, tau: int, t_sync: float) -> None:
        self.gamma = gamma
        self.tau = tau
        self.t_sync = t_sync

    def __call__(self, t_step: float, t_quorum: float) -> float:
        return merge.grace_window(self.gamma, self.tau, t_step, t_quorum, self.t_sync)
