"""The data ledger: the syncer owns the data cursor (ALGORITHM.md, "Data"; docs/algorithm.md).

Pure bookkeeping, no I/O. The dataset is `count` work units per epoch (workload/units.py says
which sequences a unit id is); the ledger hands ids out in order, epoch after epoch, and records
each unit's fate:

    issued    handed to one incarnation of one learner (ahead of need)
    carried   a push of that incarnation named it (it was trained)
    merged    on fragment p: a round merged a push of p that carried it. The unit is merged once
              every fragment this ledger counts (all of them, unsharded) has merged it.
    ended     its incarnation ended (restart, bye, silence past `abandon_s`) before that:
              - carried by no merged push (trained or not): lost, and back to the queue, first
                in line to be handed out again;
              - merged on some fragments only: closed as partly merged, never handed out again
                (handing it out again would merge it twice on those fragments).

So no unit is merged twice on any fragment, and every unit of an epoch is merged on at least one
fragment, most on all. A push carries the units whose last sequence was trained since that
fragment's previous push, so "merged on p" means the push that took the unit's last step to p
was merged. After a syncer restart the ledger is the checkpoint's: what was merged after it was
lost with the global state, and those units go back to the queue like a dead learner's.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

MAX_ISSUE = 64  # units handed out per request


class DataMismatch(ValueError):
    """A learner's dataset is not the run's (other size, unit size or digest)."""


@dataclass
class Unit:
    """An open unit: who holds it and which fragments merged it."""

    learner: str
    incarnation: str
    merged: set[int] = field(default_factory=set)
    carried: bool = False  # a push named it: it was trained
    carried_on: set[int] = field(default_factory=set)  # fragments whose push that named it was taken into a round
    missed: set[int] = field(default_factory=set)  # ... and whose push was dropped (a later one of its learner merged)
    ended: bool = False  # its incarnation ended while a push of it waited in a round

    def pending(self) -> set[int]:
        """Fragments whose round holds a push of this unit, not closed yet."""
        return self.carried_on - self.merged - self.missed


@dataclass
class Ended:
    """What an incarnation's end did to its units."""

    requeued: list[int] = field(default_factory=list)
    trained: int = 0  # of the requeued, how many a push had carried
    partial: list[tuple[int, int]] = field(default_factory=list)  # (uid, fragments merged)


