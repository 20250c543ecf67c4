"""The quality guard: the global model's held-out loss, judged against its own recent history.

Pure (no I/O, times passed in). The syncer's evaluator (syncer/evaluator.py) scores a snapshot
of the global model every `global_eval_every` outer steps on the run's fixed held-out batches.
The same batches every time, so the curve has no sampling noise: between two evaluations a
healthy model's loss moves by a fraction of a percent, down early in training, flat later. A
jump of more than `quality_guard` (default 10%) above the best of the last `HISTORY` good scores
is damage (a burst of stale work merged at once, a wrong outer step), not noise. The guard then
says so, and the syncer rolls the global model back to the last snapshot that scored good
(SyncerCore.guard_result); checkpoints and exports say which state was last judged good.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

import torch

HISTORY = 8  # good scores the reference is taken from


@dataclass
class Snapshot:
    """A copy of the global model taken for scoring (theta per fragment, with its versions)."""

    tag: int
    outer_step: int
    versions: list[int]
    theta: list[torch.Tensor]
    taken_at: float
    merged_tokens: float = 0.0  # tokens merged into the global model when the copy was taken


@dataclass
class Verdict:
    """What the guard made of one score."""

    loss: float
    reference: float | None  # best of the recent good scores (None: nothing to compare yet)
    good: bool

    @property
    def rise(self) -> float | None:
        return None if self.reference is None else self.loss / self.reference - 1.0


@dataclass
class QualityGuard:
    """Recent good scores, the last good snapshot and the one being scored."""

    threshold: float  # 0: never flags
    history: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=HISTORY))
    last_good: Snapshot | None = None
    pending: Snapshot | None = None
    last: dict[str, Any] | None = None  # the latest score, for status and metrics
    trips: int = 0
    off: str | None = None  # why nothing is scored, so nothing judged (syncer/common/unscored.py)

    def judge(self, loss: float) -> Verdict:
        reference = min(self.history) if self.history else None
        bad = not math.isfinite(loss) or (
            self.threshold > 0 and reference is not None and loss > reference * (1.0 + self.threshold)
        )
        return Verdict(loss, reference, not bad)

    def offer(self, snap: Snapshot) -> None:
        """The snapshot now being scored (a newer one replaces one not yet scored)."""
        self.pending = snap

    def record(self, tag: int, loss: float, now: float) -> tuple[Verdict, Snapshot] | None:
        """Judge the score of snapshot `tag`; None if it is not the one pending (stale result)."""
        snap = self.pending
        if snap is None or snap.tag != tag:
            return None
        self.pending = None
        verdict = self.judge(loss)
        if verdict.good:
            self.history.append(loss)
            self.last_good = snap
        else:
            self.trips += 1
        self.last = {
            "t": now,
            "loss": loss,
            "outer_step": snap.outer_step,
            "good": verdict.good,
            "reference": verdict.reference,
            "age_s": now - snap.taken_at,
            "trips": self.trips,
        }
        return verdict, snap

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the good history (a restarted syncer judges against it)."""
        return {"history": list(self.history), "trips": self.trips}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.extend(float(x) for x in state.get("history", []) if math.isfinite(float(x)))
        self.trips = int(state.get("trips", 0))
