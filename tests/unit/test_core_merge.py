"""The merge and outer step of a closing round (syncer/outerstep.py), driven through the syncer
core directly (no sockets, fake clock): token weights, the merge, Nesterov step and publish
against the pure functions, fleet scaling of a partial round, robust clipping of a huge
contribution, and bit-exact publishing with the checksums a replica checks.
Joining, rounds and rejected pushes: test_core.py.
"""

from __future__ import annotations

import pytest
import torch

from learner.replica import Replica
from syncer import fused, merge, native
from syncer.rounds import Contribution
from syncer.wire import codec, quant, thin
from tests.unit.coreharness import (
    Harness,
    events_of,
    make_settings,
    rounds_of,
    sent_of,
    tensor_manifest,
    wire,
)

# -- weights and the merge -----------------------------------------------------------------------


def test_round_weights_follow_tokens_squared_over_steps() -> None:
    h = Harness(make_settings(quorum=3))
    h.join_all()
    h.push("a", 1, h.delta(1, 1), now=10.0, c_steps=10, c_tokens=100)  # 1000
    h.push("b", 1, h.delta(1, 2), now=10.0, c_steps=10, c_tokens=200)  # 4000
    h.push("c", 1, h.delta(1, 3), now=10.0, c_steps=5, c_tokens=100)  # 2000
    (metric,) = rounds_of(h.tick(10.0))
    assert metric["weights"] == {"a": round(1000 / 7000, 4), "b": round(4000 / 7000, 4), "c": round(2000 / 7000, 4)}
    rows = {r["id"]: r for r in h.core.fleet.rows(10.0)}
    assert rows["b"]["weight"] == pytest.approx(4 / 7)