@dataclass
class DataLedger:
    """Units, their holders and fates, and the counters status shows."""

    fragments: tuple[int, ...]  # the global fragments whose merges count (this shard's)
    sequences: int = 0
    unit_sequences: int = 0
    seq_len: int = 0
    digest: str = ""
    next_uid: int = 0
    requeue: collections.deque[int] = field(default_factory=collections.deque)
    open: dict[int, Unit] = field(default_factory=dict)
    closed: dict[int, list[int]] = field(default_factory=dict)  # epoch -> [merged, partial]
    sent: dict[tuple[str, str], int] = field(default_factory=dict)  # units issued to an incarnation
    counters: collections.Counter[str] = field(default_factory=collections.Counter)
    tokens_by_learner: collections.Counter[str] = field(default_factory=collections.Counter)
    off_ledger: dict[str, int] = field(default_factory=dict)  # learner -> off-ledger tokens (its last report)
    hold_until: float = 0.0  # after a restore: hand out nothing new until then (holders report first)
    waiting_for: set[str] = field(default_factory=set)  # restored holders not heard from yet
    requeued_now: list[tuple[str, int]] = field(default_factory=list)  # (learner, uid) queued again: for the events
    beyond: int = 0  # after a restore: 1 + the highest unit id a reconnecting learner was ever handed
    waiting: dict[int, set[int]] = field(default_factory=dict)  # fragment -> units a push of which is in its round

    # -- the dataset -------------------------------------------------------------------------
    @property
    def count(self) -> int:
        return -(-self.sequences // self.unit_sequences) if self.unit_sequences else 0

    def describe(self) -> str:
        return f"{self.sequences} sequences of {self.seq_len} tokens in units of {self.unit_sequences} ({self.digest})"

    def adopt(self, data: dict[str, Any]) -> None:
        """Take the first learner's description of the data, or refuse one that differs."""
        mine = (self.sequences, self.unit_sequences, self.seq_len, self.digest)
        theirs = (int(data["sequences"]), int(data["unit_sequences"]), int(data["seq_len"]), str(data["digest"]))
        if theirs[0] < 1 or theirs[1] < 1 or theirs[2] < 1:
            raise DataMismatch(f"its data has {theirs[0]} sequences in units of {theirs[1]}: nothing to hand out")
        if self.sequences == 0:
            self.sequences, self.unit_sequences, self.seq_len, self.digest = theirs
            return
        if theirs != mine:
            raise DataMismatch(
                f"its dataset is {theirs[0]} sequences of {theirs[2]} tokens in units of {theirs[1]} "
                f"({theirs[3]}), the run's is {self.describe()}: every learner must read the same data "
                "with the same seq_len, batch_size, H and fragments (or set unit_sequences)"
            )

    def tokens_of(self, uid: int) -> int:
        index = uid % self.count
        return (min(self.sequences, (index + 1) * self.unit_sequences) - index * self.unit_sequences) * self.seq_len

    # -- handing out -------------------------------------------------------------------------
    def hello(self, learner: str, incarnation: str, data: dict[str, Any], now: float) -> tuple[list[int], Ended]:
        """A (re)connecting incarnation's report of its hand: the units it has not yet pushed on
        every fragment. Returns the units it must drop (another learner holds them, or they are
        closed), and, after a restore, what ending its other units did: those the checkpoint
        gave it that it no longer holds were pushed to the syncer that died, and what of them
        was merged after the checkpoint was lost with it."""
        self.adopt(data)
        hand = [int(u) for u in data.get("hand", [])]
        restored = self.holding(now)
        self.waiting_for.discard(learner)
        if restored:
            self.beyond = max(self.beyond, int(data.get("beyond", 0)))
        drop = [uid for uid in hand if not self._claim(uid, learner, incarnation, restored)]
        for uid, fragments in data.get("pushed", {}).items() if restored else ():
            self._pushed_before(uid, learner, fragments)
        held = set(hand)
        gone = [(u, x) for u, x in sorted(self.open.items()) if restored and x.learner == learner and u not in held]
        return drop, self._end(gone)

    def _claim(self, uid: int, learner: str, incarnation: str, restored: bool) -> bool:
        """Whether `learner` may keep unit `uid` it says it holds (after a restore: units issued
        since the checkpoint become its own again)."""
        unit = self.open.get(uid)
        if unit is not None:
            if unit.learner != learner:
                return False
            unit.incarnation = incarnation
            return True
        if not restored or not 0 <= uid < self.count * (1 << 20) or self._is_closed(uid):
            return False
        if uid in self.requeue:
            self.requeue.remove(uid)
        self.open[uid] = Unit(learner, incarnation)
        self.counters["adopted"] += 1
        return True

    def _pushed_before(self, uid: int, learner: str, fragments: list[int]) -> None:
        """After a restore: a unit in `learner`'s hand it had pushed on `fragments` before the
        syncer died. What of those pushes the checkpoint had not seen merged died with its rounds:
        missed (it is never pushed on them again, so nothing else would settle them)."""
        unit = self.open.get(uid)
        if unit is None or unit.learner != learner:
            return
        unit.missed |= set(fragments) - unit.merged
        self._settle_if_done(uid, unit)

    def _is_closed(self, uid: int) -> bool:
        """Closed (merged or partly): below the cursor and neither open nor waiting in the queue."""
        return uid < self.next_uid and uid not in self.open and uid not in self.requeue

    def holding(self, now: float) -> bool:
        """After a restore: until every holder said hello (or `hold_s` passed), nothing new is
        handed out, and hellos may claim units issued since the checkpoint."""
        if self.hold_until and (now >= self.hold_until or not self.waiting_for):
            self._settle()
        return bool(self.hold_until)

    def _settle(self) -> None:
        """The hold is over: units past the checkpoint's cursor that nobody claimed were issued
        since it and lost with the syncer; they go back to the queue, the cursor past them."""
        top = max([self.beyond - 1, *(uid for uid in self.open if uid >= self.next_uid)])
        if top >= self.next_uid:
            gone = [u for u in range(self.next_uid, top + 1) if u not in self.open]
            self.requeue.extend(gone)
            self.requeued_now += [("syncer", u) for u in gone]
            self.counters["lost"] += len(gone)
            self.next_uid = top + 1
        self.hold_until, self.waiting_for, self.beyond = 0.0, set(), 0

    def issue(self, learner: str, incarnation: str, data: dict[str, Any], now: float) -> list[int]:
        """Units to hand to `learner` for its heartbeat's `want` (those still on their way counted)."""
        if self.sequences == 0 or self.holding(now):
            return []
        key = (learner, incarnation)
        in_transit = max(0, self.sent.get(key, 0) - int(data.get("received", 0)))
        self.off_ledger[learner] = int(data.get("off_ledger", 0))
        out: list[int] = []
        for _ in range(max(0, min(MAX_ISSUE, int(data.get("want", 0)) - in_transit))):
            out.append(self._next())
            self.open[out[-1]] = Unit(learner, incarnation)
        self.sent[key] = self.sent.get(key, 0) + len(out)
        self.counters["issued"] += len(out)
        return out

    def _next(self) -> int:
        while self.requeue:
            uid = self.requeue.popleft()
            if uid not in self.open:
                self.counters["reissued"] += 1
                return uid
        self.next_uid += 1
        return self.next_uid - 1

    # -- fates -------------------------------------------------------------------------------
    def round_closed(self, fragment: int, merged: list[tuple[str, str, list[int]]]) -> None:
        """A round of `fragment` merged these (learner, incarnation, units) pushes. A unit whose
        push of `fragment` was taken into this round (the fragment's only open one) and is not
        among them lost that push (a full queue, a `down`): it is done with `fragment` too. A unit
        done with every fragment is settled. A unit named by an incarnation that does not hold it
        is ignored (counted). Only the units that waited on this round are looked at."""
        named: set[int] = set()
        for learner, incarnation, uids in merged:
            for uid in uids:
                unit = self.open.get(uid)
                if unit is None or (unit.learner, unit.incarnation) != (learner, incarnation):
                    self.counters["stale_merges"] += 1
                    continue
                unit.carried = True
                unit.merged.add(fragment)
                named.add(uid)
        for uid in sorted(named | self.waiting.pop(fragment, set())):
            unit = self.open.get(uid)
            if unit is None:
                continue  # closed or queued again meanwhile
            if uid not in named:
                unit.missed.add(fragment)
                self.counters["missed"] += 1
            self._settle_if_done(uid, unit)

    def _settle_if_done(self, uid: int, unit: Unit) -> None:
        if (unit.merged | unit.missed).issuperset(self.fragments) or (unit.ended and not unit.pending()):
            self._settle_unit(uid, unit)

    def _settle_unit(self, uid: int, unit: Unit) -> bool:
        """A unit done: closed if merged on any fragment (partly if not on all), else lost and
        queued again (True)."""
        if unit.merged:
            self._close(uid, unit.learner, len(unit.merged))
            return False
        del self.open[uid]
        self.requeue.append(uid)
        self.requeued_now.append((unit.learner, uid))
        self.counters["lost"] += 1
        return True

    def carried(self, fragment: int, learner: str, incarnation: str, uids: list[int]) -> None:
        """A push of `fragment` naming these units was taken into a round: they were trained."""
        for uid in uids:
            unit = self.open.get(uid)
            if unit is not None and (unit.learner, unit.incarnation) == (learner, incarnation):
                unit.carried = True
                unit.carried_on.add(fragment)
                self.waiting.setdefault(fragment, set()).add(uid)

    def ended(self, learner: str, keep: str | None = None) -> Ended:
        """Every incarnation of `learner` but `keep` ended: their units are settled (`_end`)."""
        self.sent = {k: v for k, v in self.sent.items() if k[0] != learner or k[1] == keep}
        return self._end(
            [(u, x) for u, x in sorted(self.open.items()) if x.learner == learner and x.incarnation != keep]
        )

    def _end(self, units: list[tuple[int, Unit]]) -> Ended:
        """These units' holder ended. Those not in a round are settled now: partly merged ones
        closed, unmerged ones back to the queue; one whose push waits in a round is settled
        when that round closes (`round_closed`)."""
        out = Ended()
        for uid, unit in units:
            unit.ended = True
            if unit.pending():
                continue
            if self._settle_unit(uid, unit):
                out.requeued.append(uid)
                out.trained += unit.carried
            else:
                out.partial.append((uid, len(unit.merged)))
        return out

    def _close(self, uid: int, learner: str, merged_on: int) -> None:
        self.open.pop(uid, None)
        epoch = uid // self.count
        tally = self.closed.setdefault(epoch, [0, 0])
        tally[0 if merged_on == len(self.fragments) else 1] += 1
        tokens = self.tokens_of(uid) * merged_on // max(1, len(self.fragments))
        self.counters["merged_tokens"] += tokens
        self.tokens_by_learner[learner] += tokens

    def epoch_done(self, epoch: int) -> bool:
        return sum(self.closed.get(epoch, [0, 0])) >= self.count > 0

    # -- status and checkpoint ---------------------------------------------------------------
    def snapshot(self) -> dict[str, Any] | None:
        if self.sequences == 0:
            return None
        epoch = next((e for e in sorted(self.closed) if not self.epoch_done(e)), self.next_uid // self.count)
        merged, partial = self.closed.get(epoch, [0, 0])
        return {
            "order": "ledger",
            "epoch": epoch + 1,
            "units": self.count,
            "unit_tokens": self.unit_sequences * self.seq_len,
            "merged": merged,
            "partial": partial,
            "merged_share": round((merged + partial) / self.count, 4),
            "in_flight": len(self.open),
            "queued_again": len(self.requeue),
            "lost": self.counters["lost"],
            "reissued": self.counters["reissued"],
            "epochs_done": sum(1 for e in self.closed if self.epoch_done(e)),
            "merged_tokens": self.counters["merged_tokens"],
            "tokens_by_learner": dict(sorted(self.tokens_by_learner.items())),
            "off_ledger_tokens": sum(self.off_ledger.values()),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "dataset": [self.sequences, self.unit_sequences, self.seq_len, self.digest],
            "next_uid": self.next_uid,
            "requeue": list(self.requeue),
            "open": {
                str(u): [x.learner, x.incarnation, sorted(x.merged), x.carried, sorted(x.carried_on), sorted(x.missed)]
                for u, x in self.open.items()
            },
            "closed": {str(e): t for e, t in self.closed.items()},
            "counters": dict(self.counters),
            "tokens_by_learner": dict(self.tokens_by_learner),
            "off_ledger": dict(self.off_ledger),
        }

    def load_state_dict(
        self, state: dict[str, Any], now: float, hold_s: float, known: frozenset[str] | set[str] = frozenset()
    ) -> None:
        """Restore a checkpoint's ledger; hand out nothing new for `hold_s` or until every
        learner it knew (`known`, and every holder) has said hello: any may hold, or have been
        handed, units issued after the checkpoint."""
        self.sequences, self.unit_sequences, self.seq_len, self.digest = state["dataset"]
        self.next_uid = int(state["next_uid"])
        self.requeue = collections.deque(int(u) for u in state["requeue"])
        self.open = {
            int(u): Unit(a, b, set(m), bool(c), set(co), set(mi)) for u, (a, b, m, c, co, mi) in state["open"].items()
        }
        self.closed = {int(e): list(t) for e, t in state["closed"].items()}
        self.counters = collections.Counter(state["counters"])
        self.tokens_by_learner = collections.Counter(state["tokens_by_learner"])
        self.off_ledger = dict(state.get("off_ledger", {}))
        self.hold_until = now + hold_s
        for uid, unit in sorted(self.open.items()):  # the rounds died with the syncer: their pushes are lost
            unit.missed |= unit.pending()
            self._settle_if_done(uid, unit)
        self.waiting_for = {u.learner for u in self.open.values()} | set(known)
