"""The round step (syncer/fused.py, in torch and with the native C kernel) against the
whole-fragment reference arithmetic: Gram matrices, merge coefficients, the merged gradient, the
Nesterov step, and the published blob; the published values must be bit-identical to what a
learner decodes, across slice and segment boundaries, mixed codecs and block sizes; the core must
fall back to the reference path when a Gram entry overflows fp32.
"""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
import zstandard

from syncer import fused, merge, native
from syncer.wire import codec, quant
from tests.unit.coreharness import Harness, make_settings, sent_of

SEGMENTS = [(0, 700, "embedding"), (700, 300, "dense"), (1000, 5, "dense"), (1005, 1500, "dense"), (2505, 95, "dense")]
NUMEL = 2600


def _contribs(modes: list[str], blocks: list[int], seed: int = 0) -> tuple[list[quant.Quantized], list[torch.Tensor]]:
    """Contributions as the syncer holds them (decoded blobs) and their fp32 values."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(NUMEL, generator=g) * 1e-3
    qs, values = [], []
    for mode, block in zip(modes, blocks):
        q = codec.decode_quantized(codec.encode(shared + torch.randn(NUMEL, generator=g) * 1e-3, mode, block))
        qs.append(q)
        values.append(quant.dequantize(q).contiguous())
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


# long segments (more than 32 whole blocks, the vector path's float lane sums move into double
# every 32), segments inside one block, on a block boundary, and a last block that is not whole
LONG = [(0, 9000, "dense"), (9000, 3, "dense"), (9003, 125, "dense"), (9128, 128, "dense"), (9256, 7000, "dense")]


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_native_gram_of_long_segments_and_every_fleet_size(mode: str, count: int) -> None:
    k = native.load()
    assert k is not None, native.problem
    numel = LONG[-1][0] + LONG[-1][1]
    g = torch.Generator().manual_seed(count)
    shared = torch.randn(numel, generator=g) * 1e-3
    qs = [
        codec.decode_quantized(codec.encode(shared + torch.randn(numel, generator=g) * 1e-3, mode, 128), kernel=k)
        for _ in range(count)
    ]
    values = [quant.dequantize(q) for q in qs]
    grams = fused.gram(qs, LONG, 128, k)
    assert grams is not None
    for s, (o, n, _) in enumerate(LONG):
        v = torch.stack([x[o : o + n] for x in values]).double()
        want = v @ v.t()
        scale = torch.sqrt(torch.outer(want.diagonal(), want.diagonal()))  # |v_m| |v_n|
        assert bool(((grams[s] - want).abs() <= 1e-6 * scale + 1e-15).all()), (s, grams[s], want)
        assert torch.equal(grams[s], grams[s].t())


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
    q, applied = quant.quantize_roundtrip(change, mode, 128)
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
    assert not fused.native_fits(mixed, 128)  # an fp32 contribution (compression = "none")


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
def test_native_int4_decode_keeps_the_codes_packed_and_refuses_nibble_minus_8(numel: int) -> None:
    k = native.load()
    assert k is not None, native.problem
    x = torch.randn(numel) * torch.logspace(-3, 1, numel)
    blob = codec.encode(x, "int4", 64)
    mine, theirs = codec.decode_quantized(blob, kernel=k), codec.decode_quantized(blob)
    assert mine.packed and mine.codes.numel() == theirs.codes.numel() // 2  # half a byte a value, as on the wire
    assert torch.equal(mine.int_codes(), theirs.codes) and torch.equal(mine.scales, theirs.scales)
    assert torch.equal(quant.dequantize(mine), quant.dequantize(theirs))
    nblocks = -(-numel // 64)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(blob[codec.HEADER_SIZE :]))
    for byte in (0x80, 0x18):  # -8 in the high, then in the low nibble
        bad = raw.copy()
        bad[4 * nblocks + len(bad[4 * nblocks :]) // 2] = byte
        blob_bad = blob[: codec.HEADER_SIZE] + zstandard.ZstdCompressor().compress(bytes(bad))
        with pytest.raises(codec.CodecError, match="nibble"):
            codec.decode_quantized(blob_bad, kernel=k)


@pytest.mark.parametrize("nbytes", [0, 1, 15, 63, 64, 65, 127, 128, 200, 4096, 100_003])
def test_native_crc32_is_zlibs(nbytes: int) -> None:
    k = native.load()
    assert k is not None, native.problem
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert k.crc32(data) == zlib.crc32(data.numpy().tobytes())
    values = torch.randn(nbytes // 4 + 1)  # a fragment: fp32 values, as publish checksums them
    assert k.crc32(values) == zlib.crc32(values.numpy().tobytes())


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_native_check_refuses_what_the_torch_decoder_refuses(mode: str) -> None:
    k = native.load()
    assert k is not None, native.problem
    blob = codec.encode(torch.randn(1000), mode, 128)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(blob[codec.HEADER_SIZE :]))
    for bad_scale in (-1.0, float("nan"), float("inf"), 3.0e38):  # 3e38 * qmax overflows fp32
        bad = raw.copy()
        bad[4:8] = struct.pack("<f", bad_scale)
        blob_bad = blob[: codec.HEADER_SIZE] + zstandard.ZstdCompressor().compress(bytes(bad))
        for kernel in (k, None):
            with pytest.raises(codec.CodecError, match="non-finite or negative"):
                codec.decode_quantized(blob_bad, kernel=kernel)
    assert torch.equal(codec.decode(blob), quant.dequantize(codec.decode_quantized(blob, kernel=k)))


def test_the_torch_round_step_reads_packed_int4_codes_like_unpacked_ones() -> None:
    """A round the kernel does not take (here: a summed, fp32 contribution among them) may hold
    int4 contributions the kernel decoded (still packed): the torch step unpacks them per slice."""
    k = native.load()
    assert k is not None, native.problem
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(NUMEL, generator=g) * 1e-3 for _ in range(3)]
    blobs = [codec.encode(x, "int4", 128) for x in xs]
    fp32 = codec.decode_quantized(codec.encode(xs[0] * 0.5, "none", 128))
    packed = [codec.decode_quantized(b, kernel=k) for b in blobs] + [fp32]
    plain = [codec.decode_quantized(b) for b in blobs] + [fp32]
    assert packed[0].packed and not plain[0].packed and not fused.native_fits(packed, 128)
    results = []
    for qs in (packed, plain):
        grams = fused.gram(qs, SEGMENTS, 128, k)
        assert grams is not None
        coefs = merge.coefficients(grams, [1.0, 2.0, 1.0, 0.5], [kind for _, _, kind in SEGMENTS])
        state = [torch.full((NUMEL,), 0.1), torch.zeros(NUMEL), torch.zeros(NUMEL)]
        blob, crc = fused.publish(qs, coefs, SEGMENTS, *state, 0.7, 0.9, "int4", 128, k)
        results.append((grams, blob, crc, state[0]))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1:3] == results[1][1:3]
    assert torch.equal(results[0][3], results[1][3])


@pytest.mark.parametrize("count", [17, 40])
def test_the_native_kernel_takes_more_than_16_pushes(count: int) -> None:
    k = native.load()
    assert k is not None, native.problem
    qs, values = _contribs(["int4", "int8"] * (count // 2) + ["int4"] * (count % 2), [128] * count, seed=count)
    qs = [codec.decode_quantized(codec.encode_quantized(q), kernel=k) for q in qs]  # int4 packed, as pushed
    assert fused.native_fits(qs, 128, "int4")
    grams = fused.gram(qs, SEGMENTS, 128, k)
    assert grams is not None
    for g, (o, n, _) in zip(grams, SEGMENTS):
        v = torch.stack([x[o : o + n] for x in values]).double()
        torch.testing.assert_close(g, v @ v.t(), rtol=1e-5, atol=1e-12)
    coefs = merge.coefficients(grams, [1.0] * count, [kind for _, _, kind in SEGMENTS])
    theta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    old = theta.clone()
    blob, _ = fused.publish(
        qs, coefs, SEGMENTS, theta, torch.zeros(NUMEL), torch.zeros(NUMEL), 0.7, 0.0, "int4", 128, k
    )
    assert torch.equal((old + codec.decode(blob)).view(torch.int32), theta.view(torch.int32))
    merged = merge.merge([v.clone() for v in values], [1.0] * count, SEGMENTS, "rda")
    step = float(codec.decode_quantized(blob).scales.max())
    torch.testing.assert_close(theta, old - 0.7 * merged, rtol=0, atol=step * 1.01)  # momentum 0: a plain step
