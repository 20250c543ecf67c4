"""The rounds of one syncer: which are open, when each is called, which are ready to close.

A part of the core (syncer/core.py composes it; syncer/outerstep.py turns a closing round into
the fragment's next version). It owns the open rounds per fragment, the syncer's round clock
(syncer/clock.py), how many rounds in a row each live learner missed, the bound on queued
contributions, and the rounds closed but not yet settled into the data ledger and the push
receipts. Pure: `now` is passed in, calls and drops go into the `Outbox`.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from syncer.clock import RoundClock
from syncer.common.settings import RunSettings
from syncer.fleet import Ledger
from syncer.globalmodel import GlobalModel, Outbox
from syncer.rounds import Contribution, GraceFn, Round, drop_oldest, withdraw
from syncer.wire.protocol import Message

# A live learner not in this many rounds in a row (it heartbeats but pushes nothing: it reloads
# after every step, it is still fetching the state) is not waited for until it pushes again: each
# round waited for it until its deadline, and every merge reached the fleet a period late (a
# learner stuck reloading took the final model 4.6% behind, bench/integrity.py bad_nan_rest).
MISSED_ROUNDS = 2


class RoundBook:
    """Open rounds per fragment (local index), their calls, closes and the queue bound."""

    def __init__(self, settings: RunSettings, counters: collections.Counter[str]) -> None:
        self.s = settings
        self.counters = counters  # the run's tallies (syncer/accounting.py): calls, recalls, drops
        self.rounds: dict[int, Round] = {}
        self.round_clock = RoundClock(settings.H, settings.fragments)
        self.missed: collections.Counter[str] = collections.Counter()  # rounds closed in a row without it
        self.unsettled: list[tuple[int, list[Contribution]]] = []  # rounds closed, not yet in the ledger

    def _grace(self, t_sync: float | None) -> GraceFn:
        return GraceFn(self.s.grace_gamma, self.s.tau, t_sync or 0.0)

    def add(self, contribution: Contribution, p: int, t_sync: float | None) -> None:
        """A checked push into fragment p's round."""
        self.rounds.setdefault(p, Round(p)).add(contribution, self.s.quorum, self._grace(t_sync))

    def bound(self, now: float, out: Outbox) -> None:
        """Keep memory bounded: past max_queue pending contributions, drop the oldest."""
        for learner, q in drop_oldest(self.rounds.values(), self.s.max_queue, self.s.quorum, now):
            self.counters["dropped_pushes"] += 1
            out.event(now, "drop", learner, f"fragment {q}: queue over {self.s.max_queue}")

    def withdraw(self, learner: str, now: float, out: Outbox) -> None:
        """Lock-step: a restarted learner's previous incarnation's unmerged pushes leave their rounds."""
        for p in withdraw(self.rounds.values(), learner, self.s.quorum, now):
            out.event(now, "drop", learner, f"fragment {p}: the previous incarnation's unmerged push (lock-step)")

    def ready(self, now: float, live: set[str]) -> Iterator[Round]:
        """The rounds that close now, in fragment order, one at a time (the caller closes each
        before the next is looked at); who was in each is counted (`missed`): a live learner that
        pushes nothing is not waited for."""
        waited = {lid for lid in live if self.missed[lid] < MISSED_ROUNDS}
        for p in sorted(self.rounds):
            rnd = self.rounds[p]
            if rnd.contributions and rnd.ready(now, self.s.quorum, waited, called=self.s.syncer_clock):
                for lid in live:
                    self.missed[lid] = 0 if lid in rnd.contributions else self.missed[lid] + 1
                yield rnd

    def replace(self, p: int, carried: list[Contribution], t_sync: float | None) -> None:
        """After a close: fragment p's next round, holding what the close carried over, if anything."""
        del self.rounds[p]
        if carried:
            rnd = self.rounds[p] = Round(p)
            for c in carried:
                rnd.add(c, self.s.quorum, self._grace(t_sync))

    def flush(self) -> list[Round]:
        """Every round that holds anything, quorum or not (the run is going down); none stay open."""
        ready = [self.rounds[p] for p in sorted(self.rounds) if self.rounds[p].contributions]
        self.rounds.clear()
        return ready

    def closed(self, p: int, contribs: list[Contribution]) -> None:
        """Fragment p's round closed with `contribs` merged (none: every one rejected)."""
        self.unsettled.append((p, contribs))

    def take_unsettled(self) -> list[tuple[int, list[Contribution]]]:
        """The rounds closed since the last call (for the data ledger and the receipts)."""
        unsettled, self.unsettled = self.unsettled, []
        return unsettled

    def call(
        self,
        live: set[str],
        model: GlobalModel,
        epoch: int,
        owned: tuple[int, ...],
        fleet: Ledger,
        now: float,
        out: Outbox,
    ) -> None:
        """The syncer's round clock (syncer/clock.py): call the rounds that are due, every
        connected learner at once. A fragment whose last call is still below quorum is called
        again, with a fresh window, to those not in it yet: a call can be lost (after a hang the
        learners had new sockets, and every call went to the old ones), and an open round is
        never called again otherwise: after a 20 s SIGSTOP nothing was merged until `down`.
        `owned`: the global fragments this shard owns, in local order."""
        times = [fleet.learners[lid].seconds_per_step() for lid in live]
        # the fleet's clock runs over the run's fragments; this shard calls the rounds of its own
        due = [owned.index(p) for p in self.round_clock.advance(now, times) if p in owned]
        if not due:
            return
        window = self.round_clock.window(self.s.tau, self.s.grace_gamma)
        connected = list(fleet.connected(now))
        for p in due:
            rnd = self.rounds.setdefault(p, Round(p))
            recipients = connected
            if rnd.called_at is not None:
                if len(rnd.contributions) >= self.s.quorum:
                    continue  # it closes at its deadline
                recipients = [lid for lid in connected if lid not in rnd.contributions]
                self.counters["recalls"] += 1
            rnd.call(now, window)
            out.broadcast(recipients, Message("call", {"fragment": p, "epoch": epoch, "version": model.versions[p]}))
            self.counters["calls"] += 1
