"""The learner's link state machine (learner/link.py), driven directly with real protocol frames
and a made-up clock: joining, the chunked state fetch, the first upload, liveness, partitions,
refusals, replies, resyncs, round calls and malformed input. No socket, no thread."""

from __future__ import annotations

import torch

from learner.link import LinkCore, Phase
from learner.sends import Send
from syncer.wire.protocol import Message
from tests.unit.linkharness import (
    EPOCH,
    ME,
    N,
    frames,
    item,
    joined,
    kinds,
    new_core,
    state_for,
    update,
    welcome,
)


def test_a_fresh_link_opens_says_hello_with_backoff_and_is_welcomed() -> None:
    core = new_core()
    assert core.tick(0.0).open and core.phase is Phase.CLOSED
    core.opened(0.0)
    assert core.tick(0.05).sends == [], "the first hello waits out the first backoff"
    hello = core.tick(0.2).sends
    assert kinds(core.tick(0.2)) == [] and len(hello) == 1 and hello[0].msg is not None
    assert hello[0].msg.meta | {"manifest": []} == {
        "learner": ME.learner,
        "incarnation": "inc",
        "run": "run",
        "pid": 42,
        "host": "host-a",
        "device": "cpu",
        "batch_size": 8,
        "codecs": ["none", "bf16", "int8", "int4", "2bit", "topk"],
        "manifest": [],
        "fragments": 2,
    }
    assert kinds(core.tick(0.35)) == [], "backoff doubled to 0.2 s"
    assert kinds(core.tick(0.45)) == ["hello"]
    out = core.receive(0.5, welcome(step=1200))
    assert core.phase is Phase.UP and core.resume_step == 1200 and [e.kind for e in out.events] == ["welcome"]


def test_the_state_arrives_in_chunks_with_a_window_and_makes_the_link_ready_once() -> None:
    core = new_core([2500, 4])  # chunks of 1024: fragment 0 in 3 chunks
    core.tick(0.0)
    core.opened(0.0)
    core.receive(0.0, welcome())
    first = core.tick(0.01).sends
    asks = [(s.msg["fragment"], s.msg["offset"]) for s in first if s.msg and s.msg.kind == "state_req"]
    assert asks == [(0, 0), (1, 0)], "the version is learned from the first chunk before asking for more"
    assert answer(core, first, 0.015) == [], "fragment 1 is complete, fragment 0 is not"
    second = core.tick(0.02).sends
    assert [(s.msg["fragment"], s.msg["offset"]) for s in second if s.msg] == [(0, 1024), (0, 2048)], "then the rest"
    assert answer(core, second, 0.025) == ["ready"]
    core.replica.refetch(1)
    assert answer(core, core.tick(0.03).sends, 0.035) == [], "ready once"
    assert core.ready and core.replica.complete() and core.take_updates() == ({0, 1}, set())


def answer(core: LinkCore, sends: list[Send], now: float) -> list[str]:
    """Answer the state requests among `sends`; the kinds of the events that came of it."""
    events = []
    for send in sends:
        if send.msg is not None and send.msg.kind == "state_req":
            events += [e.kind for e in core.receive(now, state_for(core, send)).events]
    return events


def test_the_init_owner_uploads_every_chunk_and_resends_only_what_did_not_leave() -> None:
    core = new_core([2500, 4])
    core.tick(0.0)
    core.opened(0.0)
    core.receive(0.0, welcome(initialized=False, init_owner=True))
    sends = [s for s in core.tick(0.01).sends if s.init is not None]
    assert [(s.init.fragment, s.init.offset, s.init.numel) for s in sends if s.init] == [
        (0, 0, 1024),
        (0, 1024, 1024),
        (0, 2048, 452),
        (1, 0, 4),
    ]
    assert all(s.block for s in sends), "upload chunks wait for the socket"
    core.sent(sends[0], 100)
    core.sent(sends[1], 100)
    core.unsent(sends[2])  # the syncer went away mid-upload
    again = [s.init for s in core.tick(0.02).sends if s.init is not None]
    assert [(c.fragment, c.offset) for c in again] == [(0, 2048), (1, 0)]


