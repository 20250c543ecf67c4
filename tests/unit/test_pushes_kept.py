"""A learner keeps what it pushed until a syncer checkpoint holds it, and sends it again to a
syncer restarted from that checkpoint (learner/kept.py, syncer/receipts.py): the work merged
after the checkpoint is merged again instead of lost, and the units it carried are merged, not
handed out to be trained again. A real LinkCore wired to real SyncerCores through the protocol's
encoder (no socket): the first syncer merges, checkpoints, merges more and dies; the second
restores the checkpoint and hears the learner's hello."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from learner.kept import KeptPushes, covered_map
from learner.link import Identity, LinkCore, LinkOutbox
from learner.sends import PushItem, push_message
from syncer import checkpoint
from syncer.core import SyncerCore
from syncer.globalmodel import Outbox
from syncer.receipts import PushReceipts
from syncer.wire import fragments
from syncer.wire.protocol import Message, encode
from tests.unit.coreharness import RUN, Harness, make_settings
from tests.unit.linkharness import EPOCH, frames, item, joined

DATA = {"sequences": 100, "unit_sequences": 10, "seq_len": 8, "digest": "d1"}


def test_the_store_keeps_what_no_checkpoint_holds_within_its_budget() -> None:
    kept = KeptPushes(limit_bytes=250)
    kept.welcome(1, {})
    for seq, p in enumerate((0, 1, 0)):
        kept.add(seq, item(p, 1.0), b"x" * 100)  # the third pushes the first out of the budget
    assert [e.seq for e in kept.entries] == [1, 2] and kept.dropped == 1 and kept.nbytes == 200
    kept.saved({1: 1})  # the newest checkpoint holds fragment 1 up to push 1
    assert [e.seq for e in kept.entries] == [2]
    assert kept.entries[0].item.resent and kept.entries[0].item.delta.blob() == b"x" * 100
    assert kept.welcome(1, {}) == [], "a reconnect to the same syncer sends nothing again"
    again = kept.welcome(2, {0: 1})
    assert [i.fragment for i in again] == [0] and not kept.entries and kept.epoch == 2
    kept.add(9, item(0, 1.0), b"y")
    kept.add(10, dataclasses.replace(item(0, 1.0), last=True), b"z")  # a last push at `down` is never sent again
    assert [e.seq for e in kept.entries] == [9]
    assert covered_map([[0, 3], [1, "x"], "junk"]) == {0: 3}


def test_receipts_follow_merges_and_name_the_units_a_learner_sends_again() -> None:
    from syncer.rounds import Contribution
    from syncer.wire import quant

    q = quant.quantize(torch.zeros(4), "int8")
    r = PushReceipts()
    r.settled(0, [Contribution("a", q, 1, 8, 0.1, 0.1, 0, 0.0, 4, incarnation="i1", seq=4)])
    r.settled(1, [Contribution("a", q, 1, 8, 0.1, 0.1, 0, 0.0, 4, incarnation="i1", seq=-1)])  # a carried share
    saved = r.state_dict()
    r.settled(0, [Contribution("a", q, 1, 8, 0.1, 0.1, 0, 0.0, 4, incarnation="i1", seq=7)])
    r.written(saved)
    assert r.covered("a", "i1") == [[0, 7]] and r.covered("a", "i1", saved=True) == [[0, 4]]
    assert r.covered("a", "i2") == [], "another incarnation's receipts are not this one's"
    kept = {"epoch": 1, "pushes": [[0, 4, [1]], [0, 8, [2]], [1, 5, [2, 3]], [1, 6, []]]}
    out = Outbox()
    assert r.again(kept, "a", "i1", 2, (0, 1), 9.0, out) == {2: {0, 1}, 3: {1}}
    assert [(e["kind"], e["detail"][:22]) for e in out.events] == [("pushes_resent", "3 pushes sent again (m")]
    assert r.again(kept, "a", "i1", 1, (0, 1), 9.0, out) == {}, "sent to this very syncer"
    restored = PushReceipts()
    restored.load_state_dict(saved)
    assert restored.covered("a", "i1", saved=True) == [[0, 4]]


class Wire:
    """One learner's LinkCore and a SyncerCore (harness), messages carried both ways."""

    def __init__(self, h: Harness, link: LinkCore) -> None:
        self.h, self.link = h, link
        self.events: list[dict[str, Any]] = []

    def carry(self, out: LinkOutbox, now: float) -> None:
        if out.open:
            self.link.opened(now)
        for send in out.sends:
            msg = push_message(send, self.link.s) if send.push is not None else send.msg
            assert msg is not None
            self.link.sent(send, 0, msg.payloads[0] if send.push is not None else None)
            self.answer(self.h.send("b", msg, now), now)

    def answer(self, core_out: Any, now: float) -> None:
        self.events += core_out.events
        for learners, msg in core_out.sends:
            if "b" in learners:
                self.link.receive(now, encode(msg))

    def run(self, now: float, rounds: int = 6) -> float:
        for _ in range(rounds):
            now += 0.6
            self.carry(self.link.tick(now), now)
            self.answer(self.h.tick(now), now)
        return now


