"""The syncer's state machine driven directly (no sockets, fake clock): joining and the init
upload, K-of-M quorum with the adaptive grace window, stragglers, summed double contributions,
rejection of NaN and malformed pushes and the bounded queue.
Token weights, the merge, the outer step and bit-exact publishing: test_core_merge.py.
Status and checkpoints: test_core_state.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.replica import Replica
from syncer import status
from syncer.core import Outbox
from syncer.wire import protocol as P
from syncer.wire.protocol import Message, ProtocolError
from tests.unit.coreharness import (
    RUN,
    Harness,
    events_of,
    make_settings,
    rounds_of,
    sent_of,
    small_manifest,
    tensor_manifest,
    wire,
)

# -- joining and init ------------------------------------------------------------------------------


def test_first_learner_owns_init_and_uploads_real_manifest() -> None:
    h = Harness(make_settings(fragments=4, H=8), manifest=tensor_manifest("gpt-tiny"))
    out = h.hello("a", 1.0)
    ((to, welcome),) = sent_of(out, "welcome")
    assert to == ["a"]
    assert welcome.meta["init_owner"] is True and welcome.meta["initialized"] is False
    assert welcome.meta["versions"] == [] and welcome.meta["chunk_numel"] == 1024
    assert events_of(out, "join")[0]["target"] == "a"
    out = h.hello("b", 1.1)
    assert sent_of(out, "welcome")[0][1].meta["init_owner"] is False
    outs = h.upload_init("a", 1.2)
    assert sum(len(o.sends) for o in outs[:-1]) == 0  # nothing until the last chunk
    assert h.core.model is not None
    assert [torch.equal(t, v) for t, v in zip(h.core.model.theta, h.init_values)] == [True] * 4
    assert h.core.versions() == [0, 0, 0, 0]
    assert events_of(outs[-1], "initialized")
    ((to, ack),) = sent_of(outs[-1], "ack")
    assert to == ["a", "b"] and ack.meta["initialized"] is True
    # a non-owner cannot upload, and after the init nobody can
    h.send(
        "b",
        Message(
            "init", {"fragment": 0, "offset": 0, "numel": 1, "total": h.plan.numel(0)}, [np.zeros(1, "<f4").tobytes()]
        ),
        1.3,
    )
    assert h.core.rejected["init_refused"] == 1
    assert h.hello("c", 1.4).sends[0][1].meta["init_owner"] is False


def test_init_owner_passes_on_when_the_first_goes_silent() -> None:
    h = Harness(make_settings())
    h.hello("a", 1.0)
    assert sent_of(h.hello("b", 2.0), "welcome")[0][1]["init_owner"] is False
    # a is silent past liveness_s: the next hello takes the upload over
    assert sent_of(h.hello("b", 1.0 + 3.5), "welcome")[0][1]["init_owner"] is True
    h.upload_init("b", 5.0)
    assert h.core.model is not None


def test_init_chunk_with_nan_or_bad_layout_is_refused() -> None:
    h = Harness(make_settings())
    h.hello("a", 1.0)
    n = h.plan.numel(0)
    with pytest.raises(ProtocolError) as info:
        h.send(
            "a",
            Message(
                "init", {"fragment": 0, "offset": 0, "numel": 2, "total": n}, [np.array([1.0, np.nan], "<f4").tobytes()]
            ),
            1.0,
        )
    assert info.value.reason == "nan"
    with pytest.raises(ProtocolError) as info:
        h.send(
            "a",
            Message("init", {"fragment": 5, "offset": 0, "numel": 1, "total": n}, [np.zeros(1, "<f4").tobytes()]),
            1.0,
        )
    assert info.value.reason == "shape"
    assert h.core.model is None


def test_hello_problems() -> None:
    h = Harness(make_settings())
    out = h.hello("a", 1.0, run="other-run")
    assert sent_of(out, "error")[0][1].meta["fatal"] is True
    assert h.core.rejected["wrong_run"] == 1
    out = h.hello("a", 1.0, count=3)
    assert "fragments" in sent_of(out, "error")[0][1]["reason"] and h.core.rejected["manifest"] == 1
    h.join_all()
    out = h.hello("d", 2.0, manifest=small_manifest()[:-1])
    assert sent_of(out, "error")[0][1]["fatal"] is True and h.core.rejected["manifest"] == 2
    with pytest.raises(ProtocolError) as info:  # a manifest that does not parse
        h.send(
            "e",
            Message(
                "hello",
                {
                    "learner": "e",
                    "incarnation": "x",
                    "run": RUN,
                    "pid": 1,
                    "host": "h",
                    "device": "cpu",
                    "batch_size": 1,
                    "codecs": [],
                    "manifest": [["w", [-1], "dense"]],
                    "fragments": 2,
                },
            ),
            2.0,
        )
    assert info.value.reason == "schema"


def test_messages_before_hello_and_unexpected_kinds() -> None:
    h = Harness(make_settings())
    out = h.beat("x", 1.0)
    assert sent_of(out, "error")[0][1]["reason"] == "say hello first"
    assert "x" not in h.core.fleet.learners
    with pytest.raises(ProtocolError) as info:
        h.core.handle("x", Message("update", {}), 1.0, Outbox())
    assert info.value.reason == "unexpected_kind"


def test_before_init_pushes_and_state_requests_are_refused() -> None:
    h = Harness(make_settings())
    h.hello("a", 1.0)
    out = h.send(
        "a",
        Message(
            "push",
            {
                "fragment": 0,
                "base_version": 0,
                "seq": 0,
                "epoch": 1,
                "c_steps": 1,
                "c_tokens": 1,
                "c_time": 1.0,
                "step_time": 1.0,
            },
            [b"x"],
        ),
        1.0,
    )
    assert h.core.rejected["not_initialized"] == 1 and not out.sends
    out = h.send("a", Message("state_req", {"fragment": 0, "offset": 0}), 1.0)
    assert sent_of(out, "error")[0][1]["fatal"] is False


def test_state_transfer_serves_chunks_of_the_global_model() -> None:
    h = Harness(make_settings(), manifest=tensor_manifest("gpt-tiny"))
    h.join_all()
    replica = Replica(h.plan.sizes())
    replica.refetch_all()
    for _ in range(1000):
        reqs = replica.requests(now=1.0, chunk=h.core.chunk_numel(), window=4)
        if not reqs:
            break
        for p, offset, version in reqs:
            ((to, state),) = h.send(
                "b", Message("state_req", {"fragment": p, "offset": offset, "version": version}), 1.0
            ).sends
            assert to == ["b"] and state.kind == "state"
            values = P.check_raw_fragment(wire(state), h.plan.sizes())
            assert state["crc"] == h.core.model.crc(p)
            replica.on_state(state["fragment"], state["version"], state["offset"], values, state["crc"])
    assert replica.complete() and replica.mismatches == 0
    assert all(torch.equal(replica.latest[p], h.core.model.theta[p]) for p in range(2))
    assert replica.crcs == h.core.crcs()
    with pytest.raises(ProtocolError):
        h.send("b", Message("state_req", {"fragment": 0, "offset": h.plan.numel(0)}), 1.0)
    with pytest.raises(ProtocolError):
        h.send("b", Message("state_req", {"fragment": 2, "offset": 0}), 1.0)


# -- K-of-M quorum and the grace window -----------------------------------------------------------


def test_round_needs_quorum_then_waits_the_grace_window() -> None:
    h = Harness(make_settings(quorum=2))
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0, step_time=1.0)
    assert not h.tick(10.0).sends and not h.tick(100.0).sends  # one contribution: never closes
    h.push("b", 0, h.delta(0, 2), now=10.5, step_time=1.0)
    rnd = h.core.rounds[0]
    # grace = gamma * max(0, tau*t_step - (t_quorum + t_sync)) = 0.5 * (2*1.0 - (0.5 + 0)) = 0.75
    assert rnd.quorum_at == 10.5 and rnd.grace_s == pytest.approx(0.75)
    for now in (10.5, 11.0, 11.2):
        h.beat("a", now), h.beat("b", now), h.beat("c", now)
        assert not sent_of(h.tick(now), "update")
    out = h.tick(11.25)
    ((to, update),) = sent_of(out, "update")
    assert to == ["a", "b", "c"]
    assert update.meta["contributors"] == ["a", "b"]
    assert (update["fragment"], update["version"], update["from_version"]) == (0, 1, 0)
    (metric,) = rounds_of(out)
    assert metric["grace_s"] == pytest.approx(0.75) and metric["grace_used_s"] == pytest.approx(0.75)
    assert metric["wait_quorum_s"] == pytest.approx(0.5)
    assert metric["quorum"] == 2 and metric["live"] == 3
    assert h.core.versions() == [1, 0] and 0 not in h.core.rounds
    assert h.core.outer_steps == 1


def test_round_closes_at_once_when_every_live_learner_is_in() -> None:
    h = Harness(make_settings(quorum=2))
    h.join_all()
    for i, lid in enumerate("abc"):
        h.push(lid, 1, h.delta(1, i), now=10.0 + 0.01 * i, step_time=10.0)  # a long grace window
    assert h.core.rounds[1].grace_s > 5
    out = h.tick(10.03)
    assert sent_of(out, "update")[0][1]["contributors"] == ["a", "b", "c"]
    assert rounds_of(out)[0]["grace_used_s"] == pytest.approx(0.02)


def test_no_grace_when_slack_is_negative() -> None:
    h = Harness(make_settings(quorum=2))
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0, step_time=0.1)
    h.push("b", 0, h.delta(0, 2), now=11.0, step_time=0.1)  # t_quorum 1.0 > tau * t_step = 0.2
    assert h.core.rounds[0].grace_s == 0.0
    assert sent_of(h.tick(11.0), "update")


def test_grace_uses_the_measured_merge_time() -> None:
    h = Harness(make_settings(quorum=1), clock_step=0.1)  # every merge takes 0.1 s on the fake clock
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0, step_time=1.0)
    h.tick(10.0 + h.core.rounds[0].grace_s)
    assert h.core.t_sync == pytest.approx(0.1)
    h.push("a", 0, h.delta(0, 2), now=20.0, step_time=1.0)
    # grace = 0.5 * (2*1.0 - (0 + 0.1)) = 0.95
    assert h.core.rounds[0].grace_s == pytest.approx(0.95)


def test_straggler_inside_grace_is_included_and_after_close_goes_to_next_round() -> None:
    h = Harness(make_settings(quorum=2), declared=("a", "b", "c", "d"))
    h.join_all(("a", "b", "c", "d"))
    h.beat_all(10.0)  # all four live
    h.push("a", 0, h.delta(0, 1), now=10.0, step_time=1.0)
    h.push("b", 0, h.delta(0, 2), now=10.0, step_time=1.0)  # quorum at 10.0, grace 1.0
    h.push("c", 0, h.delta(0, 3), now=10.6, step_time=1.0)  # straggler inside the grace window
    assert not sent_of(h.tick(10.6), "update")  # d is live and not in: wait
    for lid in "abcd":
        h.beat(lid, 10.9)
    out = h.tick(11.0)
    assert sent_of(out, "update")[0][1]["contributors"] == ["a", "b", "c"]
    h.push("d", 0, h.delta(0, 4), now=11.1, step_time=1.0)  # after the close: next round
    assert list(h.core.rounds[0].contributions) == ["d"]
    h.push("a", 0, h.delta(0, 5), now=11.5, step_time=1.0)
    out = h.tick(11.5 + h.core.rounds[0].grace_s)
    update = sent_of(out, "update")[0][1]
    assert update["contributors"] == ["a", "d"] and update["version"] == 2


def test_stale_contribution_joins_the_open_round() -> None:
    h = Harness(make_settings(quorum=1))
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0)
    h.tick(20.0)
    assert h.core.versions()[0] == 1
    h.push("b", 0, h.delta(0, 2), now=21.0, base_version=0)  # based on version 0, now 1
    out = h.tick(30.0)
    assert rounds_of(out)[0]["staleness"] == 1
    assert h.core.versions()[0] == 2


def test_learner_that_left_is_not_waited_for() -> None:
    h = Harness(make_settings(quorum=2))
    h.join_all()
    h.beat_all(9.0)
    bye = h.send("c", Message("bye", {"reason": "stopping"}), 9.0)
    assert events_of(bye, "leave")[0]["target"] == "c"
    assert [to for to, _ in sent_of(bye, "bye")] == [["c"]], "the bye is echoed as a receipt"
    h.push("a", 0, h.delta(0, 1), now=10.0, step_time=10.0)
    h.push("b", 0, h.delta(0, 2), now=10.0, step_time=10.0)
    assert sent_of(h.tick(10.0), "update")  # a and b are every live learner: no grace wait
    assert h.core.fleet.learners["c"].state == "stopped"


# -- contributions ---------------------------------------------------------------------------------


def test_second_contribution_of_a_learner_is_summed() -> None:
    h = Harness(make_settings(quorum=2, compression="none", merge="mean", outer_lr=1.0, outer_momentum=0.0))
    h.join_all()
    theta0 = h.core.model.theta[0].clone()
    d1, d2, db = h.delta(0, 1), h.delta(0, 2), h.delta(0, 3)
    h.push("a", 0, d1, now=10.0, c_steps=10, c_tokens=100)
    h.push("a", 0, d2, now=10.2, c_steps=10, c_tokens=300)
    rnd = h.core.rounds[0]
    assert len(rnd.contributions) == 1 and rnd.quorum_at is None  # still one distinct learner
    ca = rnd.contributions["a"]
    assert (ca.c_steps, ca.c_tokens, ca.c_time) == (20, 400, 20.0)
    assert torch.equal(ca.values(), d1 + d2) and len(ca.parts) == 2  # both pushes kept; the merge sums them
    assert not sent_of(h.tick(50.0), "update")
    h.push("b", 0, db, now=60.0, c_steps=10, c_tokens=200)
    out = h.tick(60.0 + h.core.rounds[0].grace_s)
    (metric,) = rounds_of(out)
    # a: 400 tokens / 20 steps -> 400 * 20 = 8000;  b: 200 * 20 = 4000  -> shares 2/3, 1/3
    assert metric["weights"] == {"a": 0.6667, "b": 0.3333}
    assert metric["tokens"] == 600
    expected = theta0 - ((d1 + d2) * (2 / 3) + db * (1 / 3))  # lr 1, no momentum, no compression
    torch.testing.assert_close(h.core.model.theta[0], expected, rtol=0, atol=1e-7)


# -- rejected pushes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "bad"), [("int4", float("nan")), ("int8", float("inf")), ("none", float("nan")), ("bf16", float("-inf"))]
)
def test_nan_push_is_rejected_and_the_learner_resynced(mode: str, bad: float) -> None:
    h = Harness(make_settings(quorum=1, compression=mode))
    h.join_all()
    before = [t.clone() for t in h.core.model.theta]
    d = h.delta(0, 1)
    d[7] = bad
    out = h.push("b", 0, d, now=10.0)
    assert h.core.rejected["nan"] == 1
    ((to, resync),) = sent_of(out, "resync")
    assert to == ["b"] and resync["fragment"] == 0
    assert events_of(out, "reject")[0]["target"] == "b"
    assert not h.core.rounds.get(0) or not h.core.rounds[0].contributions
    h.tick(100.0)
    assert all(torch.equal(a, b) for a, b in zip(h.core.model.theta, before))
    assert h.core.versions() == [0, 0] and h.core.counters["pushes"] == 0


def test_malformed_pushes() -> None:
    h = Harness(make_settings(quorum=1))
    h.join_all()
    # wrong number of values for the fragment: a codec rejection, with a resync
    out = h.push("a", 0, torch.zeros(h.plan.numel(0) + 1), now=10.0)
    assert h.core.rejected["codec"] == 1 and sent_of(out, "resync")
    out = h.push("a", 0, torch.zeros(1), now=10.0, blob=b"garbage")
    assert h.core.rejected["codec"] == 2
    with pytest.raises(ProtocolError):
        h.push("a", 0, h.delta(0, 1), now=10.0, c_steps=0)
    with pytest.raises(ProtocolError):
        h.push("a", 0, h.delta(0, 1), now=10.0, c_tokens=-1)
    with pytest.raises(ProtocolError) as info:
        h.push("a", 2, h.delta(0, 1), now=10.0, base_version=0)
    assert info.value.reason == "shape"
    assert not h.core.rounds.get(0) or not h.core.rounds[0].contributions


# -- quorum events ---------------------------------------------------------------------------------


def test_round_stays_open_below_quorum() -> None:
    h = Harness(make_settings(quorum=2))
    h.join_all(now=1.0)
    h.push("a", 0, h.delta(0, 1), now=2.0)
    for now in (3.0, 10.0, 100.0):
        h.beat("a", now)
        assert not sent_of(h.tick(now), "update")
    assert status.snapshot(h.core, 100.0)["quorum"]["open_rounds"] == 1


# -- bounded queue -----------------------------------------------------------------------------------


def test_max_queue_drops_the_oldest_contribution() -> None:
    h = Harness(make_settings(quorum=3, fragments=4, H=8, max_queue=3))
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0)
    h.push("b", 1, h.delta(1, 2), now=11.0)
    h.push("a", 2, h.delta(2, 3), now=12.0)
    out = h.push("b", 3, h.delta(3, 4), now=13.0)
    assert h.core.counters["dropped_pushes"] == 1
    (ev,) = events_of(out, "drop")
    assert ev["target"] == "a" and "fragment 0" in ev["detail"]
    assert not h.core.rounds[0].contributions
    assert h.core.rounds[0].first_at is None and h.core.rounds[0].quorum_at is None
    assert sum(len(r.contributions) for r in h.core.rounds.values()) == 3
    assert status.snapshot(h.core, 13.0)["syncer"]["dropped_pushes"] == 1


def test_dropping_below_quorum_resets_the_quorum_time() -> None:
    h = Harness(make_settings(quorum=2, max_queue=2))
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0)
    h.push("b", 0, h.delta(0, 2), now=10.5)
    assert h.core.rounds[0].quorum_at == 10.5
    h.push("c", 1, h.delta(1, 3), now=11.0)  # 3 > 2: a's push on fragment 0 is dropped
    assert list(h.core.rounds[0].contributions) == ["b"]
    assert h.core.rounds[0].quorum_at is None
    assert not sent_of(h.tick(50.0), "update")