def test_silence_means_a_fresh_socket_but_only_past_three_liveness_periods() -> None:
    core, now = joined()
    assert not core.tick(now + 3 * 3.0 - 0.1).close
    out = core.tick(now + 3 * 3.0 + 0.1)
    assert out.close and core.phase is Phase.CLOSED and core.counters.reconnects == 1
    assert [e.kind for e in out.events] == ["reconnect"]
    assert core.tick(now + 10.0).open, "a fresh socket next"
    assert not core.linked()


def test_a_partition_closes_the_socket_once_sends_nothing_and_reopens_when_lifted() -> None:
    core, now = joined()
    core.push(item(0, 1.0))
    core.partitioned = True
    out = core.tick(now + 1.0)
    assert out.close and out.sends == [] and core.phase is Phase.PARTITIONED and not core.linked()
    assert core.stats["link"] == "partitioned"
    later = core.tick(now + 2.0)
    assert not later.close and later.sends == [] and core.pending() == 1, "the push waits, folded"
    core.partitioned = False
    assert core.tick(now + 3.0).open
    core.opened(now + 3.0)
    core.receive(now + 3.1, welcome())
    assert core.linked() and core.stats["link"] == "up"


def test_a_fatal_error_refuses_and_a_restarted_syncer_gets_a_hello_at_once() -> None:
    core, now = joined()
    core.receive(now, frames("error", reason="unknown learner; hello first", fatal=False))
    assert core.phase is Phase.JOINING and kinds(core.tick(now + 0.01)) == ["hello"]
    out = core.receive(now, frames("error", reason="run id mismatch", fatal=True))
    assert core.fatal == "run id mismatch" and [e.kind for e in out.events] == ["refused"]


def test_malformed_input_is_dropped_and_counted() -> None:
    core, now = joined()
    for bad in ([b"garbage"], [], frames("status_req"), [*frames("update", [b"x"], **_bad_update())]):
        out = core.receive(now, bad)
        assert [e.kind for e in out.events] in (["bad_message"], []), bad
    assert core.counters.bad_messages >= 3 and core.phase is Phase.UP


def _bad_update() -> dict[str, object]:
    return {"fragment": 0, "version": 1, "from_version": 0, "epoch": EPOCH, "contributors": [ME.learner]}


def test_only_a_round_that_merged_our_push_is_a_reply() -> None:
    """An update of a round without this learner's push (quorum K < M) stays in the replica but
    is no reply: applying it would take the pushed work, still in flight, out of the model."""
    core, now = joined()
    core.take_updates()
    core.receive(now, update(0, 1, ["learner-2", "learner-3"]))
    assert core.take_updates() == (set(), set()) and core.replica.versions[0] == 1
    core.receive(now, update(0, 2, ["learner-2", ME.learner]))
    core.receive(now, update(1, 1, [ME.learner]))
    assert core.take_updates() == ({0, 1}, set())
    assert core.take_updates() == (set(), set()), "taken once"
    core.receive(now, update(1, 5, [ME.learner]))  # a gap: a refetch, no reply
    assert not core.has_reply(1) and 1 in core.replica.fetches


def test_a_resync_is_applied_whoever_merged_and_refetches() -> None:
    core, now = joined()
    core.take_updates()
    out = core.receive(now, frames("resync", fragment=-1, reason="test"))
    assert core.take_updates() == (set(), {0, 1}) and set(core.replica.fetches) == {0, 1}
    assert [e.kind for e in out.events] == ["resync"]


def test_a_new_syncer_epoch_refetches_everything_and_a_newer_version_its_fragment() -> None:
    core, now = joined()
    core.receive(now, frames("ack", epoch=EPOCH, versions=[0, 4], initialized=True))
    assert set(core.replica.fetches) == {1}
    core.receive(now, frames("ack", epoch=EPOCH + 1, versions=[0, 0], initialized=True))
    assert set(core.replica.fetches) == {0, 1} and core.replica.epoch == EPOCH + 1


