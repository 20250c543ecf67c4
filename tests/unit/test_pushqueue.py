"""The pushes a learner owes its syncer (learner/pushqueue.py), on their own: folded per fragment,
numbered in order, put back when they cannot leave, kept until a checkpoint holds them."""

from __future__ import annotations

import dataclasses

import torch

from learner.pushqueue import PushQueue
from learner.sends import PushItem


def _item(p: int, value: float, units: tuple[int, ...] = ()) -> PushItem:
    return PushItem(p, torch.full((4,), value), 0, 8, 64, 1.0, 0.125, base_epoch=1, units=units)


def test_pushes_of_one_fragment_fold_and_leave_lowest_fragment_first_in_sequence() -> None:
    q = PushQueue(1 << 20)
    q.push(_item(1, 1.0))
    q.push(_item(0, 1.0))
    q.push(_item(1, 2.0))  # folded into the unsent one of fragment 1
    assert q.pending() == 2
    sends = q.take()
    assert [(s.push.fragment, s.seq) for s in sends if s.push] == [(0, 0), (1, 1)]
    assert sends[1].push is not None and sends[1].push.c_steps == 16
    assert q.pending() == 2 and not q.queue, "in flight until the shell reports them"
    q.sent(sends[0], b"blob")
    q.unsent(sends[1])  # could not leave: queued again
    assert q.pending() == 1 and list(q.queue) == [1] and len(q.kept.entries) == 1
    assert [s.seq for s in q.take()] == [2], "a push taken again gets a new sequence number"


def test_kept_pushes_a_restarted_syncer_lacks_go_again_first_and_count_as_not_pushed() -> None:
    q = PushQueue(1 << 20)
    assert q.welcome(1, None) == 0, "the first syncer's welcome: nothing to send again"
    for p in (0, 1):
        q.push(_item(p, 1.0, units=(7,)))
    for send in q.take():
        q.sent(send, b"blob")
    assert q.hello() == {"epoch": q.kept.epoch, "pushes": q.kept.hello()} and q.queued_units() == {}
    assert q.welcome(q.kept.epoch + 1, [[0, 0]]) == 1, "fragment 0's push is in the restarted syncer's checkpoint"
    assert [i.fragment for i in q.again] == [1] and q.queued_units() == {1: (7,)}
    q.push(dataclasses.replace(_item(1, 2.0), base_epoch=2))
    sends = q.take()
    assert [(s.push.fragment, s.push.resent) for s in sends if s.push] == [(1, True), (1, False)]
    q.unsent(sends[0])
    assert [i.fragment for i in q.again] == [1] and q.pending() == 2


def test_an_ack_lets_go_of_what_the_checkpoint_holds() -> None:
    q = PushQueue(1 << 20)
    q.welcome(1, None)
    q.push(_item(0, 1.0))
    (send,) = q.take()
    q.sent(send, b"blob")
    q.saved(q.kept.epoch + 1, [[0, 0]])  # another epoch's ack says nothing of ours
    assert len(q.kept.entries) == 1
    q.saved(q.kept.epoch, [[0, 0]])
    assert len(q.kept.entries) == 0 and q.hello() is None
