"""The global model's scores and the guard's rollback, on the syncer's core (pure: no I/O).

`take_snapshot` copies the global model for the evaluator when a score is due: every
`global_eval_every` outer steps, and at once after a (re)start. `apply_score` hands the
evaluator's loss to the guard (syncer/guard.py); a score the guard flags rolls the global
model back to the last snapshot that scored good: theta restored, the outer momentum and the
residual cleared (they carry the damaging step), every fragment's version moved on, the open
rounds dropped (their contributions may hold what did the damage) and every learner told to
refetch. The rolled-back model is checkpointed and scored again at once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from syncer.globalmodel import Outbox
from syncer.guard import Snapshot, Verdict
from syncer.wire.protocol import Message

if TYPE_CHECKING:
    from syncer.core import SyncerCore


def take_snapshot(core: SyncerCore, now: float) -> Snapshot | None:
    """A copy of the global model to score, if one is due (None otherwise)."""
    m = core.model
    every = core.s.global_eval_every
    if m is None or every <= 0 or core.guard.pending is not None:
        return None
    if core.scored_at is not None and core.outer_steps - core.scored_at < every:
        return None
    core.scored_at = core.outer_steps
    core.snapshot_tag += 1
    snap = Snapshot(
        core.snapshot_tag,
        core.outer_steps,
        list(m.versions),
        [t.clone() for t in m.theta],
        now,
        core.fleet.merged_tokens,
    )
    core.guard.offer(snap)
    return snap


def apply_score(core: SyncerCore, tag: int, loss: float, now: float, out: Outbox) -> Verdict | None:
    """Record the score of snapshot `tag`: a metrics record, and a rollback if the guard flags it."""
    judged = core.guard.record(tag, loss, now)
    if judged is None:
        return None
    verdict, snap = judged
    out.metrics.append(
        {
            "t": now,
            "kind": "global_eval",
            "loss": loss,
            "outer_step": snap.outer_step,
            "taken_at": snap.taken_at,
            "tokens_merged": int(snap.merged_tokens),
            "good": verdict.good,
            "reference": verdict.reference,
            "versions": snap.versions,
        }
    )
    if not verdict.good:
        _flagged(core, verdict, snap, now, out)
    return verdict


def flag_line(verdict: Verdict, what: str, threshold: float) -> str:
    """How a flagged score is said: "global model held-out loss 2.9 <what> is +14% against ..."."""
    ref = f"{verdict.reference:.3f}" if verdict.reference is not None else "none"
    finite = verdict.rise is not None and math.isfinite(verdict.loss)
    rise = f"{100 * verdict.rise:+.0f}%" if finite and verdict.rise is not None else "non-finite"
    return (
        f"global model held-out loss {verdict.loss:.4g} {what} is {rise} against "
        f"the best of its recent scores ({ref}; quality_guard {threshold:g})"
    )


def _flagged(core: SyncerCore, verdict: Verdict, snap: Snapshot, now: float, out: Outbox) -> None:
    good = core.guard.last_good
    head = flag_line(verdict, f"at outer step {snap.outer_step}", core.s.quality_guard)
    if good is None:
        out.event(now, "quality_guard", "syncer", f"{head}; no good state to roll back to")
        return
    rollback(core, good, now, out)
    out.event(
        now,
        "quality_guard",
        "syncer",
        f"{head}: rolled back to the state of outer step {good.outer_step}"
        f" (loss {core.guard.history[-1]:.3f}), every learner refetches it",
    )


def rollback(core: SyncerCore, good: Snapshot, now: float, out: Outbox) -> None:
    """Restore `good` as the global model (new versions, so every replica refetches it)."""
    m = core.model
    assert m is not None
    for p, theta in enumerate(good.theta):
        m.writable(p).copy_(theta)  # a lent value (chunks still queued) is never written: copy on write
        m.momentum[p].zero_()
        m.residual[p].zero_()
        m.versions[p] += 1
    core.drop_caches()
    core.rounds.clear()
    core.counters["rollbacks"] += 1
    core.scored_at = None  # score the restored state at once
    core.since_checkpoint = max(core.since_checkpoint, core.s.checkpoint_every)  # and checkpoint it
    out.broadcast(
        list(core.fleet.connected(now)), Message("resync", {"fragment": -1, "reason": "quality_guard rollback"})
    )
