"""One frame of the status view is one consistent snapshot, and its learners in the chosen order.

A snapshot joins two sources taken a moment apart: the run state (processes, so learner states)
and the syncer (heartbeats, rates, the quorum). Right after a kill the state already says `dead`
while the syncer still counts the learner live and reports its last rate. `consistent` settles
that from the snapshot itself, so the quorum, the learner rows and the rates of one frame agree:

- a learner that is `dead`, `stopped` or `restarting` shows no rate (`tokens_per_s` None: "-")
  and is no straggler;
- `quorum.live` is at most the learners whose state can train (not dead, restarting, stopped,
  starting, paused or partitioned: the chaos guard's count), and `below_quorum` follows from it;
- `tokens.per_s` is the sum of the rates the rows show.

Pure: a snapshot (typed, or its JSON) in, a new typed snapshot out (the input is not changed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from dldctl.observe.snapshot_model import Event, Learner, Snapshot, as_snapshot

NO_RATE = ("dead", "stopped", "refused", "restarting", "queued")
# the states that cannot train (as dldctl/chaos/inject.py's DOWN_STATES)
NOT_LIVE = ("dead", "restarting", "stopped", "refused", "starting", "queued", "paused", "partitioned")


def consistent(snapshot: Snapshot | Mapping[str, Any]) -> Snapshot:
    """The snapshot with its quorum, learner rows and rates made to agree (see the module doc)."""
    snap = as_snapshot(snapshot)
    rows = tuple(replace(r, tokens_per_s=None, straggler=False) if r.state in NO_RATE else r for r in snap.learners)
    snap = replace(snap, learners=rows)
    if not rows or not snap.syncer.alive:
        return snap
    quorum = snap.quorum
    able = sum(1 for r in rows if r.state not in NOT_LIVE)
    if quorum.live > able:
        quorum = replace(quorum, live=able, below_quorum=quorum.below_quorum or able < quorum.min)
    rates = [r.tokens_per_s for r in rows if r.tokens_per_s is not None]
    tokens = replace(snap.tokens, per_s=sum(rates)) if rates else snap.tokens
    return replace(snap, quorum=quorum, tokens=tokens)


# ---------------------------------------------------------------- sorting


STATE_RANK = {
    "dead": 0,
    "refused": 0,
    "restarting": 1,
    "queued": 1,
    "partitioned": 2,
    "paused": 3,
    "slow": 4,
    "starting": 5,
    "joining": 6,
    "running": 7,
    "stopped": 8,
}


def _id_key(learner: Learner) -> tuple[int, str]:
    name = learner.id
    tail = name.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else 1 << 30, name)


def _sort_key(column: str) -> Callable[[Learner], Any]:
    """The key of a sort column: ids in number order; troubled states first; the biggest
    rates and steps first; the oldest heartbeat first. Missing values go last."""

    def descending(field: str) -> Callable[[Learner], Any]:
        def key(r: Learner) -> Any:
            value = getattr(r, field)
            return (value is None, -(value or 0.0), _id_key(r))

        return key

    return {
        "state": lambda r: (STATE_RANK.get(r.state, 9), _id_key(r)),
        "tok/s": descending("tokens_per_s"),
        "step": descending("step"),
        "hb": descending("heartbeat_age_s"),
    }.get(column, _id_key)


def sort_learners(learners: Sequence[Learner], column: str) -> list[Learner]:
    """The learners in the order of `column` ("learner", "state", "tok/s", "step", "hb")."""
    return sorted(learners, key=_sort_key(column))


def learner_order(snapshot: Snapshot | Mapping[str, Any], column: str) -> list[str]:
    """The learners' ids as the table shows them, top to bottom (what the arrow keys walk)."""
    return [r.id for r in sort_learners(as_snapshot(snapshot).learners, column)]


def learner_events(snap: Snapshot, learner_id: str, count: int = 8) -> list[Event]:
    """The newest `count` events about one learner, oldest first."""
    return [e for e in snap.events if e.target == learner_id][-count:] if count > 0 else []
