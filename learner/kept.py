"""The pushes a learner keeps after sending them, until a checkpoint of the syncer holds them.

A syncer that restarts from its checkpoint has lost every push it took after it: what it merged
since, the rounds still open, and what the learners sent into its socket before they noticed it
was gone. So each push's wire bytes are kept here, with its sequence number and the work units
it named. The syncer's acks say, per fragment, up to which sequence number its newest written
checkpoint holds this learner's pushes (`saved`): those go. The welcome of a syncer restarted
from a checkpoint says the same of that checkpoint (`covered`): what is above it goes again, in
order, as a stale push from the base it was taken on. So the work of a learner that stayed up is
not lost with the syncer, and no unit it trained is handed out again (docs/algorithm.md, "Sent
again after a syncer restart").

Pure: no socket, no clock. Bounded by `keep_pushes_mb`: past it the oldest go (what they carried
is then lost with a syncer restart, as without this store).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from learner import offload
from learner.sends import PushItem

MAX_HELLO = 1024  # kept pushes named in a hello (the newest)


@dataclass(frozen=True)
class KeptPush:
    """One sent push: its sequence number and the push, its delta the bytes that left."""

    seq: int
    item: PushItem
    nbytes: int


def numel(delta: offload.Delta) -> int:
    """How many values an outer gradient holds, whatever its form."""
    return delta.numel if isinstance(delta, (offload.DeviceDelta, offload.Sent)) else delta.numel()


class KeptPushes:
    """The sent pushes of one link, oldest first, within a byte budget."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.entries: list[KeptPush] = []
        self.nbytes = 0
        self.epoch = -1  # of the syncer they were sent to (-1: none yet)
        self.dropped = 0  # let go over the budget
        self.resent = 0  # sent again to a restarted syncer

    def add(self, seq: int, item: PushItem, blob: bytes) -> None:
        """A push left: keep its bytes (not a `last` push: those stay out of the model at `down`)."""
        if self.limit <= 0 or item.last or len(blob) > self.limit:
            return
        sent = offload.Sent(bytes(blob), numel(item.delta))
        self.entries.append(KeptPush(seq, dataclasses.replace(item, delta=sent, resent=True), len(blob)))
        self.nbytes += len(blob)
        while self.nbytes > self.limit:
            self.nbytes -= self.entries.pop(0).nbytes
            self.dropped += 1

    def saved(self, covered: dict[int, int]) -> None:
        """The syncer's newest checkpoint holds this learner's pushes up to `covered[p]` on p."""
        left = [e for e in self.entries if e.seq > covered.get(e.item.fragment, -1)]
        self.nbytes -= sum(e.nbytes for e in self.entries) - sum(e.nbytes for e in left)
        self.entries = left

    def welcome(self, epoch: int, covered: dict[int, int]) -> list[PushItem]:
        """A welcome from syncer `epoch`. From a restarted syncer (another epoch), whose
        checkpoint holds this learner's pushes up to `covered[p]`: the pushes to send again,
        oldest first (they leave the store; once sent they are kept again)."""
        if epoch == self.epoch:
            return []
        again = [e.item for e in self.entries if e.seq > covered.get(e.item.fragment, -1)] if self.epoch >= 0 else []
        self.entries, self.nbytes, self.epoch = [], 0, epoch
        self.resent += len(again)
        return again

    def hello(self) -> list[list[Any]]:
        """[[fragment, seq, [units]], ...] of the kept pushes: a restarted syncer counts the units
        of those it will get again as not pushed yet, and says how many come again."""
        return [[e.item.fragment, e.seq, list(e.item.units)] for e in self.entries[-MAX_HELLO:]]


def covered_map(value: Any) -> dict[int, int]:
    """A welcome's or ack's [[fragment, seq], ...]; anything malformed counts as nothing."""
    if not isinstance(value, list):
        return {}
    out: dict[int, int] = {}
    for pair in value:
        if isinstance(pair, list) and len(pair) == 2 and all(type(x) is int and x >= 0 for x in pair):
            out[pair[0]] = pair[1]
    return out
