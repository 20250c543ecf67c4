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

Pure: snapshot dict in, a new snapshot dict out (the input is not changed).
"""

from __future__ import annotations

from typing import Any

from dldctl.observe.view_data import dicts, num, section, syncer_alive, text_of

NO_RATE = ("dead", "stopped", "refused", "restarting", "queued")
# the states that cannot train (as dldctl/chaos/inject.py's DOWN_STATES)
NOT_LIVE = ("dead", "restarting", "stopped", "refused", "starting", "queued", "paused", "partitioned")


def consistent(snapshot: Any) -> dict:
    """The snapshot with its quorum, learner rows and rates made to agree (see the module doc)."""
    if not isinstance(snapshot, dict):
        return {}
    snap = dict(snapshot)
    rows = [dict(r) for r in dicts(snapshot.get("learners"))]
    if not isinstance(snapshot.get("learners"), list):
        return snap
    for row in rows:
        if row.get("state") in NO_RATE:
            row["tokens_per_s"], row["straggler"] = None, False
    snap["learners"] = rows
    if not rows or not syncer_alive(snapshot):
        return snap
    quorum = dict(section(snapshot, "quorum"))
    able = sum(1 for r in rows if r.get("state") not in NOT_LIVE)
    live = num(quorum.get("live"))
    if live is not None and live > able:
        quorum["live"] = able
        minimum = num(quorum.get("min"))
        if minimum is not None and able < minimum:
            quorum["below_quorum"] = True
    snap["quorum"] = quorum
    if isinstance(snapshot.get("tokens"), dict):
        rates = [v for v in (num(r.get("tokens_per_s")) for r in rows) if v is not None]
        snap["tokens"] = dict(snapshot["tokens"], per_s=sum(rates)) if rates else dict(snapshot["tokens"])
    return snap


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


def _id_key(learner: dict) -> tuple[int, str]:
    name = text_of(learner.get("id"))
    tail = name.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else 1 << 30, name)


def _sort_key(column: str) -> Any:
    """The key of a sort column: ids in number order; troubled states first; the biggest
    rates and steps first; the oldest heartbeat first. Missing values go last."""

    def descending(field: str) -> Any:
        return lambda r: (num(r.get(field)) is None, -(num(r.get(field)) or 0.0), _id_key(r))

    return {
        "state": lambda r: (STATE_RANK.get(str(r.get("state")), 9), _id_key(r)),
        "tok/s": descending("tokens_per_s"),
        "step": descending("step"),
        "hb": descending("heartbeat_age_s"),
    }.get(column, _id_key)


def sort_learners(learners: list[dict], column: str) -> list[dict]:
    """The learners in the order of `column` ("learner", "state", "tok/s", "step", "hb")."""
    return sorted(learners, key=_sort_key(column))


def learner_order(snapshot: dict, column: str) -> list[str]:
    """The learners' ids as the table shows them, top to bottom (what the arrow keys walk)."""
    return [text_of(r.get("id")) for r in sort_learners(dicts(snapshot.get("learners")), column)]


def learner_events(snapshot: dict, learner_id: str, count: int = 8) -> list[dict]:
    """The newest `count` events about one learner, oldest first."""
    return [e for e in dicts(snapshot.get("events")) if e.get("target") == learner_id][-count:] if count > 0 else []
