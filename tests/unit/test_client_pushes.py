"""The learner's push queue: an unsent push of a fragment is folded into the next one from the same
base (its work reaches the model when the link is back), never sent twice, and kept when a send
fails. A real SyncerClient object and real OuterState outer gradients; only the socket send is
replaced (the seam; the link itself is tested in tests/integration)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.client import PushItem, SyncerClient, coalesce
from learner.config import LearnerConfig, LearnerSpec
from learner.outer import OuterState
from syncer.common.settings import RunSettings
from syncer.wire import fragments
from syncer.wire.protocol import Message

N = 16


def _client(tmp_path: Path) -> SyncerClient:
    cfg = LearnerConfig("run", RunSettings(), LearnerSpec("learner-1"), "tcp://127.0.0.1:1", None, None, tmp_path)
    return SyncerClient(cfg, [], [N, N], list, "inc")


def _item(p: int, value: float, base: int = 3, steps: int = 8, epoch: int = 1) -> PushItem:
    return PushItem(p, torch.full((N,), value), base, steps, steps * 256, steps * 0.01, 0.01, epoch)


def test_outer_gradients_from_one_base_telescope_into_the_whole_work() -> None:
    plan = fragments.plan([fragments.TensorSpec("w", (N,))], 1)
    params = {"w": torch.zeros(N)}
    outer = OuterState.start(plan, 8, 0.0, [(3, torch.zeros(N))], params)
    items = []
    for k in (1, 2):
        params["w"].sub_(0.5 * k)  # "training"
        outer.count_step(256, 0.01)
        delta, c = outer.take_outer_gradient(0, params)
        items.append(PushItem(0, delta, outer.base_version[0], c.steps, c.tokens, c.time, 0.01))
    both = coalesce(*items)
    assert torch.equal(both.delta, torch.zeros(N) - params["w"]), "mark0 - theta now: no step lost"
    assert (both.c_steps, both.c_tokens, both.base_version) == (2, 512, 3)


def test_a_push_from_another_base_replaces_the_unsent_one() -> None:
    newer = _item(0, 2.0, base=4)
    assert coalesce(_item(0, 1.0, base=3), newer) is newer
    assert coalesce(_item(0, 1.0, epoch=1), _item(0, 2.0, epoch=2)).c_steps == 8
    assert coalesce(None, newer) is newer


def test_pushes_queued_while_the_link_is_down_go_out_as_one(tmp_path: Path) -> None:
    client = _client(tmp_path)
    sent: list[Message] = []
    client._send = lambda msg, block=False: False  # no connection
    for value in (1.0, 2.0, 4.0):
        client.push(_item(0, value))
        client._send_pushes()
    assert client.pending() == 1
    client._send = lambda msg, block=False: sent.append(msg) or True
    client._send_pushes()
    assert client.pending() == 0 and len(sent) == 1
    assert (sent[0]["c_steps"], sent[0]["c_tokens"], sent[0]["base_version"]) == (24, 24 * 256, 3)


@pytest.mark.parametrize("ok", [True, False], ids=["sent", "send-failed"])
def test_a_push_queued_while_another_is_sent_is_neither_lost_nor_sent_twice(tmp_path: Path, ok: bool) -> None:
    client = _client(tmp_path)
    sent: list[Message] = []

    def send(msg: Message, block: bool = False) -> bool:
        if not sent and msg.kind == "push":
            assert client.pending() == 1, "the push being sent still counts as pending (stop() waits)"
            client.push(_item(0, 2.0))  # the training thread, meanwhile
        sent.append(msg)
        return ok

    client._send = send
    client.push(_item(0, 1.0))
    client._send_pushes()
    pending = client._pending[0]
    # sent: the new push stays alone (the first already left); failed: both in one
    assert pending.c_steps == (8 if ok else 16)
    assert torch.equal(pending.delta, torch.full((N,), 2.0 if ok else 3.0))
    assert len(sent) == 1


def test_pushes_wait_while_the_syncer_is_silent_and_go_out_when_it_answers(tmp_path: Path) -> None:
    """A hung syncer: what is sent into its socket is lost when the link closes it, so a learner
    holds its pushes (folded per fragment) until the syncer answers again."""
    client = _client(tmp_path)
    client._sock = object()  # connected, welcomed, ready
    client._welcomed = True
    client.ready.set()
    sent: list[Message] = []
    client._send = lambda msg, block=False: sent.append(msg) or True
    client._heard_at = now = 100.0
    client._beat_at = now
    for value in (1.0, 2.0):
        client.push(_item(0, value))
        client._work(now + 10.0)  # 10 s without a word from the syncer
    assert [m.kind for m in sent if m.kind == "push"] == [] and client.pending() == 1  # heartbeats still go
    client._heard_at = now + 10.5  # an ack: it is back
    client._work(now + 10.6)
    pushes = [m for m in sent if m.kind == "push"]
    assert len(pushes) == 1 and pushes[0]["c_steps"] == 16 and client.pending() == 0
