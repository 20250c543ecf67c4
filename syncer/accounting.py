"""What the syncer counts: outer steps and checkpoints, rejections, bytes, each round's record.

One concern of the core (syncer/core.py composes it): every figure the status snapshot
(syncer/status.py), the checkpoint (syncer/checkpoint.py) and the metrics log read about the
syncer's own work. Pure: `now` and the merge time are passed in; records go into the `Outbox`.
The other parts tally into `counters` (pushes, calls, clipped, dropped sends, ...): it is handed
to them, one Counter for the run, owned here.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from syncer.common import smallmath
from syncer.fleet import Ledger
from syncer.globalmodel import Outbox
from syncer.rounds import Contribution, Round


class Accounting:
    """The syncer's counters, its outer-step clock and the rounds' records."""

    def __init__(self, now: float) -> None:
        self.started = now
        self.outer_steps = 0
        self.since_checkpoint = 0  # outer steps no checkpoint holds yet
        self.checkpoint_outer_step = 0  # the outer step of the newest checkpoint written
        self.t_sync: float | None = None  # a round's merge time (EMA), for the rounds' grace
        self.rejected: collections.Counter[str] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter()
        self.bytes_up = 0
        self.bytes_down = 0
        self.recent_rounds: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)

    def reject(self, reason: str, learner: str, detail: str, now: float, out: Outbox) -> None:
        """Count a rejected message and record it as an event."""
        self.rejected[reason] += 1
        out.event(now, "reject", learner, f"{reason}: {detail}"[:300])

    def checkpoint_due(self, every: int) -> bool:
        """Whether `every` outer steps went by since the newest checkpoint."""
        return self.since_checkpoint >= every

    def checkpoint_written(self, outer_step: int) -> None:
        """A checkpoint of the state at `outer_step` was written."""
        self.since_checkpoint = self.outer_steps - outer_step
        self.checkpoint_outer_step = outer_step

    def round_closed(self, closed: ClosedRound, fleet: Ledger, quorum: int, now: float, out: Outbox) -> None:
        """The round's merge in the fleet's counters, the merge-time estimate and the metrics."""
        rnd, contribs, weights = closed.round, closed.contribs, closed.weights
        total_w = sum(weights) or 1.0
        # each fragment is 1/P of the model; a shard's fragments stand for the whole model in its
        # accounting, so shard 0's goodput and merged tokens are the run's (balanced shards)
        for c, w in zip(contribs, weights):
            fleet.merged(c.learner, round(c.c_tokens * c.backlog), c.c_time * c.backlog, closed.parts, w, now)
        self.outer_steps += 1
        self.since_checkpoint += 1
        self.t_sync = smallmath.ema(self.t_sync, closed.merge_s, 0.8)
        grace_used = max(0.0, now - rnd.quorum_at) if rnd.quorum_at is not None else 0.0
        self.recent_rounds.append({"contributors": len(contribs), "grace_s": rnd.grace_s, "grace_used_s": grace_used})
        out.metrics.append(
            {
                "t": now,
                "kind": "round",
                "fragment": rnd.fragment,
                "version": closed.version,
                "contributors": [c.learner for c in contribs],
                "weights": {c.learner: round(w / total_w, 4) for c, w in zip(contribs, weights)},
                "tokens": sum(c.c_tokens for c in contribs),
                "wait_quorum_s": max(0.0, (rnd.quorum_at or now) - (rnd.called_at or rnd.first_at or now)),
                "grace_s": rnd.grace_s,
                "grace_used_s": grace_used,
                "bytes_in": sum(c.nbytes for c in contribs),
                "bytes_out": closed.bytes_out,
                "merge_s": closed.merge_s,
                "live": len(fleet.live(now)),
                "quorum": quorum,
                "staleness": max(closed.version - 1 - c.base_version for c in contribs),
                "period_share": round(closed.share, 4),
                "judged": closed.judged,  # [norm / median, mean cosine, regular, signal] (syncer/judge.py)
            }
        )


@dataclass
class ClosedRound:
    """One round as it closed: what `Accounting.round_closed` records."""

    round: Round
    contribs: list[Contribution]
    version: int  # the fragment's new version
    parts: int  # fragments of the model (each merge stands for 1/parts of it)
    bytes_out: int  # the update's bytes, times its recipients
    merge_s: float
    share: float  # the round's share of a sync period (syncer/outerstep.py)
    judged: Any  # the screen's last judgement (syncer/screening.py)

    @property
    def weights(self) -> list[float]:
        return [c.weight for c in self.contribs]
