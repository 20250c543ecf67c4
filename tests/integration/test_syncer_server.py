"""A real syncer process on 127.0.0.1 against learner-like protocol clients.

Quorum with a dead learner, the grace window (a straggler inside it is merged, one outside goes
into the next round), token weights, CURVE refusals and impersonation, a flood of malformed
frames, and the bit-exact published value.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from syncer.wire import codec
from syncer.wire.protocol import Message, encode
from tests.localrun import LocalRun, write_config
from tests.protoclient import ProtoClient, initial_values

pytestmark = pytest.mark.timeout(120)


def start(tmp_path: Path, learners: int, **run: object) -> LocalRun:
    config = write_config(
        tmp_path, [{} for _ in range(learners)], run={"liveness_s": 1.5, "round_clock": "learner", **run}
    )
    lr = LocalRun(tmp_path, config)
    lr.start_syncer()
    lr.wait_for(lambda s: s["syncer"]["alive"], 20, "syncer up")
    return lr


@pytest.fixture
def syncer3(tmp_path: Path) -> Iterator[LocalRun]:
    """A syncer for 3 learners, quorum 2, grace window sized by step times of 1 s."""
    with start(tmp_path, 3, quorum=2) as lr:
        yield lr


def clients(lr: LocalRun, n: int) -> list[ProtoClient]:
    """n clients joined: the first uploads the initial state, the others fetch it."""
    address = f"tcp://127.0.0.1:{lr.cfg.syncer.port}"
    out = [ProtoClient(address, f"learner-{i}", lr.cfg.run_id, lr.dir / "keys") for i in range(n)]
    welcome = out[0].hello()
    assert welcome["init_owner"] and not welcome["initialized"]
    out[0].upload_init(initial_values(out[0].plan))
    out[0].recv("ack")
    for c in out[1:]:
        assert c.hello()["initialized"]
    return out


def beat(cs: list[ProtoClient], seconds: float) -> None:
    """Keep clients live (heartbeats with state running) for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for c in cs:
            c.heartbeat()
        time.sleep(0.1)


