"""The syncer's state machine driven directly (no sockets, fake clock): joining and the init
upload, K-of-M quorum with the adaptive grace window, stragglers, summed double contributions,
token weights, rejection of NaN pushes, bit-exact publishing, quorum events, the bounded queue,
the status snapshot and checkpoints (round trip, corrupted newest file skipped).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from learner.model import param_shapes
from learner.replica import Replica
from syncer import checkpoint, codec, fragments, merge, status
from syncer import protocol as P
from syncer.core import Outbox, SyncerCore
from syncer.protocol import Message, ProtocolError
from syncer.settings import RunSettings

RUN = "run-test"
EMBEDDINGS = {"transformer.wte.weight", "transformer.wpe.weight"}


class Clock:
    """The injected monotonic clock: each reading advances it by `step` (a merge 'takes' time)."""

    def __init__(self, step: float = 0.0) -> None:
        self.t = 0.0
        self.step = step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def _manifest(name: str = "gpt-tiny") -> list[fragments.TensorSpec]:
    return [fragments.TensorSpec(n, s, "embedding" if n in EMBEDDINGS else "dense")
            for n, s in param_shapes(name, block_size=16)]


def _small_manifest() -> list[fragments.TensorSpec]:
    return [fragments.TensorSpec("emb", (16, 8), "embedding"), fragments.TensorSpec("w1", (8, 8)),
            fragments.TensorSpec("b1", (8,)), fragments.TensorSpec("w2", (8, 4)),
            fragments.TensorSpec("w3", (4, 4))]


def _settings(**changes: Any) -> RunSettings:
    base = dict(H=8, fragments=2, quorum=2, tau=2, grace_gamma=0.5, compression="int4", merge="rda",
                liveness_s=3.0, heartbeat_s=0.5, state_chunk_mb=0.001, fleet_scale=False, max_queue=256)
    base.update(changes)
    s = RunSettings(**base)
    s.validate()
    return s


def _wire(msg: Message) -> Message:
    """Through the real encoder and decoder, as the server would see it."""
    return P.decode(P.encode(msg))


class Harness:
    """A SyncerCore plus helpers that speak for learners."""

    def __init__(self, settings: RunSettings, manifest: list[fragments.TensorSpec] | None = None,
                 declared: tuple[str, ...] = ("a", "b", "c"), clock_step: float = 0.0) -> None:
        self.s = settings
        self.seq = 0
        self.clock = Clock(clock_step)
        self.core = SyncerCore(settings, RUN, list(declared), now=0.0, clock=self.clock)
        self.manifest = manifest or _small_manifest()
        self.plan = fragments.plan(self.manifest, settings.fragments)
        g = torch.Generator().manual_seed(0)
        self.init_values = [torch.randn(n, generator=g) * 0.02 for n in self.plan.sizes()]
        self.outs: list[Outbox] = []

    def send(self, learner: str, msg: Message, now: float) -> Outbox:
        out = Outbox()
        self.core.handle(learner, _wire(msg), now, out)
        self.outs.append(out)
        return out

    def tick(self, now: float) -> Outbox:
        out = Outbox()
        self.core.tick(now, out)
        self.outs.append(out)
        return out

    def hello(self, learner: str, now: float, incarnation: str = "i1", run: str = RUN,
              manifest: list[fragments.TensorSpec] | None = None, count: int | None = None) -> Outbox:
        return self.send(learner, Message("hello", {
            "learner": learner, "incarnation": incarnation, "run": run, "pid": 100, "host": "local",
            "device": "cpu", "batch_size": 16, "codecs": list(codec.MODES),
            "manifest": fragments.manifest_to_json(manifest or self.manifest),
            "fragments": self.s.fragments if count is None else count}), now)

    def beat(self, learner: str, now: float, state: str = "running", step: int = 1) -> Outbox:
        return self.send(learner, Message("heartbeat", {"step": step, "tokens": step * 16, "state": state}), now)

    def beat_all(self, now: float) -> None:
        for lid in self.core.fleet.learners:
            self.beat(lid, now)

    def upload_init(self, owner: str, now: float) -> list[Outbox]:
        chunk = self.core.chunk_numel()
        outs = []
        for p, values in enumerate(self.init_values):
            for off in range(0, values.numel(), chunk):
                part = values[off : off + chunk]
                outs.append(self.send(owner, Message("init", {"fragment": p, "offset": off, "numel": part.numel(),
                                                               "total": values.numel()}, [part.numpy().tobytes()]), now))
        return outs

    def join_all(self, learners: tuple[str, ...] = ("a", "b", "c"), now: float = 1.0) -> None:
        for lid in learners:
            self.hello(lid, now)
        self.upload_init(learners[0], now)
        for lid in learners:
            self.beat(lid, now)
        assert self.core.model is not None

    def push(self, learner: str, p: int, delta: torch.Tensor, now: float, c_steps: int = 8, c_tokens: int = 128,
             step_time: float = 1.0, base_version: int | None = None, blob: bytes | None = None) -> Outbox:
        assert self.core.model is not None
        if base_version is None:
            base_version = self.core.model.versions[p]
        blob = codec.encode(delta, self.s.compression, self.s.block) if blob is None else blob
        self.seq += 1  # a learner's pushes carry increasing sequence numbers (replays are refused)
        return self.send(learner, Message("push", {
            "fragment": p, "base_version": base_version, "seq": self.seq, "epoch": 1, "c_steps": c_steps,
            "c_tokens": c_tokens, "c_time": c_steps * step_time, "step_time": step_time}, [blob]), now)

    def delta(self, p: int, seed: int, scale: float = 1e-3) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(self.plan.numel(p), generator=g) * scale


def _sent(out: Outbox, kind: str) -> list[tuple[list[str], Message]]:
    return [(to, m) for to, m in out.sends if m.kind == kind]


def _events(out: Outbox, kind: str) -> list[dict]:
    return [e for e in out.events if e["kind"] == kind]


def _rounds(out: Outbox) -> list[dict]:
    return [m for m in out.metrics if m["kind"] == "round"]


# -- joining and init ------------------------------------------------------------------------------


def test_first_learner_owns_init_and_uploads_real_manifest() -> None:
    h = Harness(_settings(fragments=4, H=8), manifest=_manifest("gpt-tiny"))
    out = h.hello("a", 1.0)
    (to, welcome), = _sent(out, "welcome")
    assert to == ["a"]
    assert welcome.meta["init_owner"] is True and welcome.meta["initialized"] is False
    assert welcome.meta["versions"] == [] and welcome.meta["chunk_numel"] == 1024
    assert _events(out, "join")[0]["target"] == "a"
    out = h.hello("b", 1.1)
    assert _sent(out, "welcome")[0][1].meta["init_owner"] is False
    outs = h.upload_init("a", 1.2)
    assert sum(len(o.sends) for o in outs[:-1]) == 0          # nothing until the last chunk
    assert h.core.model is not None
    assert [torch.equal(t, v) for t, v in zip(h.core.model.theta, h.init_values)] == [True] * 4
    assert h.core.versions() == [0, 0, 0, 0]
    assert _events(outs[-1], "initialized")
    (to, ack), = _sent(outs[-1], "ack")
    assert to == ["a", "b"] and ack.meta["initialized"] is True
    # a non-owner cannot upload, and after the init nobody can
    h.send("b", Message("init", {"fragment": 0, "offset": 0, "numel": 1, "total": h.plan.numel(0)},
                        [np.zeros(1, "<f4").tobytes()]), 1.3)
    assert h.core.rejected["init_refused"] == 1
    assert h.hello("c", 1.4).sends[0][1].meta["init_owner"] is False


def test_init_owner_passes_on_when_the_first_goes_silent() -> None:
    h = Harness(_settings())
    h.hello("a", 1.0)
    assert _sent(h.hello("b", 2.0), "welcome")[0][1]["init_owner"] is False
    # a is silent past liveness_s: the next hello takes the upload over
    assert _sent(h.hello("b", 1.0 + 3.5), "welcome")[0][1]["init_owner"] is True
    h.upload_init("b", 5.0)
    assert h.core.model is not None


def test_init_chunk_with_nan_or_bad_layout_is_refused() -> None:
    h = Harness(_settings())
    h.hello("a", 1.0)
    n = h.plan.numel(0)
    with pytest.raises(ProtocolError) as info:
        h.send("a", Message("init", {"fragment": 0, "offset": 0, "numel": 2, "total": n},
                            [np.array([1.0, np.nan], "<f4").tobytes()]), 1.0)
    assert info.value.reason == "nan"
    with pytest.raises(ProtocolError) as info:
        h.send("a", Message("init", {"fragment": 5, "offset": 0, "numel": 1, "total": n},
                            [np.zeros(1, "<f4").tobytes()]), 1.0)
    assert info.value.reason == "shape"
    assert h.core.model is None


def test_hello_problems() -> None:
    h = Harness(_settings())
    out = h.hello("a", 1.0, run="other-run")
    assert _sent(out, "error")[0][1].meta["fatal"] is True
    assert h.core.rejected["wrong_run"] == 1
    out = h.hello("a", 1.0, count=3)
    assert "fragments" in _sent(out, "error")[0][1]["reason"] and h.core.rejected["manifest"] == 1
    h.join_all()
    out = h.hello("d", 2.0, manifest=_small_manifest()[:-1])
    assert _sent(out, "error")[0][1]["fatal"] is True and h.core.rejected["manifest"] == 2
    with pytest.raises(ProtocolError) as info:  # a manifest that does not parse
        h.send("e", Message("hello", {
            "learner": "e", "incarnation": "x", "run": RUN, "pid": 1, "host": "h", "device": "cpu", "batch_size": 1,
            "codecs": [], "manifest": [["w", [-1], "dense"]], "fragments": 2}), 2.0)
    assert info.value.reason == "schema"


def test_messages_before_hello_and_unexpected_kinds() -> None:
    h = Harness(_settings())
    out = h.beat("x", 1.0)
    assert _sent(out, "error")[0][1]["reason"] == "say hello first"
    assert "x" not in h.core.fleet.learners
    with pytest.raises(ProtocolError) as info:
        h.core.handle("x", Message("update", {}), 1.0, Outbox())
    assert info.value.reason == "unexpected_kind"


def test_before_init_pushes_and_state_requests_are_refused() -> None:
    h = Harness(_settings())
    h.hello("a", 1.0)
    out = h.send("a", Message("push", {"fragment": 0, "base_version": 0, "seq": 0, "epoch": 1, "c_steps": 1,
                                       "c_tokens": 1, "c_time": 1.0, "step_time": 1.0}, [b"x"]), 1.0)
    assert h.core.rejected["not_initialized"] == 1 and not out.sends
    out = h.send("a", Message("state_req", {"fragment": 0, "offset": 0}), 1.0)
    assert _sent(out, "error")[0][1]["fatal"] is False


def test_state_transfer_serves_chunks_of_the_global_model() -> None:
    h = Harness(_settings(), manifest=_manifest("gpt-tiny"))
    h.join_all()
    replica = Replica(h.plan.sizes())
    replica.refetch_all()
    for _ in range(1000):
        reqs = replica.requests(now=1.0, chunk=h.core.chunk_numel(), window=4)
        if not reqs:
            break
        for p, offset, version in reqs:
            (to, state), = h.send("b", Message("state_req", {"fragment": p, "offset": offset, "version": version}), 1.0).sends
            assert to == ["b"] and state.kind == "state"
            values = P.check_raw_fragment(_wire(state), h.plan.sizes())
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
    h = Harness(_settings(quorum=2))
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0, step_time=1.0)
    assert not h.tick(10.0).sends and not h.tick(100.0).sends  # one contribution: never closes
    h.push("b", 0, h.delta(0, 2), now=10.5, step_time=1.0)
    rnd = h.core.rounds[0]
    # grace = gamma * max(0, tau*t_step - (t_quorum + t_sync)) = 0.5 * (2*1.0 - (0.5 + 0)) = 0.75
    assert rnd.quorum_at == 10.5 and rnd.grace_s == pytest.approx(0.75)
    for now in (10.5, 11.0, 11.2):
        h.beat("a", now), h.beat("b", now), h.beat("c", now)
        assert not _sent(h.tick(now), "update")
    out = h.tick(11.25)
    (to, update), = _sent(out, "update")
    assert to == ["a", "b", "c"]
    assert update.meta["contributors"] == ["a", "b"]
    assert (update["fragment"], update["version"], update["from_version"]) == (0, 1, 0)
    (metric,) = _rounds(out)
    assert metric["grace_s"] == pytest.approx(0.75) and metric["grace_used_s"] == pytest.approx(0.75)
    assert metric["wait_quorum_s"] == pytest.approx(0.5)
    assert metric["quorum"] == 2 and metric["live"] == 3
    assert h.core.versions() == [1, 0] and 0 not in h.core.rounds
    assert h.core.outer_steps == 1


def test_round_closes_at_once_when_every_live_learner_is_in() -> None:
    h = Harness(_settings(quorum=2))
    h.join_all()
    for i, lid in enumerate("abc"):
        h.push(lid, 1, h.delta(1, i), now=10.0 + 0.01 * i, step_time=10.0)  # a long grace window
    assert h.core.rounds[1].grace_s > 5
    out = h.tick(10.03)
    assert _sent(out, "update")[0][1]["contributors"] == ["a", "b", "c"]
    assert _rounds(out)[0]["grace_used_s"] == pytest.approx(0.02)


def test_no_grace_when_slack_is_negative() -> None:
    h = Harness(_settings(quorum=2))
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0, step_time=0.1)
    h.push("b", 0, h.delta(0, 2), now=11.0, step_time=0.1)  # t_quorum 1.0 > tau * t_step = 0.2
    assert h.core.rounds[0].grace_s == 0.0
    assert _sent(h.tick(11.0), "update")


def test_grace_uses_the_measured_merge_time() -> None:
    h = Harness(_settings(quorum=1), clock_step=0.1)  # every merge takes 0.1 s on the fake clock
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0, step_time=1.0)
    h.tick(10.0 + h.core.rounds[0].grace_s)
    assert h.core.t_sync == pytest.approx(0.1)
    h.push("a", 0, h.delta(0, 2), now=20.0, step_time=1.0)
    # grace = 0.5 * (2*1.0 - (0 + 0.1)) = 0.95
    assert h.core.rounds[0].grace_s == pytest.approx(0.95)


def test_straggler_inside_grace_is_included_and_after_close_goes_to_next_round() -> None:
    h = Harness(_settings(quorum=2), declared=("a", "b", "c", "d"))
    h.join_all(("a", "b", "c", "d"))
    h.beat_all(10.0)                                          # all four live
    h.push("a", 0, h.delta(0, 1), now=10.0, step_time=1.0)
    h.push("b", 0, h.delta(0, 2), now=10.0, step_time=1.0)   # quorum at 10.0, grace 1.0
    h.push("c", 0, h.delta(0, 3), now=10.6, step_time=1.0)   # straggler inside the grace window
    assert not _sent(h.tick(10.6), "update")                  # d is live and not in: wait
    for lid in "abcd":
        h.beat(lid, 10.9)
    out = h.tick(11.0)
    assert _sent(out, "update")[0][1]["contributors"] == ["a", "b", "c"]
    h.push("d", 0, h.delta(0, 4), now=11.1, step_time=1.0)   # after the close: next round
    assert list(h.core.rounds[0].contributions) == ["d"]
    h.push("a", 0, h.delta(0, 5), now=11.5, step_time=1.0)
    out = h.tick(11.5 + h.core.rounds[0].grace_s)
    update = _sent(out, "update")[0][1]
    assert update["contributors"] == ["a", "d"] and update["version"] == 2


def test_stale_contribution_joins_the_open_round() -> None:
    h = Harness(_settings(quorum=1))
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0)
    h.tick(20.0)
    assert h.core.versions()[0] == 1
    h.push("b", 0, h.delta(0, 2), now=21.0, base_version=0)    # based on version 0, now 1
    out = h.tick(30.0)
    assert _rounds(out)[0]["staleness"] == 1
    assert h.core.versions()[0] == 2


def test_learner_that_left_is_not_waited_for() -> None:
    h = Harness(_settings(quorum=2))
    h.join_all()
    h.beat_all(9.0)
    bye = h.send("c", Message("bye", {"reason": "stopping"}), 9.0)
    assert _events(bye, "leave")[0]["target"] == "c"
    h.push("a", 0, h.delta(0, 1), now=10.0, step_time=10.0)
    h.push("b", 0, h.delta(0, 2), now=10.0, step_time=10.0)
    assert _sent(h.tick(10.0), "update")  # a and b are every live learner: no grace wait
    assert h.core.fleet.learners["c"].state == "stopped"


# -- contributions, weights, merge ---------------------------------------------------------------


def test_second_contribution_of_a_learner_is_summed() -> None:
    h = Harness(_settings(quorum=2, compression="none", merge="mean", outer_lr=1.0, outer_momentum=0.0))
    h.join_all()
    theta0 = h.core.model.theta[0].clone()
    d1, d2, db = h.delta(0, 1), h.delta(0, 2), h.delta(0, 3)
    h.push("a", 0, d1, now=10.0, c_steps=10, c_tokens=100)
    h.push("a", 0, d2, now=10.2, c_steps=10, c_tokens=300)
    rnd = h.core.rounds[0]
    assert len(rnd.contributions) == 1 and rnd.quorum_at is None  # still one distinct learner
    ca = rnd.contributions["a"]
    assert (ca.c_steps, ca.c_tokens, ca.c_time) == (20, 400, 20.0)
    assert torch.equal(ca.delta, d1 + d2)
    assert not _sent(h.tick(50.0), "update")
    h.push("b", 0, db, now=60.0, c_steps=10, c_tokens=200)
    out = h.tick(60.0 + h.core.rounds[0].grace_s)
    (metric,) = _rounds(out)
    # a: 400 tokens / 20 steps -> 400 * 20 = 8000;  b: 200 * 20 = 4000  -> shares 2/3, 1/3
    assert metric["weights"] == {"a": 0.6667, "b": 0.3333}
    assert metric["tokens"] == 600
    expected = theta0 - ((d1 + d2) * (2 / 3) + db * (1 / 3))  # lr 1, no momentum, no compression
    torch.testing.assert_close(h.core.model.theta[0], expected, rtol=0, atol=1e-7)


def test_round_weights_follow_tokens_squared_over_steps() -> None:
    h = Harness(_settings(quorum=3))
    h.join_all()
    h.push("a", 1, h.delta(1, 1), now=10.0, c_steps=10, c_tokens=100)   # 1000
    h.push("b", 1, h.delta(1, 2), now=10.0, c_steps=10, c_tokens=200)   # 4000
    h.push("c", 1, h.delta(1, 3), now=10.0, c_steps=5, c_tokens=100)    # 2000
    (metric,) = _rounds(h.tick(10.0))
    assert metric["weights"] == {"a": round(1000 / 7000, 4), "b": round(4000 / 7000, 4), "c": round(2000 / 7000, 4)}
    rows = {r["id"]: r for r in h.core.fleet.rows(10.0)}
    assert rows["b"]["weight"] == pytest.approx(4 / 7)


def test_merge_outer_step_and_publish_match_the_pure_functions() -> None:
    s = _settings(quorum=2)
    h = Harness(s)
    h.join_all()
    m = h.core.model
    theta0, mom0, res0 = m.theta[0].clone(), m.momentum[0].clone(), m.residual[0].clone()
    da, db = h.delta(0, 1), h.delta(0, 2)
    h.push("a", 0, da, now=10.0, c_steps=8, c_tokens=128)
    h.push("b", 0, db, now=10.0, c_steps=8, c_tokens=256)
    h.push("c", 0, h.delta(0, 3) * 0, now=10.0, c_steps=8, c_tokens=0)  # weight 0
    h.tick(10.0)
    deltas = [codec.roundtrip(d, "int4", s.block) for d in (da, db, torch.zeros_like(da))]
    weights = [merge.token_weight(128, 8), merge.token_weight(256, 8), 0.0]
    merged = merge.merge(deltas, weights, h.plan.segments(0), "rda")
    new, mom = merge.nesterov_step(theta0, merged, mom0, s.outer_lr, s.outer_momentum)
    torch.testing.assert_close(m.momentum[0], mom)
    change = new - theta0 + res0
    applied = codec.roundtrip(change, "int4", s.block)
    torch.testing.assert_close(m.theta[0], theta0 + applied, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(m.residual[0], change - applied, rtol=1e-4, atol=1e-9)
    # fragment 0 holds rows 0..7 of the embedding table: merged by the plain weighted mean
    off, n, _ = next(seg for seg in h.plan.segments(0) if seg[2] == "embedding")
    mean = merge.weighted_mean([d[off:off + n] for d in deltas], weights)
    torch.testing.assert_close(merged[off:off + n], mean)
    # the dense segments are RDA: not the mean (their deltas are independent noise)
    off, n, _ = next(seg for seg in h.plan.segments(0) if seg[2] == "dense")
    assert not torch.allclose(merged[off:off + n], merge.weighted_mean([d[off:off + n] for d in deltas], weights))


def test_fleet_scale_shrinks_a_partial_round() -> None:
    h = Harness(_settings(quorum=2, fleet_scale=True, compression="none", merge="mean", outer_lr=1.0,
                          outer_momentum=0.0, seq_len=1))
    h.join_all()
    theta0 = h.core.model.theta[0].clone()
    d = h.delta(0, 1)
    h.beat_all(10.0)                                        # a, b and c live
    h.push("a", 0, d, now=10.0, c_steps=10, c_tokens=160)   # 16 tokens/step = the batch x seq_len guess
    h.push("b", 0, d, now=10.0, c_steps=10, c_tokens=160)
    h.tick(10.0 + h.core.rounds[0].grace_s)
    # period = 3 live learners * 16 tokens/step * H=8 = 384 tokens; this round has 320 -> 5/6
    torch.testing.assert_close(h.core.model.theta[0], theta0 - d * (320 / 384), rtol=0, atol=1e-7)


# -- rejected pushes -------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "bad"), [("int4", float("nan")), ("int8", float("inf")), ("none", float("nan")),
                                           ("bf16", float("-inf"))])
def test_nan_push_is_rejected_and_the_learner_resynced(mode: str, bad: float) -> None:
    h = Harness(_settings(quorum=1, compression=mode))
    h.join_all()
    before = [t.clone() for t in h.core.model.theta]
    d = h.delta(0, 1)
    d[7] = bad
    out = h.push("b", 0, d, now=10.0)
    assert h.core.rejected["nan"] == 1
    (to, resync), = _sent(out, "resync")
    assert to == ["b"] and resync["fragment"] == 0
    assert _events(out, "reject")[0]["target"] == "b"
    assert not h.core.rounds.get(0) or not h.core.rounds[0].contributions
    h.tick(100.0)
    assert all(torch.equal(a, b) for a, b in zip(h.core.model.theta, before))
    assert h.core.versions() == [0, 0] and h.core.counters["pushes"] == 0


def test_malformed_pushes() -> None:
    h = Harness(_settings(quorum=1))
    h.join_all()
    # wrong number of values for the fragment: a codec rejection, with a resync
    out = h.push("a", 0, torch.zeros(h.plan.numel(0) + 1), now=10.0)
    assert h.core.rejected["codec"] == 1 and _sent(out, "resync")
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


# -- bit-exact publishing ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["int4", "int8", "bf16", "none"])
def test_published_theta_is_previous_plus_decoded_blob_bit_exact(mode: str) -> None:
    h = Harness(_settings(quorum=1, compression=mode), manifest=_manifest("gpt-tiny"))
    h.join_all()
    replica = Replica(h.plan.sizes())               # a learner following the updates
    replica.epoch = 1
    for p in range(2):
        replica.latest[p], replica.versions[p] = h.core.model.theta[p].clone(), 0
    now = 10.0
    for r in range(12):
        p = r % 2
        before = h.core.model.theta[p].clone()
        h.push("a", p, h.delta(p, r, scale=1e-2), now=now)
        h.beat_all(now + 4.0)                          # connected learners receive the update
        out = h.tick(now + 5.0)
        now += 10.0
        (to, update), = _sent(out, "update")
        blob = _wire(update).payloads[0]
        assert torch.equal(h.core.model.theta[p], before + codec.decode(blob, expect_numel=h.plan.numel(p)))
        assert update["crc"] == h.core.model.crc(p) == h.core.crcs()[p]
        assert replica.on_update(p, update["from_version"], update["version"], blob, update["crc"]) == "applied"
        assert torch.equal(replica.latest[p], h.core.model.theta[p])
    assert h.core.versions() == [6, 6]
    if mode != "none":
        assert any(float(r.abs().max()) > 0 for r in h.core.model.residual)  # error feedback in use


# -- quorum events ---------------------------------------------------------------------------------


def test_quorum_lost_and_regained_events() -> None:
    h = Harness(_settings(quorum=2, liveness_s=3.0))
    h.join_all(now=1.0)
    assert not h.tick(1.0).events                                 # first observation: no event
    h.beat("a", 3.0)
    out = h.tick(4.5)                                             # b, c silent for 3.5 s > liveness
    (ev,) = _events(out, "quorum_lost")
    assert "1 live" in ev["detail"]
    assert not _events(h.tick(4.6), "quorum_lost")                # reported once
    snap = status.snapshot(h.core, 4.6)
    assert snap["quorum"]["below_quorum"] is True and snap["quorum"]["live"] == 1
    h.beat("b", 5.0)
    (ev,) = _events(h.tick(5.0), "quorum_regained")
    assert "2 live" in ev["detail"]


def test_round_stays_open_below_quorum() -> None:
    h = Harness(_settings(quorum=2))
    h.join_all(now=1.0)
    h.push("a", 0, h.delta(0, 1), now=2.0)
    for now in (3.0, 10.0, 100.0):
        h.beat("a", now)
        assert not _sent(h.tick(now), "update")
    assert status.snapshot(h.core, 100.0)["quorum"]["open_rounds"] == 1


# -- bounded queue -----------------------------------------------------------------------------------


def test_max_queue_drops_the_oldest_contribution() -> None:
    h = Harness(_settings(quorum=3, fragments=4, H=8, max_queue=3))
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0)
    h.push("b", 1, h.delta(1, 2), now=11.0)
    h.push("a", 2, h.delta(2, 3), now=12.0)
    out = h.push("b", 3, h.delta(3, 4), now=13.0)
    assert h.core.counters["dropped_pushes"] == 1
    (ev,) = _events(out, "drop")
    assert ev["target"] == "a" and "fragment 0" in ev["detail"]
    assert not h.core.rounds[0].contributions
    assert h.core.rounds[0].first_at is None and h.core.rounds[0].quorum_at is None
    assert sum(len(r.contributions) for r in h.core.rounds.values()) == 3
    assert status.snapshot(h.core, 13.0)["syncer"]["dropped_pushes"] == 1


def test_dropping_below_quorum_resets_the_quorum_time() -> None:
    h = Harness(_settings(quorum=2, max_queue=2))
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0)
    h.push("b", 0, h.delta(0, 2), now=10.5)
    assert h.core.rounds[0].quorum_at == 10.5
    h.push("c", 1, h.delta(1, 3), now=11.0)    # 3 > 2: a's push on fragment 0 is dropped
    assert list(h.core.rounds[0].contributions) == ["b"]
    assert h.core.rounds[0].quorum_at is None
    assert not _sent(h.tick(50.0), "update")


# -- status snapshot ---------------------------------------------------------------------------------

# ARCHITECTURE.md's `dldctl status --json` schema, minus what only the operator adds
# (syncer.address, learners[].restarts, events)
SCHEMA = {
    "run": str, "uptime_s": float, "goodput": float,
    "syncer": {"alive": bool, "fragments": int, "outer_steps": int, "checkpoint_outer_step": int},
    "quorum": {"min": int, "live": int, "total": int, "last_round_contributors": int},
    "tokens": {"trained": int, "merged": int, "per_s": float},
    "bytes": {"up": int, "down": int, "ddp_equivalent": int},
    "loss": {"train": (float, type(None)), "eval": (float, type(None))},
}
LEARNER_ROW = {"id": str, "host": str, "state": str, "pid": (int, type(None)), "step": int, "tokens": int,
               "tokens_per_s": float, "weight": float, "heartbeat_age_s": (float, type(None))}


def _check_schema(value: dict, schema: dict, where: str = "") -> None:
    for key, kind in schema.items():
        assert key in value, f"missing {where}{key}"
        if isinstance(kind, dict):
            _check_schema(value[key], kind, f"{where}{key}.")
        else:
            ok = isinstance(value[key], kind) and not (kind in (int, float) and isinstance(value[key], bool))
            if kind is float:
                ok = isinstance(value[key], (int, float)) and not isinstance(value[key], bool)
            assert ok, f"{where}{key} = {value[key]!r}"


def test_status_snapshot_schema() -> None:
    h = Harness(_settings(quorum=2))
    snap = status.snapshot(h.core, 0.5)  # before anything happened
    _check_schema(snap, SCHEMA)
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0)
    h.push("b", 0, h.delta(0, 2), now=10.0)
    h.tick(12.0)
    snap = status.snapshot(h.core, 12.0)
    _check_schema(snap, SCHEMA)
    json.dumps(snap, allow_nan=False)
    assert snap["run"] == RUN and snap["syncer"]["outer_steps"] == 1 and snap["syncer"]["initialized"] is True
    assert snap["quorum"]["last_round_contributors"] == 2 and snap["quorum"]["total"] == 3
    assert snap["syncer"]["versions"] == [1, 0]
    assert len(snap["learners"]) == 3
    for row in snap["learners"]:
        _check_schema(row, LEARNER_ROW)
    assert [r["id"] for r in snap["learners"]] == ["a", "b", "c"]
    assert snap["bytes"]["compression_ratio"] > 5   # int4 pushes
    assert 0.0 <= snap["goodput"] <= 1.0


def test_status_ddp_equivalent_bytes() -> None:
    # ring all-reduce: 2 (N-1)/N x 4 bytes x params per step, both ways
    assert status.ddp_equivalent_bytes(10, 1000, 4) == int(10 * 2 * 2 * 3 / 4 * 4 * 1000)
    assert status.ddp_equivalent_bytes(10, 1000, 1) == 0
    assert status.ddp_equivalent_bytes(10, 0, 4) == 0


# -- checkpoints ----------------------------------------------------------------------------------


def _run_rounds(h: Harness, n: int, start: float = 10.0) -> float:
    now = start
    for r in range(n):
        p = r % h.s.fragments
        h.push("a", p, h.delta(p, 100 + r), now=now)
        h.push("b", p, h.delta(p, 200 + r), now=now)
        h.push("c", p, h.delta(p, 300 + r), now=now)
        h.tick(now)
        now += 1.0
    return now


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    h = Harness(_settings(quorum=2))
    h.join_all()
    _run_rounds(h, 5)
    h.core.bytes_up, h.core.bytes_down = 1234, 5678
    path = checkpoint.save(tmp_path, checkpoint.state_dict(h.core, wall=100.0))
    assert path.name.startswith("ckpt-0001-000000005-") and not list(tmp_path.glob(".*.tmp"))
    state, problems = checkpoint.load_latest(tmp_path)
    assert problems == [] and state is not None
    fresh = SyncerCore(h.s, RUN, ["a", "b", "c"], now=110.0, epoch=2)
    checkpoint.restore(fresh, state, now=110.0)
    for name in ("theta", "momentum", "residual"):
        for x, y in zip(getattr(fresh.model, name), getattr(h.core.model, name)):
            assert torch.equal(x, y), name
    assert fresh.model.versions == h.core.model.versions == [3, 2]
    assert fresh.model.manifest == h.core.model.manifest and fresh.model.plan == h.core.model.plan
    assert fresh.outer_steps == fresh.checkpoint_outer_step == 5
    assert (fresh.bytes_up, fresh.bytes_down) == (1234, 5678)
    assert fresh.fleet.merged_tokens == pytest.approx(h.core.fleet.merged_tokens)
    # the 10 s the syncer was down still count as provisioned time for the 3 declared learners
    assert fresh.fleet.provisioned_s == pytest.approx(h.core.fleet.provisioned_s + 30.0)
    assert set(fresh.fleet.learners) == {"a", "b", "c"}
    # the restored core keeps merging from where the old one stopped
    h2 = Harness(h.s)
    h2.core = fresh
    h2.join_all(now=111.0)
    h2.push("a", 0, h.delta(0, 9), now=112.0)
    h2.push("b", 0, h.delta(0, 8), now=112.0)
    h2.push("c", 0, h.delta(0, 7), now=112.0)
    out = h2.tick(112.0)
    assert _sent(out, "update")[0][1]["version"] == 4


def test_checkpoint_restore_refuses_other_runs_and_layouts(tmp_path: Path) -> None:
    h = Harness(_settings())
    h.join_all()
    state = checkpoint.state_dict(h.core, wall=1.0)
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.restore(SyncerCore(h.s, "other", [], now=0.0), state, now=1.0)
    other = dataclasses.replace(h.s, fragments=4)
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.restore(SyncerCore(other, RUN, [], now=0.0), state, now=1.0)
    bad = dict(state, theta=[t[:-1] for t in state["theta"]])
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.restore(SyncerCore(h.s, RUN, [], now=0.0), bad, now=1.0)


def _two_checkpoints(tmp_path: Path) -> tuple[Harness, Path, Path]:
    h = Harness(_settings(quorum=2))
    h.join_all()
    now = _run_rounds(h, 2)
    older = checkpoint.save(tmp_path, checkpoint.state_dict(h.core, wall=1.0))
    _run_rounds(h, 2, start=now)
    newer = checkpoint.save(tmp_path, checkpoint.state_dict(h.core, wall=2.0))
    assert checkpoint.list_checkpoints(tmp_path) == [newer, older]
    return h, older, newer


@pytest.mark.parametrize("damage", ["flip_body", "flip_magic", "flip_digest", "truncate", "truncate_head", "empty"])
def test_corrupted_newest_checkpoint_is_skipped(tmp_path: Path, damage: str) -> None:
    h, older, newer = _two_checkpoints(tmp_path)
    data = bytearray(newer.read_bytes())
    if damage == "flip_body":
        data[len(data) // 2] ^= 0xFF
    elif damage == "flip_magic":
        data[0] ^= 0x01
    elif damage == "flip_digest":
        data[len(checkpoint.MAGIC) + 3] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "truncate_head":
        data = data[:20]
    else:
        data = bytearray()
    newer.write_bytes(bytes(data))
    state, problems = checkpoint.load_latest(tmp_path)
    assert state is not None and state["outer_steps"] == 2
    assert len(problems) == 1 and newer.name in problems[0]
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.read(newer)


def test_no_valid_checkpoint(tmp_path: Path) -> None:
    assert checkpoint.load_latest(tmp_path / "missing") == (None, [])
    h, older, newer = _two_checkpoints(tmp_path)
    for path in (older, newer):
        path.write_bytes(path.read_bytes()[:-1])
    state, problems = checkpoint.load_latest(tmp_path)
    assert state is None and len(problems) == 2


def test_checkpoint_keeps_only_the_newest(tmp_path: Path) -> None:
    h = Harness(_settings(quorum=2))
    h.join_all()
    now = 10.0
    saved = []
    for _ in range(5):
        now = _run_rounds(h, 1, start=now)
        saved.append(checkpoint.save(tmp_path, checkpoint.state_dict(h.core, wall=now), keep=3))
    assert checkpoint.list_checkpoints(tmp_path) == saved[::-1][:3]


def test_export_model(tmp_path: Path) -> None:
    h = Harness(_settings(quorum=2))
    h.join_all()
    _run_rounds(h, 2)
    target = tmp_path / "model.pt"
    checkpoint.export_model(h.core, target)
    exported = torch.load(target, weights_only=True)
    tensors = exported["state_dict"]
    assert [(k, tuple(v.shape)) for k, v in tensors.items()] == [(s.name, s.shape) for s in h.manifest]
    for p in range(h.plan.count):
        assert torch.equal(h.plan.gather(p, tensors), h.core.model.theta[p])
    assert exported["versions"] == h.core.versions()


def test_duplicated_init_chunk_does_not_complete_the_fragment_early() -> None:
    h = Harness(_settings(), manifest=_manifest("gpt-tiny"))
    h.hello("a", 1.0)
    chunk = h.core.chunk_numel()
    values = h.init_values[0]
    first = Message("init", {"fragment": 0, "offset": 0, "numel": chunk, "total": values.numel()},
                    [values[:chunk].numpy().tobytes()])
    for _ in range(-(-values.numel() // chunk)):   # the first chunk, as many times as there are chunks
        h.send("a", first, 1.0)
    for p in range(1, h.plan.count):               # every other fragment properly
        for off in range(0, h.init_values[p].numel(), chunk):
            part = h.init_values[p][off : off + chunk]
            h.send("a", Message("init", {"fragment": p, "offset": off, "numel": part.numel(),
                                         "total": h.init_values[p].numel()}, [part.numpy().tobytes()]), 1.0)
    assert h.core.model is None  # fragment 0 still has holes


def test_a_transfer_keeps_its_version_while_a_merge_lands() -> None:
    """Chunks asked for version v are served from v even after v+1 was published (one back),
    as long as a transfer of that fragment is under way."""
    h = Harness(_settings(quorum=1))
    h.join_all()
    old = h.core.model.theta[0].clone()
    old_crc = h.core.model.crc(0)

    def chunk(version: int, now: float) -> Message:
        (_, state), = h.send("b", Message("state_req", {"fragment": 0, "offset": 0, "version": version}), now).sends
        return state

    assert chunk(-1, 2.0)["version"] == 0               # a transfer starts on version 0
    h.beat_all(2.0)
    h.push("a", 0, h.delta(0, 1), now=2.0)
    h.tick(2.0 + h.core.rounds[0].grace_s + 1.0)
    assert h.core.model.versions[0] == 1
    pinned, latest = chunk(0, 4.0), chunk(-1, 4.0)
    assert pinned["version"] == 0 and pinned["crc"] == old_crc
    assert pinned.payloads[0] == old[: pinned["numel"]].numpy().tobytes()
    assert latest["version"] == 1 and latest["crc"] == h.core.model.crc(0)
