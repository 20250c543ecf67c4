"""The pushes a learner owes its syncer, from the trainer's hand to a syncer checkpoint.

A part of the link's core (learner/link.py composes it). A push is queued per fragment (an
unsent push of a fragment is folded into the next one from the same base: learner/sends.py
`coalesce`), taken with the next sequence number when the syncer is heard, counted in flight
while the shell sends it, put back if it could not leave, and once sent kept until a syncer
checkpoint holds it (learner/kept.py): a restarted syncer whose checkpoint lacks it gets it
again, before the queue. Pure: no socket, no clock.
"""

from __future__ import annotations

from typing import Any

from learner.kept import KeptPushes, covered_map
from learner.sends import PushItem, Send, coalesce


class PushQueue:
    """Queued, going-again, in-flight and kept pushes of one link."""

    def __init__(self, keep_bytes: int) -> None:
        self.queue: dict[int, PushItem] = {}  # fragment -> the push waiting to leave (folded)
        self.kept = KeptPushes(keep_bytes)  # sent, until a syncer checkpoint holds them
        self.again: list[PushItem] = []  # kept pushes going again to a restarted syncer, before the queue
        self.in_flight = 0  # pushes handed to the shell and not yet reported sent
        self._seq = 0

    def push(self, item: PushItem) -> None:
        """Queue an outer gradient; an unsent one of the same fragment is folded in (`coalesce`)."""
        self.queue[item.fragment] = coalesce(self.queue.get(item.fragment), item)

    def take(self) -> list[Send]:
        """The pushes going again, then every queued push, lowest fragment first, each with the
        next sequence number. While they are out, a newer push of the same fragment queues alone
        (the older may have left)."""
        items, self.again = [*self.again, *(self.queue.pop(p) for p in sorted(self.queue))], []
        sends = []
        for item in items:
            sends.append(Send(push=item, seq=self._seq))
            self._seq += 1
        self.in_flight += len(sends)
        return sends

    def sent(self, send: Send, blob: bytes | None) -> None:
        """The shell handed push `send` to the socket (with its payload, `blob`, kept)."""
        assert send.push is not None
        self.in_flight -= 1
        if blob is not None:
            self.kept.add(send.seq, send.push, blob)

    def unsent(self, send: Send) -> None:
        """Push `send` could not leave: back to the queue, folded with any newer one of its fragment
        (one going again goes again)."""
        assert send.push is not None
        self.in_flight -= 1
        if send.push.resent:
            self.again.append(send.push)
            return
        item, newer = send.push, self.queue.get(send.push.fragment)
        self.queue[item.fragment] = coalesce(item, newer) if newer is not None else item

    def dropped(self) -> None:
        """A push that could not be encoded is gone (a bug; the link goes on)."""
        self.in_flight -= 1

    def hello(self) -> dict[str, Any] | None:
        """What the hello says of the kept pushes (None: none), so a restarted syncer asks again."""
        named = self.kept.hello()
        return {"epoch": self.kept.epoch, "pushes": named} if named else None

    def welcome(self, epoch: int, covered: Any) -> int:
        """The syncer's welcome: the kept pushes its checkpoint lacks go again; how many."""
        again = self.kept.welcome(epoch, covered_map(covered))
        self.again += again
        return len(again)

    def saved(self, epoch: int, saved: Any) -> None:
        """An ack of epoch `epoch` saying which of our pushes its newest checkpoint holds."""
        if epoch == self.kept.epoch:
            self.kept.saved(covered_map(saved))

    def queued_units(self) -> dict[int, tuple[int, ...]]:
        """The work units named by pushes still waiting to leave, per fragment (the syncer has
        not seen them: a restored syncer must not count them as pushed)."""
        queued = {p: item.units for p, item in self.queue.items() if item.units}
        for item in self.again:
            queued[item.fragment] = queued.get(item.fragment, ()) + item.units
        return queued

    def pending(self) -> int:
        """Pushes not yet handed to the socket (queued, going again, or being sent)."""
        return len(self.queue) + len(self.again) + self.in_flight