def push(link: LinkCore, p: int, units: tuple[int, ...], n: int) -> None:
    delta = torch.full((n,), 1e-3)
    link.push(PushItem(p, delta, link.replica.versions[p], 8, 128, 0.08, 0.01, link.replica.epoch, units=units))


@pytest.mark.parametrize("keep_mb", [64.0, 0.0])
def test_a_restarted_syncer_gets_again_what_it_lost_and_no_unit_is_trained_twice(keep_mb: float) -> None:
    s = make_settings(quorum=1, data_order="ledger", keep_pushes_mb=keep_mb)
    h = Harness(s, declared=("a", "b"))
    h.join_all(("a",))
    sizes = h.plan.sizes()
    me = Identity("b", "inc-b", RUN, 7, "host", "cpu", 8, fragments.manifest_to_json(h.manifest))
    link = LinkCore(me, sizes, s)
    link.stats["data"] = {**DATA, "want": 3, "hand": []}
    wire = Wire(h, link)
    now = wire.run(2.0)
    assert link.ready and sorted(link.take_units()[0]) == [0, 1, 2]
    for p in (0, 1):
        push(link, p, (0,), sizes[p])
    now = wire.run(now)
    state = checkpoint.state_dict(h.core, wall=now, copy=True)  # unit 0 merged: held by the checkpoint
    h.core.receipts.written(state["pushes"])
    now = wire.run(now)
    assert len(link.kept.entries) == 0, "the acks let go of what the checkpoint holds"
    for p in (0, 1):
        push(link, p, (1,), sizes[p])  # merged after the checkpoint: lost with the syncer
    push(link, 0, (2,), sizes[0])
    now = wire.run(now)
    assert h.core.data.ledger.snapshot()["merged"] == 2

    # the syncer dies; its successor restores the checkpoint, a new epoch
    h.core = SyncerCore(s, RUN, ["a", "b"], now=now, epoch=2, clock=h.clock)
    checkpoint.restore(h.core, state, now)
    link.stats["data"] = {**DATA, "want": 0, "hand": [2], "pushed": [[2, [0]]]}
    link.receive(now, encode(Message("error", {"reason": "say hello first", "fatal": False})))
    now = wire.run(now)
    push(link, 1, (2,), sizes[1])
    now = wire.run(now, rounds=30)  # past the restore's hold

    ledger = h.core.data.ledger
    requeued = [e for e in wire.events if e["kind"] == "units_requeued"]
    if keep_mb:
        assert link.kept.resent == 2 and not requeued and not ledger.requeue  # 1 and 2 left folded on fragment 0
        snap = ledger.snapshot()
        assert (snap["lost"], snap["merged"], snap["partial"]) == (0, 3, 0), "0, 1 and 2 merged everywhere"
        assert h.core.receipts.covered("b", "inc-b")  # the pushes sent again were merged
        assert [e["target"] for e in wire.events if e["kind"] == "pushes_resent"] == ["b"]
    else:  # without the store: unit 1's merge died with the syncer, so it goes out again
        assert requeued and 1 in ledger.requeue and ledger.snapshot()["partial"] == 1  # 2: its fragment 0 lost


def test_pushes_sent_again_go_first_are_never_folded_away_and_count_as_not_pushed() -> None:
    link, now = joined()
    for p in (0, 1):
        link.push(dataclasses.replace(item(p, 1.0), units=(7,)))
    for send in link.tick(now + 0.01).sends:
        if send.push is not None:
            link.sent(send, 10, push_message(send, link.s).payloads[0])
    assert [e.seq for e in link.kept.entries] == [0, 1] and link.kept.hello() == [[0, 0, [7]], [1, 1, [7]]]
    link.receive(now + 1, welcome_with(EPOCH + 1, [[0, 0]]))
    assert [i.fragment for i in link.again] == [1], "fragment 0's push is in the checkpoint"
    assert link.queued_units() == {1: (7,)}
    link.push(item(1, 2.0, epoch=EPOCH + 1))  # a new push of the same fragment, from another base
    sends = [s for s in link.tick(now + 1.01).sends if s.push is not None]
    assert [(s.push.fragment, s.push.resent) for s in sends] == [(1, True), (1, False)]
    link.unsent(sends[0])  # the socket would not take it: it stays to go again, not folded away
    assert [i.fragment for i in link.again] == [1] and link.pending() == 2


def welcome_with(epoch: int, covered: list[list[int]]) -> list[bytes]:
    meta = {"epoch": epoch, "initialized": True, "init_owner": False, "versions": [0, 0]}
    return frames("welcome", chunk_numel=1024, step=0, covered=covered, **meta)
