"""The learner's push queue in the link state machine: an unsent push of a fragment is folded
into the next one from the same base (its work reaches the model when the link is back), never
sent twice, kept when a send fails, and held while the syncer is silent. Real OuterState outer
gradients and a LinkCore driven directly (no socket, no thread)."""

from __future__ import annotations

import pytest
import torch

from learner.outer import OuterState
from learner.sends import PushItem, coalesce, push_message
from syncer.common.settings import RunSettings
from syncer.wire import codec, fragments, quant
from tests.unit.linkharness import EPOCH, N, frames, item, joined, kinds, new_core


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
    newer = item(0, 2.0, base=4)
    assert coalesce(item(0, 1.0, base=3), newer) is newer
    assert coalesce(item(0, 1.0, epoch=1), item(0, 2.0, epoch=2)).c_steps == 8
    assert coalesce(None, newer) is newer


def test_pushes_queued_before_the_link_is_ready_go_out_as_one() -> None:
    core = new_core()
    for value in (1.0, 2.0, 4.0):
        core.push(item(0, value))
    core, now = joined(core)
    sends = [s for s in core.tick(now + 0.01).sends if s.push is not None]
    assert len(sends) == 1 and core.pending() == 1, "in flight still counts as pending (stop() waits)"
    push = sends[0].push
    assert push is not None and (push.c_steps, push.c_tokens) == (24, 24 * 256)
    assert torch.equal(push.delta, torch.full((N,), 7.0))
    core.sent(sends[0], 1000)
    assert core.pending() == 0 and core.counters.pushes_sent == 1


@pytest.mark.parametrize("ok", [True, False], ids=["sent", "send-failed"])
def test_a_push_queued_while_another_is_sent_is_neither_lost_nor_sent_twice(ok: bool) -> None:
    core, now = joined()
    core.push(item(0, 1.0))
    (send,) = [s for s in core.tick(now + 0.01).sends if s.push is not None]
    core.push(item(0, 2.0))  # the training thread, while the first is being sent
    assert core.pending() == 2
    core.sent(send, 10) if ok else core.unsent(send)
    pending = core.queue[0]
    # sent: the new push stays alone (the first already left); failed: both in one
    assert pending.c_steps == (8 if ok else 16)
    assert torch.equal(pending.delta, torch.full((N,), 2.0 if ok else 3.0))
    assert core.pending() == 1


def test_pushes_go_lowest_fragment_first_with_increasing_sequence_numbers() -> None:
    core, now = joined()
    core.push(item(1, 1.0))
    core.push(item(0, 1.0))
    first = [s for s in core.tick(now + 0.01).sends if s.push is not None]
    core.unsent(first[0])
    core.unsent(first[1])
    again = [s for s in core.tick(now + 0.02).sends if s.push is not None]
    assert [s.push.fragment for s in first if s.push] == [0, 1]
    assert [s.seq for s in first + again] == [0, 1, 2, 3], "a resent push never reuses a sequence number"


def test_pushes_wait_while_the_syncer_is_silent_and_go_out_when_it_answers() -> None:
    """A hung syncer: what is sent into its socket is lost when the link closes it, so a learner
    holds its pushes (folded per fragment) until the syncer answers again."""
    core, now = joined()
    for k, value in enumerate((1.0, 2.0)):
        core.push(item(0, value))
        out = core.tick(now + 5.0 + k)  # 5 s and more without a word from the syncer
        assert "push" not in kinds(out) and "heartbeat" in kinds(out), "heartbeats still go"
    assert core.pending() == 1
    core.receive(now + 6.5, frames("ack", epoch=EPOCH, versions=[0, 0], initialized=True))
    pushes = [s.push for s in core.tick(now + 6.6).sends if s.push is not None]
    assert len(pushes) == 1 and pushes[0].c_steps == 16


def test_the_push_message_carries_the_counters_and_a_decodable_delta() -> None:
    core, now = joined()
    core.push(item(1, 0.25, base=5))
    (send,) = [s for s in core.tick(now + 0.01).sends if s.push is not None]
    msg = push_message(send, RunSettings(compression="int8"))
    assert msg.kind == "push"
    assert {k: msg[k] for k in ("fragment", "base_version", "seq", "epoch", "c_steps", "c_tokens")} == {
        "fragment": 1,
        "base_version": 5,
        "seq": 0,
        "epoch": 3,
        "c_steps": 8,
        "c_tokens": 2048,
    }
    assert torch.allclose(codec.decode(msg.payloads[0], expect_numel=N), torch.full((N,), 0.25), atol=1e-2)


@pytest.mark.parametrize("zstd", [True, False])
def test_the_push_blob_follows_the_runs_zstd_setting(zstd: bool) -> None:
    core, now = joined()
    core.push(item(1, 0.25, base=5))
    (send,) = [s for s in core.tick(now + 0.01).sends if s.push is not None]
    blob = push_message(send, RunSettings(zstd=zstd)).payloads[0]
    assert bool(blob[2] & codec.RAW) is not zstd  # the format byte says how the payload is stored
    assert len(blob) == codec.HEADER_SIZE + quant.raw_length("int4", N, 128) or zstd
    assert torch.allclose(codec.decode(blob, expect_numel=N), torch.full((N,), 0.25), atol=0.05)


def test_a_push_that_cannot_be_encoded_is_dropped_and_counted() -> None:
    core, now = joined()
    core.push(item(0, 1.0))
    (send,) = [s for s in core.tick(now + 0.01).sends if s.push is not None]
    event = core.encode_failed(send, ValueError("bug"))
    assert event.kind == "bad_message" and core.pending() == 0 and core.counters.bad_messages == 1