def test_round_calls_count_only_when_ready_and_of_this_epoch() -> None:
    core = new_core()
    core.receive(0.0, frames("call", fragment=0, epoch=EPOCH, version=0))
    assert core.take_calls() == set(), "not ready yet"
    core, now = joined()
    core.receive(now, frames("call", fragment=1, epoch=EPOCH, version=0))
    core.receive(now, frames("call", fragment=0, epoch=EPOCH + 5, version=0))
    core.receive(now, frames("call", fragment=9, epoch=EPOCH, version=0))
    assert core.take_calls() == {1} and core.take_calls() == set()


def test_the_goodbye_only_when_up_and_its_receipt_is_recorded() -> None:
    assert new_core().goodbye() is None
    core, now = joined()
    bye = core.goodbye()
    assert bye is not None and isinstance(bye.msg, Message) and bye.msg.kind == "bye"
    core.receive(now, frames("bye", reason="receipt"))
    assert core.goodbye_confirmed
    assert "finished" not in bye.msg.meta  # stopped (a signal, a removal): the syncer drops it from the average
    core.finished = True  # the budget is spent: the syncer keeps it in the average (syncer/outerstep.py)
    done = core.goodbye()
    assert done is not None and isinstance(done.msg, Message) and done.msg.meta["finished"] is True


def test_heartbeats_carry_the_stats_replica_and_counters() -> None:
    core, now = joined()
    core.stats.update(step=7, tokens=900, state="running")
    beat = [s.msg for s in core.tick(now + 1.0).sends if s.msg and s.msg.kind == "heartbeat"]
    assert len(beat) == 1
    meta = beat[0].meta
    assert (meta["step"], meta["tokens"], meta["versions"], meta["link"]) == (7, 900, [0, 0], "up")
    assert meta["bytes_received"] == core.counters.bytes_received > 4 * 2 * N
    assert kinds(core.tick(now + 1.1)) == [], "one heartbeat per heartbeat_s"


def test_a_socket_that_connected_says_hello_without_waiting_out_the_backoff() -> None:
    core = new_core()
    core.tick(0.0)
    core.opened(0.0)
    core.connected(0.002)  # the shell saw POLLOUT: the connection (and CURVE's handshake) is up
    assert kinds(core.tick(0.003)) == ["hello"]
    assert kinds(core.tick(0.05)) == [], "then the backoff as before"
    assert kinds(core.tick(0.25)) == ["hello"]
    up, now = joined()
    up.connected(now)
    assert kinds(up.tick(now + 0.001)) == [], "no hello once welcomed"


def test_a_state_chunk_of_the_wrong_size_is_dropped_and_counted() -> None:
    core = new_core([2500, 4])  # chunks of 1024
    core.tick(0.0)
    core.opened(0.0)
    core.receive(0.0, welcome())
    first = [s for s in core.tick(0.01).sends if s.msg and s.msg.kind == "state_req"]
    whole = torch.zeros(2500)
    short = whole[:1000]  # a well-formed message, but not the chunk that was asked for
    meta = {"fragment": 0, "version": 0, "offset": 0, "numel": 1000, "total": 2500, "epoch": EPOCH}
    out = core.receive(0.015, frames("state", [short.numpy().tobytes()], **meta))
    assert [e.kind for e in out.events] == ["bad_message"] and core.counters.bad_messages == 1
    assert core.replica.fetches[0].received == 0
    for send in first:
        core.receive(0.02, state_for(core, send))
    assert core.counters.bad_messages == 1 and core.replica.fetches[0].received == 1024


def test_the_fetch_window_is_counted_in_bytes_and_bounded() -> None:
    from learner.link import FETCH_MAX, FETCH_WINDOW, fetch_window

    assert fetch_window(1 << 20) == 8  # 4 MiB chunks: 32 MiB in flight
    assert fetch_window(1 << 18) == 32  # 1 MiB chunks
    assert fetch_window(1024) == FETCH_MAX  # tiny chunks: never more requests than the socket takes
    assert fetch_window(1 << 26) == FETCH_WINDOW