def wait_round(lr: LocalRun, timeout: float = 10.0) -> dict:
    """The newest round record (the update reaches clients before the record reaches the disk)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rounds = lr.metrics("round")
        if rounds:
            return rounds[-1]
        time.sleep(0.05)
    raise AssertionError("no round was recorded in metrics.jsonl")


def close_all(cs: list[ProtoClient]) -> None:
    for c in cs:
        c.close()


def test_quorum_closes_with_a_dead_learner_and_stays_open_below_it(syncer3: LocalRun) -> None:
    a, b, _c = cs = clients(syncer3, 3)
    try:
        beat(cs, 0.3)
        n = a.plan.numel(0)
        a.push(0, torch.full((n,), 0.1), 10, 1000)
        beat([a, b], 1.0)  # c goes silent: it is dead from the syncer's point of view
        assert syncer3.status()["syncer"]["outer_steps"] == 0, "closed below quorum 2"
        b.push(0, torch.full((n,), 0.1), 10, 1000)
        update = a.recv("update", timeout=5)
        assert update["contributors"] == ["learner-0", "learner-1"] and update["version"] == 1
        beat([a], 2.0)  # now only a is live: below quorum
        snap = syncer3.status()
        assert snap["quorum"]["below_quorum"] and snap["quorum"]["live"] == 1
        a.push(1, torch.full((a.plan.numel(1),), 0.1), 10, 1000)
        beat([a], 1.0)
        assert syncer3.status()["quorum"]["open_rounds"] == 1, "round must stay open below quorum"
        events = [e["kind"] for e in syncer3.events()]
        assert "quorum_lost" in events
    finally:
        close_all(cs)


def test_grace_window_includes_a_near_straggler_not_a_late_one(tmp_path: Path) -> None:
    with start(tmp_path, 3, quorum=1, tau=2, grace_gamma=0.5) as lr:
        a, b, _c = cs = clients(lr, 3)
        try:
            beat(cs, 0.3)
            n = a.plan.numel(2)
            # step_time 1 s: slack = 2 * 1 - (0 + t_sync) ~ 2 s, grace ~ 1 s after quorum
            a.push(2, torch.full((n,), 0.1), 10, 1000, step_time=1.0)
            beat(cs, 0.3)
            b.push(2, torch.full((n,), 0.1), 10, 1000, step_time=1.0)
            first = a.recv("update", timeout=5)
            assert first["contributors"] == ["learner-0", "learner-1"], "straggler inside the grace window"
            a.push(2, torch.full((n,), 0.1), 10, 1000, step_time=1.0)
            beat(cs, 1.8)
            b.push(2, torch.full((n,), 0.1), 10, 1000, step_time=1.0)
            second = a.recv("update", timeout=5)
            third = a.recv("update", timeout=5)
            assert second["contributors"] == ["learner-0"], "late straggler must not hold the round"
            assert third["contributors"] == ["learner-1"] and third["version"] == second["version"] + 1
            wait_round(lr)
            rounds = lr.metrics("round")
            # c is live but silent, so the round waited out the whole window
            assert 0.5 < rounds[0]["grace_s"] <= rounds[0]["grace_used_s"] + 0.1
        finally:
            close_all(cs)


def test_weights_follow_the_token_rule(syncer3: LocalRun) -> None:
    a, b, _c = cs = clients(syncer3, 3)
    try:
        beat(cs, 0.3)
        n = a.plan.numel(1)
        a.push(1, torch.full((n,), 0.1), 10, 1000)  # w = 1000 * 100 = 100000
        b.push(1, torch.full((n,), 0.1), 10, 500)  # w = 500 * 50  = 25000
        a.recv("update", timeout=5)
        rnd = wait_round(syncer3)
        assert rnd["weights"] == pytest.approx({"learner-0": 0.8, "learner-1": 0.2})
        assert rnd["tokens"] == 1500
    finally:
        close_all(cs)


def test_published_value_is_bit_exact(syncer3: LocalRun) -> None:
    a, b, c = cs = clients(syncer3, 3)
    try:
        before = b.fetch()
        beat(cs, 0.2)
        g = torch.Generator().manual_seed(1)
        for p in range(a.plan.count):
            a.push(p, torch.randn(a.plan.numel(p), generator=g) * 0.01, 10, 1000)
            b.push(p, torch.randn(a.plan.numel(p), generator=g) * 0.01, 10, 1000)
        updates = {}
        while len(updates) < a.plan.count:
            msg = c.recv("update", timeout=5)
            updates[msg["fragment"]] = msg
        after = c.fetch()
        for p, msg in updates.items():
            rebuilt = before[p] + codec.decode(msg.payloads[0], before[p].numel())
            torch.testing.assert_close(rebuilt, after[p], rtol=0, atol=0)
        # and these merges ran in the native kernel (it reports only when it could not be built)
        assert not [e for e in syncer3.events() if e["kind"] == "native_kernel"]
    finally:
        close_all(cs)


def test_curve_refuses_unknown_keys_impersonation_and_the_wrong_socket(syncer3: LocalRun, tmp_path: Path) -> None:
    from syncer.common import keys

    stranger_dir = tmp_path / "stranger"
    keys.create(stranger_dir, "learner-0")
    (stranger_dir / "syncer.key").write_bytes((syncer3.dir / "keys" / "syncer.key").read_bytes())
    address = f"tcp://127.0.0.1:{syncer3.cfg.syncer.port}"
    run_id = syncer3.cfg.run_id
    stranger = ProtoClient(address, "learner-0", run_id, stranger_dir)
    operator = ProtoClient(address, "learner-0", run_id, syncer3.dir / "keys", key_name="operator")
    liar = ProtoClient(address, "learner-1", run_id, syncer3.dir / "keys", key_name="learner-0")
    control = ProtoClient(
        f"tcp://127.0.0.1:{syncer3.cfg.syncer.control_port}", "learner-0", run_id, syncer3.dir / "keys"
    )
    try:
        for c in (stranger, operator, liar):
            try:
                c.send(
                    Message(
                        "hello",
                        {
                            "learner": c.learner,
                            "incarnation": "x",
                            "run": run_id,
                            "pid": 1,
                            "host": "h",
                            "device": "cpu",
                            "batch_size": 1,
                            "codecs": [],
                            "manifest": [["a", [4], "dense"]],
                            "fragments": 4,
                        },
                    )
                )
            except zmq.Again:
                assert c is not liar  # a refused handshake can drop the pipe before the send: refused too
        control.send(Message("status_req", {}))
        for c in (stranger, operator, liar, control):
            assert c.poll_silent(1.5), f"{c.learner} got an answer"
        rejected = syncer3.status()["syncer"]["rejected"]
        assert rejected.get("unauthenticated_learners", 0) >= 2
        assert rejected.get("unauthenticated_control", 0) >= 1
        assert rejected.get("impersonation", 0) >= 1
    finally:
        close_all([stranger, operator, liar, control])


def test_a_thousand_malformed_messages_do_not_stop_merges(syncer3: LocalRun) -> None:
    a, b, c = cs = clients(syncer3, 3)
    rng = random.Random(0)
    valid = encode(Message("heartbeat", {"step": 1, "tokens": 1, "state": "running"}))
    try:
        before = b.fetch()
        for i in range(1000):
            kind = i % 5
            if kind == 0:
                frames = [os.urandom(rng.randint(0, 64))]
            elif kind == 1:
                frames = [valid[0][: rng.randint(0, len(valid[0]) - 1)]]
            elif kind == 2:
                frames = [bytearray(valid[0])]
                frames[0][4] = 99  # protocol version
                frames = [bytes(frames[0])]
            elif kind == 3:
                frames = [valid[0], b"unannounced payload"]
            else:
                nan = torch.full((a.plan.numel(0),), float("nan"))
                frames = encode(
                    Message(
                        "push",
                        {
                            "fragment": 0,
                            "base_version": 0,
                            "seq": 0,
                            "epoch": 1,
                            "c_steps": 1,
                            "c_tokens": 1,
                            "c_time": 0.1,
                            "step_time": 0.1,
                        },
                        [codec.encode(nan, "none")],
                    )
                )
            c.send_raw(frames)
        assert [t.sum() for t in b.fetch()] == [t.sum() for t in before], "garbage changed the model"
        beat(cs, 0.3)
        n = a.plan.numel(3)
        a.push(3, torch.full((n,), 0.1), 10, 1000)
        b.push(3, torch.full((n,), 0.1), 10, 1000)
        assert a.recv("update", timeout=10)["version"] == 1
        snap = syncer3.status()
        assert sum(snap["syncer"]["rejected"].values()) >= 1000
        assert snap["syncer"]["rejected"].get("nan", 0) >= 200
        assert syncer3.procs["syncer"].poll() is None
    finally:
        close_all(cs)
