"""The syncer's data desk: the data ledger (syncer/dataledger.py) spoken to over the wire.

Hellos and heartbeats carry a learner's `data` (its dataset's description, the units in its
hand, how many more it wants); the desk answers with a `units` message: ids to train, ids to drop.
Merges tell it which units a round carried; a learner's incarnation ending (restart, bye,
silence past ABANDON_S) sends its unmerged units back to the queue. What happens is an event.
Only shard 0 of a sharded syncer keeps the ledger (the fragments it counts are its own).
"""

from __future__ import annotations

from typing import Any

from syncer.dataledger import DataLedger, DataMismatch, Ended
from syncer.globalmodel import Outbox
from syncer.rounds import Contribution
from syncer.wire.protocol import Message, ProtocolError

ABANDON_S = 60.0  # a learner silent this long has its units handed to others (it restarts as a new incarnation)
HOLD_S = 10.0  # after a restore: how long holders have to report their hands
MAX_IDS = 4096  # units named in one message


def unit_ids(value: Any, what: str) -> list[int]:
    """A message's list of unit ids, checked (ProtocolError: dropped and counted)."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_IDS:
        raise ProtocolError("schema", f"{what}: units must be a list of at most {MAX_IDS} ids")
    if not all(isinstance(u, int) and not isinstance(u, bool) and 0 <= u < 1 << 62 for u in value):
        raise ProtocolError("schema", f"{what}: unit ids must be non-negative integers")
    return list(value)


def data_meta(meta: dict[str, Any], what: str) -> dict[str, Any] | None:
    """A hello's or heartbeat's `data`, checked (None: the learner trains off the ledger)."""
    data = meta.get("data")
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ProtocolError("schema", f"{what}: data must be an object")
    for key in ("sequences", "unit_sequences", "seq_len", "want", "received", "off_ledger", "beyond"):
        value = data.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
            raise ProtocolError("schema", f"{what}: data.{key} must be a non-negative integer")
    if not isinstance(data.get("digest", ""), str):
        raise ProtocolError("schema", f"{what}: data.digest must be a string")
    return {**data, "hand": unit_ids(data.get("hand"), what), "pushed": _pushed(data.get("pushed"), what)}


def _pushed(value: Any, what: str) -> dict[int, list[int]]:
    """`data.pushed`: [[unit id, [fragments it was pushed on]], ...], checked."""
    if value is None:
        return {}
    if not isinstance(value, list) or len(value) > MAX_IDS:
        raise ProtocolError("schema", f"{what}: data.pushed must be a list of at most {MAX_IDS} pairs")
    out: dict[int, list[int]] = {}
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[1], list) or len(pair[1]) > 1 << 16:
            raise ProtocolError("schema", f"{what}: data.pushed holds [unit, [fragments]] pairs")
        (uid,), fragments = unit_ids([pair[0]], what), unit_ids(pair[1], what)
        out[uid] = fragments
    return out


def with_again(data: dict[str, Any], again: dict[int, set[int]], fragments: tuple[int, ...]) -> dict[str, Any]:
    """A hello's `data` with the units of the pushes it sends again counted in its hand, not
    pushed on those fragments (a unit no longer in the hand was pushed on every other one)."""
    if not again:
        return data
    hand, pushed = list(data["hand"]), dict(data["pushed"])
    for uid, on in sorted(again.items()):
        before = pushed.get(uid, fragments if uid not in hand else [])
        pushed[uid] = [p for p in before if p not in on]
        hand += [] if uid in hand else [uid]
    return {**data, "hand": hand, "pushed": pushed}


class DataDesk:
    """The ledger of one run, and the messages and events around it."""

    def __init__(self, on: bool) -> None:
        self.on = on  # off: data_order = "shards", or a syncer shard other than 0; every call does nothing
        self.ledger = DataLedger(())
        self.silent: dict[str, float] = {}  # learner -> since when it holds units and is not live
        self.announced: set[int] = set()  # epochs whose end was an event
        self.busy_s = 0.0  # the rounds' bookkeeping, after their updates left (SyncerCore.settle)

    def restored(self, state: dict[str, Any], now: float, known: set[str]) -> None:
        """The ledger of a checkpoint (the learners it knew have HOLD_S to report their hands)."""
        self.ledger.load_state_dict(state, now, HOLD_S, known)
        self.announced = {e for e in self.ledger.closed if self.ledger.epoch_done(e)}

    def hello(
        self,
        learner: str,
        incarnation: str,
        fresh: bool,
        meta: dict[str, Any],
        now: float,
        out: Outbox,
        again: dict[int, set[int]] | None = None,
    ) -> str | None:
        """A hello: earlier incarnations' units settled; the hand reconciled (`again`: units the
        learner pushes again, and on which fragments: syncer/receipts.py). Returns why the learner
        is refused (its data is not the run's), or None."""
        if not self.on:
            return None
        if fresh:
            self._said(
                learner, "its incarnation ended (restart)", self.ledger.ended(learner, keep=incarnation), now, out
            )
        data = data_meta(meta, "hello")
        if data is None:
            return None
        data = with_again(data, again or {}, self.ledger.fragments)
        try:
            drop, ended = self.ledger.hello(learner, incarnation, data, now)
        except DataMismatch as exc:
            out.event(now, "data_mismatch", learner, str(exc)[:300])
            return f"data: {exc}"
        self._said(
            learner,
            "pushed to the syncer that died: merged after its last checkpoint, or lost on the way",
            ended,
            now,
            out,
        )
        uids = self.ledger.issue(learner, incarnation, data, now)  # its first units come with the welcome
        self.settled(now, out)
        if drop or uids:
            out.send(learner, Message("units", {"units": uids, "drop": drop}))
        return None

    def heartbeat(self, learner: str, incarnation: str, meta: dict[str, Any], now: float, out: Outbox) -> None:
        data = data_meta(meta, "heartbeat") if self.on else None
        if data is None:
            return
        try:
            self.ledger.adopt(data)  # its hello said nothing of its data (its workload was not built yet)
        except DataMismatch as exc:
            out.event(now, "data_mismatch", learner, str(exc)[:300])
            out.send(learner, Message("error", {"reason": f"data: {exc}", "fatal": True}))
            return
        self.silent.pop(learner, None)
        uids = self.ledger.issue(learner, incarnation, data, now)
        self.settled(now, out)  # the end of a hold after a restore
        if uids:
            out.send(learner, Message("units", {"units": uids, "drop": []}))

    def merged(self, fragment: int, contribs: list[Contribution], now: float, out: Outbox) -> None:
        """A round of global fragment `fragment` merged these contributions."""
        if not self.on:
            return
        self.ledger.round_closed(fragment, [(c.learner, c.incarnation, c.units) for c in contribs])
        self.settled(now, out)

    def carried(self, fragment: int, c: Contribution) -> None:
        """A push of global fragment `fragment` was taken into a round."""
        if self.on and c.units:
            self.ledger.carried(fragment, c.learner, c.incarnation, c.units)

    def left(self, learner: str, now: float, out: Outbox) -> None:
        """A bye: the learner's units are settled (its pushes before the bye have arrived)."""
        if not self.on:
            return
        self._said(learner, "it left", self.ledger.ended(learner), now, out)
        self.settled(now, out)

    def tick(self, live: set[str], now: float, out: Outbox) -> None:
        """Learners silent past ABANDON_S lose their units to the queue."""
        if not self.on:
            return
        holders = {u.learner for u in self.ledger.open.values()}
        for learner in holders - live:
            since = self.silent.setdefault(learner, now)
            if now - since >= ABANDON_S:
                self._said(learner, f"silent for {ABANDON_S:.0f} s", self.ledger.ended(learner), now, out)
                self.silent.pop(learner)
                self.settled(now, out)
        for learner in set(self.silent) - holders:
            self.silent.pop(learner)

    def _said(self, learner: str, why: str, ended: Ended, now: float, out: Outbox) -> None:
        if ended.requeued:
            n = len(ended.requeued)
            out.event(
                now,
                "units_requeued",
                learner,
                f"{n} unit{'s' * (n != 1)} back to the queue ({ended.trained} trained, never merged; "
                f"{n - ended.trained} not finished): {why}; units {id_ranges(ended.requeued)}",
            )
            self.ledger.requeued_now = [(lid, u) for lid, u in self.ledger.requeued_now if u not in ended.requeued]
        if ended.partial:
            parts = ", ".join(f"{uid} on {k} of {len(self.ledger.fragments)}" for uid, k in ended.partial[:8])
            out.event(now, "units_partial", learner, f"{len(ended.partial)} closed partly merged ({parts}): {why}")

    def settled(self, now: float, out: Outbox) -> None:
        """Events for units queued again by a round or a restore (a learner's end says its own),
        and for each epoch whose every unit is now closed, however its last one closed."""
        by: dict[str, list[int]] = {}
        for learner, uid in self.ledger.requeued_now:
            by.setdefault(learner, []).append(uid)
        self.ledger.requeued_now = []
        for learner, uids in sorted(by.items()):
            why = "issued after the checkpoint the syncer restarted from" if learner == "syncer" else "no push merged"
            out.event(now, "units_requeued", learner, f"{len(uids)} back to the queue ({why}); units {id_ranges(uids)}")
        for e in sorted(set(self.ledger.closed) - self.announced):
            if self.ledger.epoch_done(e):
                self.announced.add(e)
                merged, partial = self.ledger.closed[e]
                lost = self.ledger.counters["lost"]
                out.event(
                    now,
                    "epoch_done",
                    "syncer",
                    f"epoch {e + 1} merged: {merged + partial} units ({partial} partly); "
                    f"{lost} lost and handed out again so far",
                )

    def snapshot(self) -> dict[str, Any] | None:
        snap = self.ledger.snapshot() if self.on else None
        return None if snap is None else {**snap, "bookkeeping_s": round(self.busy_s, 6)}


def id_ranges(uids: list[int]) -> str:
    """Unit ids as compact ranges: "3-5,9" (the events name every unit queued again)."""
    out: list[str] = []
    for uid in sorted(set(uids)):
        if out and uid == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{uid}"
        else:
            out.append(str(uid))
    return ",".join(out)


def parse_ranges(text: str) -> list[int]:
    """The ids of `id_ranges` text."""
    ids: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        ids.extend(range(int(first), int(last or first) + 1))
    return ids
