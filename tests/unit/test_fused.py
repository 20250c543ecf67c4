"""The round step (syncer/fused.py, in torch and with the native C kernel) against the
whole-fragment reference arithmetic: Gram matrices, merge coefficients, the merged gradient, the
Nesterov step, and the published blob; the published values must be bit-identical to what a
learner decodes, across slice and segment boundaries, mixed codecs and block sizes; the core must
fall back to the reference path when a Gram entry overflows fp32.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import zstandard

from syncer import fused, merge, native
from syncer.wire import codec
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
    monkeypatch.setattr(fused, "SLICE", 512)  # many slices, segments straddling them


@pytest.fixture(params=["torch", "native"])
def kernel(request: pytest.FixtureRequest) -> native.Kernel | None:
    if request.param == "torch":
        return None
    k = native.load()
    assert k is not None, f"the native kernel did not build: {native.problem}"
    return k


@pytest.mark.parametrize(
    ("modes", "blocks"),
    [(["int4"] * 4, [128] * 4), (["int4", "int8", "none", "bf16"], [128, 64, 128, 128]), (["int4"], [128])],
)
def test_gram_holds_every_pairwise_dot_product_per_segment(
    modes: list[str], blocks: list[int], kernel: native.Kernel | None
) -> None:
    qs, values = _contribs(modes, blocks)
    grams = fused.gram(qs, SEGMENTS, 128, kernel)
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


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_publish_matches_the_reference_step_and_is_bit_exact_for_learners(
    mode: str, kernel: native.Kernel | None
) -> None:
    qs, values = _contribs([mode] * 4, [128] * 4)
    assert fused.native_fits(qs, 128, mode)
    g = torch.Generator().manual_seed(5)
    theta, momentum, residual = (torch.randn(NUMEL, generator=g) * s for s in (1.0, 1e-3, 1e-5))
    coefs = merge.coefficients(fused.gram(qs, SEGMENTS, 128, kernel), [1.0] * 4, [k for _, _, k in SEGMENTS])
    ref_theta, ref_mom, ref_res = theta.clone(), momentum.clone(), residual.clone()
    merged = merge.merge([v.clone() for v in values], [1.0] * 4, SEGMENTS, "rda")
    change = merge.nesterov_change_(ref_res, merged, ref_mom, 0.7, 0.9)
    q, applied = codec.quantize_roundtrip(change, mode, 128)
    ref_blob = codec.encode_quantized(q)
    ref_theta.add_(applied)

    old = theta.clone()
    blob, crc = fused.publish(qs, coefs, SEGMENTS, theta, momentum, residual, 0.7, 0.9, mode, 128, kernel)
    assert codec.blob_info(blob) == (mode, NUMEL)
    # the learner's side: old + decode(blob), a separate fp32 add, gives the syncer's theta bit for bit
    assert torch.equal((old + codec.decode(blob)).view(torch.int32), theta.view(torch.int32))
    assert crc == zlib.crc32(memoryview(theta.numpy()))
    torch.testing.assert_close(momentum, ref_mom, rtol=1e-4, atol=1e-9)
    step = float(codec.decode_quantized(ref_blob).scales.max())  # one quantization step at most
    torch.testing.assert_close(theta, ref_theta, rtol=0, atol=step * 1.01)
    # the error feedback keeps what the blob did not carry: residual == change - applied
    torch.testing.assert_close(residual + codec.decode(blob), change, rtol=1e-4, atol=1e-9)


def test_the_native_kernel_takes_only_what_it_handles() -> None:
    qs, _ = _contribs(["int4", "int8"], [128, 128])
    assert fused.native_fits(qs, 128, "int4") and fused.native_fits(qs, 128, "int8")
    assert not fused.native_fits(qs, 64)  # another block than the output's
    assert not fused.native_fits(qs, 128, "bf16")  # an output the kernel does not pack
    mixed, _ = _contribs(["int4", "none"], [128, 128])
    assert not fused.native_fits(mixed, 128)  # an fp32 contribution (a summed pair)


def test_without_a_compiler_the_kernel_is_none_and_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(native, "_cache", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert native.load() is None and "no-such-cc" in native.problem
    monkeypatch.setattr(native, "_cache", {})
    monkeypatch.setenv("DLDCTL_NATIVE", "0")
    assert native.load() is None and "DLDCTL_NATIVE=0" in native.problem


def test_slices_align_to_every_block_size() -> None:
    qs, _ = _contribs(["int4", "int8"], [96, 64])
    size = fused.slice_size(qs, 128, 100_000)
    assert size % 96 == 0 and size % 64 == 0 and size % 128 == 0
    assert fused.slice_size(qs, 128, 10) == 384  # a small fragment: one slice, whole blocks


def test_a_gram_that_overflows_fp32_takes_the_reference_path() -> None:
    h = Harness(make_settings(compression="none", quorum=2))
    h.join_all()
    theta0 = h.core.model.theta[0].clone()
    big = torch.full_like(theta0, 1e30)  # finite, but its square is not
    h.push("a", 0, big, now=10.0)
    h.push("b", 0, big * 0.5, now=10.0)
    h.push("c", 0, big * 0.25, now=10.0)
    assert fused.gram([c.delta for c in h.core.rounds[0].contributions.values()], h.plan.segments(0), 128) is None
    out = h.tick(10.1)
    assert sent_of(out, "update")  # merged anyway
    assert torch.isfinite(h.core.model.theta[0]).all() and not torch.equal(h.core.model.theta[0], theta0)


@pytest.mark.parametrize("numel", [1, 63, 128, 1000, 4097])
def test_native_int4_unpack_equals_the_torch_one_and_refuses_nibble_minus_8(numel: int) -> None:
    k = native.load()
    assert k is not None, native.problem
    x = torch.randn(numel) * torch.logspace(-3, 1, numel)
    blob = codec.encode(x, "int4", 64)
    mine, theirs = codec.decode_quantized(blob, kernel=k), codec.decode_quantized(blob)
    assert torch.equal(mine.codes, theirs.codes) and torch.equal(mine.scales, theirs.scales)
    nblocks = -(-numel // 64)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(blob[codec.HEADER_SIZE :]))
    for byte in (0x80, 0x18):  # -8 in the high, then in the low nibble
        bad = raw.copy()
        bad[4 * nblocks + len(bad[4 * nblocks :]) // 2] = byte
        blob_bad = blob[: codec.HEADER_SIZE] + zstandard.ZstdCompressor().compress(bytes(bad))
        with pytest.raises(codec.CodecError, match="nibble"):
            codec.decode_quantized(blob_bad, kernel=k)