def test_merge_outer_step_and_publish_match_the_pure_functions() -> None:
    s = make_settings(quorum=2)
    h = Harness(s)
    h.join_all()
    m = h.core.model
    theta0, mom0, res0 = m.theta[0].clone(), m.momentum[0].clone(), m.residual[0].clone()
    da, db = h.delta(0, 1), h.delta(0, 2)
    h.push("a", 0, da, now=10.0, c_steps=8, c_tokens=128)
    h.push("b", 0, db, now=10.0, c_steps=8, c_tokens=256)
    h.push("c", 0, h.delta(0, 3) * 0, now=10.0, c_steps=8, c_tokens=0)  # weight 0
    h.tick(10.0)
    deltas = [quant.roundtrip(d, "int4", s.block) for d in (da, db, torch.zeros_like(da))]
    weights = [merge.token_weight(128, 8), merge.token_weight(256, 8), 0.0]
    merged = merge.merge(deltas, weights, h.plan.segments(0), "rda")
    new, mom = merge.nesterov_step(theta0, merged, mom0, s.outer_lr, s.outer_momentum)
    torch.testing.assert_close(m.momentum[0], mom)
    change = new - theta0 + res0
    applied = quant.roundtrip(change, "int4", s.block)
    torch.testing.assert_close(m.theta[0], theta0 + applied, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(m.residual[0], change - applied, rtol=1e-4, atol=1e-9)
    # fragment 0 holds rows 0..7 of the embedding table: merged by the plain weighted mean
    off, n, _ = next(seg for seg in h.plan.segments(0) if seg[2] == "embedding")
    mean = merge.weighted_mean([d[off : off + n] for d in deltas], weights)
    torch.testing.assert_close(merged[off : off + n], mean)
    # the dense segments are RDA: not the mean (their deltas are independent noise)
    off, n, _ = next(seg for seg in h.plan.segments(0) if seg[2] == "dense")
    assert not torch.allclose(merged[off : off + n], merge.weighted_mean([d[off : off + n] for d in deltas], weights))


def test_fleet_scale_shrinks_a_partial_round() -> None:
    h = Harness(
        make_settings(
            quorum=2, fleet_scale=True, compression="none", merge="mean", outer_lr=1.0, outer_momentum=0.0, seq_len=1
        )
    )
    h.join_all()
    theta0 = h.core.model.theta[0].clone()
    d = h.delta(0, 1)
    h.beat_all(10.0)  # a, b and c live
    h.push("a", 0, d, now=10.0, c_steps=10, c_tokens=160)  # 16 tokens/step = the batch x seq_len guess
    h.push("b", 0, d, now=10.0, c_steps=10, c_tokens=160)
    h.tick(10.0 + h.core.rounds[0].grace_s)
    # period = 3 live learners * 16 tokens/step * H=8 = 384 tokens; this round has 320 -> 5/6
    torch.testing.assert_close(h.core.model.theta[0], theta0 - d * (320 / 384), rtol=0, atol=1e-7)


@pytest.mark.parametrize("clip", [10.0, 0.0])
def test_one_huge_finite_contribution_cannot_wreck_the_model(clip: float) -> None:
    """Robust clipping: a broken learner's (finite) outer gradient 10^4 x the others' is cut to
    `robust_clip` x the median norm; without clipping it dominates the merge."""
    h = Harness(
        make_settings(
            quorum=3,
            robust_clip=clip,
            judge_size=0.0,  # the clip alone (the judge would reject it: tests/unit/test_judge.py)
            compression="none",
            merge="mean",
            outer_lr=1.0,
            outer_momentum=0.0,
            fleet_scale=False,
        )
    )
    h.join_all()
    theta0 = h.core.model.theta[0].clone()
    h.beat_all(10.0)
    good = [h.delta(0, seed) for seed in (1, 2)]
    h.push("a", 0, good[0], now=10.0)
    h.push("b", 0, good[1], now=10.0)
    h.push("c", 0, h.delta(0, 3, scale=10.0), now=10.0)  # 10^4 x the others
    h.tick(10.0)
    change = (h.core.model.theta[0] - theta0).norm().item()
    typical = max(d.norm().item() for d in good)
    if clip:
        assert h.core.counters["clipped"] == 1
        assert change <= (2 + clip) / 3 * typical * 1.01  # (two good + one clipped to 10 x median) / 3
    else:
        assert h.core.counters["clipped"] == 0
        assert change > 1000 * typical


# -- bit-exact publishing ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["int4", "int8", "bf16", "none", "2bit", "topk"])
def test_published_theta_is_previous_plus_decoded_blob_bit_exact(mode: str) -> None:
    h = Harness(make_settings(quorum=1, compression=mode), manifest=tensor_manifest("gpt-tiny"))
    h.join_all()
    replica = Replica(h.plan.sizes())  # a learner following the updates
    replica.epoch = 1
    for p in range(2):
        replica.latest[p], replica.versions[p] = h.core.model.theta[p].clone(), 0
    now = 10.0
    for r in range(12):
        p = r % 2
        before = h.core.model.theta[p].clone()
        h.push("a", p, h.delta(p, r, scale=1e-2), now=now)
        h.beat_all(now + 4.0)  # connected learners receive the update
        out = h.tick(now + 5.0)
        now += 10.0
        ((_to, update),) = sent_of(out, "update")
        blob = wire(update).payloads[0]
        assert torch.equal(h.core.model.theta[p], before + codec.decode(blob, expect_numel=h.plan.numel(p)))
        assert update["crc"] == h.core.model.crc(p) == h.core.crcs()[p]
        assert replica.on_update(p, update["from_version"], update["version"], blob, update["crc"]) == "applied"
        assert torch.equal(replica.latest[p], h.core.model.theta[p])
    assert h.core.versions() == [6, 6]
    if mode != "none":
        assert any(float(r.abs().max()) > 0 for r in h.core.model.residual)  # error feedback in use


def test_a_topk_update_has_room_for_every_merged_push() -> None:
    """The union of the pushes' kept values: topk_keep per push merged (thin.topk_shape)."""
    h = Harness(make_settings(quorum=2, compression="topk", topk_keep=16), manifest=tensor_manifest("gpt-tiny"))
    h.join_all()
    h.push("a", 0, h.delta(0, 1, scale=1e-2), now=10.0)
    h.push("b", 0, h.delta(0, 2, scale=1e-2), now=10.0)
    h.beat_all(14.0)
    ((_to, update),) = sent_of(h.tick(15.0), "update")
    q = codec.decode_quantized(wire(update).payloads[0])
    assert q.mode == "topk" and thin.topk_shape(q.block) == (4096, 32)


@pytest.mark.parametrize("zstd", [True, False])
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_the_zstd_setting_holds_both_ways_and_either_kind_of_push_is_merged(zstd: bool, kernel: str) -> None:
    h = Harness(make_settings(quorum=2, zstd=zstd), manifest=tensor_manifest("gpt-tiny"))
    if kernel == "native":
        h.core.kernel = native.load()
        assert h.core.kernel is not None, native.problem
    h.join_all()
    replica = Replica(h.plan.sizes())
    replica.epoch = 1
    for p in range(2):
        replica.latest[p], replica.versions[p] = h.core.model.theta[p].clone(), 0
    now = 10.0
    for r in range(6):
        p = r % 2
        before = h.core.model.theta[p].clone()
        # one learner as the setting says, the other the other way: both decode (older learners' blobs too)
        h.push("a", p, h.delta(p, r, scale=1e-2), now=now)
        h.push("b", p, h.delta(p, r + 100), now=now, blob=codec.encode(h.delta(p, r + 100), "int4", 128, not zstd))
        h.beat_all(now + 4.0)
        out = h.tick(now + 5.0)
        now += 10.0
        ((_to, update),) = sent_of(out, "update")
        blob = wire(update).payloads[0]
        assert blob[2] == (codec.FORMAT if zstd else codec.FORMAT | codec.RAW)
        assert torch.equal(h.core.model.theta[p], before + codec.decode(blob, expect_numel=h.plan.numel(p)))
        assert replica.on_update(p, update["from_version"], update["version"], blob, update["crc"]) == "applied"
        assert torch.equal(replica.latest[p], h.core.model.theta[p])
    assert h.core.versions() == [3, 3] and not h.core.rejected


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_malformed_pushes_without_zstd_are_dropped_counted_and_resynced(kernel: str) -> None:
    h = Harness(make_settings(quorum=1, zstd=False))
    h.core.kernel = native.load() if kernel == "native" else None
    h.join_all()
    before = [t.clone() for t in h.core.model.theta]
    good = codec.encode(h.delta(0, 1), "int4", 128, zstd=False)
    nblocks = -(-h.plan.numel(0) // 128)
    nibble, nan = bytearray(good), bytearray(good)
    nibble[codec.HEADER_SIZE + 4 * nblocks] = 0x80  # code -8: never produced
    nan[codec.HEADER_SIZE : codec.HEADER_SIZE + 4] = b"\x00\x00\xc0\x7f"  # a NaN scale
    cases = ((good[:-1], "codec"), (good + b"\0", "codec"), (bytes(nibble), "codec"), (bytes(nan), "nan"))
    for count, (blob, reason) in enumerate(cases):
        out = h.push("a", 0, torch.zeros(1), now=10.0, blob=blob)
        assert sent_of(out, "resync") and events_of(out, "reject")
        assert sum(h.core.rejected.values()) == count + 1 and h.core.rejected[reason] >= 1
    assert h.core.rejected["codec"] == 3 and h.core.rejected["nan"] == 1 and h.core.counters["pushes"] == 0
    h.tick(100.0)
    assert all(torch.equal(a, b) for a, b in zip(h.core.model.theta, before))


def test_updates_carry_the_checksum_every_n_versions_and_a_replica_catches_a_drift_there() -> None:
    h = Harness(make_settings(quorum=1, checksum_every=3))
    h.join_all()
    replica = Replica(h.plan.sizes())
    replica.epoch = 1
    replica.latest[0], replica.versions[0] = h.core.model.theta[0].clone(), 0
    now, carried = 10.0, []
    for r in range(6):
        h.push("a", 0, h.delta(0, r, scale=1e-2), now=now)
        h.beat_all(now + 4.0)
        ((_, update),) = sent_of(h.tick(now + 5.0), "update")
        now += 10.0
        carried.append(update["crc"])
        if r == 3:  # the learner's copy drifts (a value off by 1e-3)
            replica.latest[0][0] += 1e-3
        result = replica.on_update(
            0, update["from_version"], update["version"], wire(update).payloads[0], update["crc"]
        )
        assert result == ("mismatch" if r == 5 else "applied"), r  # caught at the next checked version
        if update["crc"] is None:
            assert h.core.crcs()[0] is None  # status never pays for a checksum
    assert [c is not None for c in carried] == [False, False, True, False, False, True]
    assert carried[2] is not None and h.core.crcs()[0] == carried[5] == h.core.model.crc(0)
    h.core.serving.crcs[0] = None  # between checked versions, a state transfer computes it
    assert h.core.serving.crc(h.core.model, 0) == h.core.model.crc(0)


# -- a learner's several pushes, a backlog's carried rest: kept as they came ----------------------


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_a_learner_that_pushed_twice_is_merged_as_the_sum_of_its_pushes(kernel: str) -> None:
    s = make_settings(quorum=2)
    h = Harness(s)
    h.core.kernel = native.load() if kernel == "native" else None
    h.join_all()
    m = h.core.model
    theta0, mom0, res0 = m.theta[0].clone(), m.momentum[0].clone(), m.residual[0].clone()
    da1, da2, db = h.delta(0, 1), h.delta(0, 2), h.delta(0, 3)
    h.push("a", 0, da1, now=10.0, c_steps=8, c_tokens=128)
    h.push("a", 0, da2, now=10.0, c_steps=8, c_tokens=128)
    parts = h.core.rounds[0].contributions["a"].parts
    assert len(parts) == 2 and all(q.mode == "int4" for q in parts)  # no fp32 sum: the round stays native
    assert fused.native_fits(parts, s.block, s.compression)
    h.push("b", 0, db, now=10.0, c_steps=8, c_tokens=256)
    h.push("c", 0, h.delta(0, 4) * 0, now=10.0, c_steps=8, c_tokens=0)  # weight 0
    h.tick(10.0)
    rt = [quant.roundtrip(d, "int4", s.block) for d in (da1, da2, db)]
    deltas = [rt[0] + rt[1], rt[2], torch.zeros_like(db)]
    weights = [merge.token_weight(256, 16), merge.token_weight(256, 8), 0.0]
    merged = merge.merge(deltas, weights, h.plan.segments(0), "rda")
    new, mom = merge.nesterov_step(theta0, merged, mom0, s.outer_lr, s.outer_momentum)
    torch.testing.assert_close(m.momentum[0], mom, rtol=1e-4, atol=1e-8)
    change = new - theta0 + res0
    step = float(quant.quantize(change, "int4", s.block).scales.max())  # one quantization step at most
    torch.testing.assert_close(m.theta[0], theta0 + quant.roundtrip(change, "int4", s.block), rtol=0, atol=step)


def test_a_carried_rest_keeps_the_codes_and_scales_the_block_scales() -> None:
    k = native.load()
    assert k is not None, native.problem
    x1, x2 = torch.randn(1000) * 1e-3, torch.randn(1000) * 1e-3
    q1, q2 = (codec.decode_quantized(codec.encode(x, "int4", 128), kernel=k) for x in (x1, x2))
    c = Contribution("a", q1, 40, 640, 4.0, 0.1, 0, 0.0, 100, backlog=0.25)
    c.add(Contribution("a", q2, 40, 640, 4.0, 0.1, 0, 0.0, 100))
    rest = c.remainder(now=1.0)
    assert rest is not None and (rest.c_steps, rest.c_tokens) == (60, 960)
    assert [q.packed for q in rest.parts] == [True, True] and rest.parts[0].codes is q1.codes  # shared, never written
    torch.testing.assert_close(rest.values(), (quant.dequantize(q1) + quant.dequantize(q2)) * 0.75)
