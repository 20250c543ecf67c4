"""The cache-blocked round step (syncer/fused.py) against the whole-fragment reference arithmetic:
Gram matrices, merge coefficients, the merged gradient, the Nesterov step, and the published
blob; the published values must be bit-identical to what a learner decodes, across slice
boundaries, mixed codecs and block sizes, and the core must fall back to the reference path when
a Gram entry overflows fp32.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from syncer import codec, fused, merge
from tests.unit.coreharness import Harness, make_settings, sent_of

SEGMENTS = [(0, 700, "embedding"), (700, 300, "dense"), (1000, 5, "dense"), (1005, 1500, "dense"), (2505, 95, "dense")]
NUMEL = 2600


def _contribs(modes: list[str], blocks: list[int], seed: int = 0) -> tuple[list[codec.Quantized], list[torch.Tensor]]:
    """Contributions as the syncer holds them (decoded blobs) and their fp32 values."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(NUMEL, generator=g) * 1e-3
    qs, values = [], []
    for mode, block in zip(modes, blocks):
        q = codec.decode_quantized(codec.encode(shared + torch.randn(NUMEL, generator=g) * 1e-3, mode, block))
        qs.append(q)
        values.append(codec.dequantize(q).contiguous())
    return qs, values


@pytest.fixture(autouse=True)
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "SLICE", 512)   # many slices, segments straddling them


@pytest.mark.parametrize(("modes", "blocks"), [
    (["int4"] * 4, [128] * 4), (["int4", "int8", "none", "bf16"], [128, 64, 128, 128]), (["int4"], [128])])
def test_gram_holds_every_pairwise_dot_product_per_segment(modes: list[str], blocks: list[int]) -> None:
    qs, values = _contribs(modes, blocks)
    grams = fused.gram(qs, SEGMENTS, 128)
    assert grams is not None and len(grams) == len(SEGMENTS)
    for g, (o, n, _) in zip(grams, SEGMENTS):
        v = torch.stack([x[o : o + n] for x in values]).double()
        torch.testing.assert_close(g, v @ v.t(), rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_coefficients_reproduce_the_reference_merge(rule: str) -> None:
    qs, values = _contribs(["int4", "int4", "int8"], [128, 128, 128])
    weights, factors = [3.0, 1.0, 2.0], [1.0, 0.5, 1.0]
    grams = fused.gram(qs, SEGMENTS, 128)
    coefs = merge.coefficients(grams, weights, [k for _, _, k in SEGMENTS], rule, factors=factors, scale=0.8)
    reference = merge.merge([v.clone() for v in values], weights, SEGMENTS, rule, factors=factors, scale=0.8)
    for s, (o, n, _) in enumerate(SEGMENTS):
        mine = sum(float(coefs[s, m]) * values[m][o : o + n] for m in range(len(values)))
        torch.testing.assert_close(mine, reference[o : o + n], rtol=1e-4, atol=1e-9)


def test_publish_matches_the_reference_step_and_is_bit_exact_for_learners() -> None:
    qs, values = _contribs(["int4"] * 4, [128] * 4)
    g = torch.Generator().manual_seed(5)
    theta, momentum, residual = (torch.randn(NUMEL, generator=g) * s for s in (1.0, 1e-3, 1e-5))
    coefs = merge.coefficients(fused.gram(qs, SEGMENTS, 128), [1.0] * 4, [k for _, _, k in SEGMENTS])
    ref_theta, ref_mom, ref_res = theta.clone(), momentum.clone(), residual.clone()
    merged = merge.merge([v.clone() for v in values], [1.0] * 4, SEGMENTS, "rda")
    change = merge.nesterov_change_(ref_res, merged, ref_mom, 0.7, 0.9)
    q, applied = codec.quantize_roundtrip(change, "int4", 128)
    ref_blob = codec.encode_quantized(q)
    ref_theta.add_(applied)

    old = theta.clone()
    blob, crc = fused.publish(qs, coefs, SEGMENTS, theta, momentum, residual, 0.7, 0.9, "int4", 128)
    # the learner's side: old + decode(blob), a separate fp32 add, gives the syncer's theta bit for bit
    assert torch.equal((old + codec.decode(blob)).view(torch.int32), theta.view(torch.int32))
    assert crc == zlib.crc32(memoryview(theta.numpy()))
    torch.testing.assert_close(momentum, ref_mom, rtol=1e-4, atol=1e-9)
    step = float(codec.decode_quantized(ref_blob).scales.max())   # one quantization step at most
    torch.testing.assert_close(theta, ref_theta, rtol=0, atol=step * 1.01)
    # the error feedback keeps what the blob did not carry: residual == change - applied
    torch.testing.assert_close(residual + codec.decode(blob), change, rtol=1e-4, atol=1e-9)


def test_slices_align_to_every_block_size() -> None:
    qs, _ = _contribs(["int4", "int8"], [96, 64])
    size = fused.slice_size(qs, 128, 100_000)
    assert size % 96 == 0 and size % 64 == 0 and size % 128 == 0
    assert fused.slice_size(qs, 128, 10) == 384     # a small fragment: one slice, whole blocks


def test_a_gram_that_overflows_fp32_takes_the_reference_path() -> None:
    h = Harness(make_settings(compression="none", quorum=2))
    h.join_all()
    theta0 = h.core.model.theta[0].clone()
    big = torch.full_like(theta0, 1e30)             # finite, but its square is not
    h.push("a", 0, big, now=10.0)
    h.push("b", 0, big * 0.5, now=10.0)
    h.push("c", 0, big * 0.25, now=10.0)
    assert fused.gram([c.delta for c in h.core.rounds[0].contributions.values()], h.plan.segments(0), 128) is None
    out = h.tick(10.1)
    assert sent_of(out, "update")                  # merged anyway
    assert torch.isfinite(h.core.model.theta[0]).all() and not torch.equal(h.core.model.theta[0], theta0)
