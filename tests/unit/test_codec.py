"""Compression codec: error bounds per mode, bit-exact decode(encode(x)) == roundtrip(x), error
feedback, the syncer/learner bit-identity chain, and robustness against malformed blobs.

The syncer publishes `old + dequantize(quantize(change))` and every learner applies
`latest + decode(blob)`: both must give the same bits, or replicas drift apart silently.
"""

from __future__ import annotations

import struct

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from syncer.wire import codec, quant
from syncer.wire.codec import CodecError

MODES = ("none", "bf16", "int8", "int4")
QMAX = {"int8": 127, "int4": 7}
HS = struct.calcsize("<2sBBQIQ")
FAST = settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bound(x: torch.Tensor, mode: str, block: int) -> torch.Tensor:
    """Per-element error bound: exact / 2^-8 relative / half a quantization step per block.

    For int modes the step is scale = absmax/qmax, so |err| <= absmax/(2 qmax), i.e. absmax/14
    (int4) and absmax/254 (int8); a few fp32 ulps of the block's absmax are allowed on top.
    """
    if mode == "none":
        return torch.zeros_like(x)
    if mode == "bf16":
        return x.abs() * 2.0**-8
    n = x.numel()
    pad = (-n) % block
    absmax = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, block).amax(dim=1)
    per_block = absmax / (2 * QMAX[mode]) + absmax * 2.0**-20
    return per_block.repeat_interleave(block)[:n]


def _check_within(x: torch.Tensor, mode: str, block: int) -> torch.Tensor:
    y = quant.roundtrip(x, mode, block)
    assert y.dtype == torch.float32 and y.shape == (x.numel(),)
    err = (y - x).abs()
    assert bool((err <= _bound(x, mode, block)).all()), f"{mode}: max excess {(err - _bound(x, mode, block)).max()}"
    return y


# -- error bounds ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [1, 7, 127, 128, 129, 1000, 4097])
def test_roundtrip_error_bound(mode: str, n: int) -> None:
    x = torch.randn(n, generator=_gen(n)) * 3.0
    y = _check_within(x, mode, 128)
    if mode == "none":
        assert torch.equal(y, x)


def test_int_bounds_are_the_documented_fractions_of_absmax() -> None:
    # one block whose absmax is 14 (int4) or 254 (int8): every error must be <= 1.0
    x = torch.linspace(-14.0, 14.0, 128)
    assert float((quant.roundtrip(x, "int4", 128) - x).abs().max()) <= 14.0 / 14 * (1 + 1e-6)
    x = torch.linspace(-254.0, 254.0, 128)
    assert float((quant.roundtrip(x, "int8", 128) - x).abs().max()) <= 254.0 / 254 * (1 + 1e-6)
    # and the bound is attained, not loose: int4 rounds 0.5/7 of the absmax to 0 or to 1/7
    x = torch.tensor([7.0, 0.5, -3.5, 2.0] + [0.0] * 4)
    assert quant.roundtrip(x, "int4", 8).tolist() == [7.0, 0.0, -4.0, 2.0, 0.0, 0.0, 0.0, 0.0]


def test_absmax_is_reproduced_exactly_for_int_modes() -> None:
    x = torch.randn(1024, generator=_gen(1))
    for mode in ("int8", "int4"):
        y = quant.roundtrip(x, mode, 64)
        blocks_x, blocks_y = x.view(-1, 64), y.view(-1, 64)
        idx = blocks_x.abs().argmax(dim=1)
        got = blocks_y.gather(1, idx[:, None]).squeeze(1)
        want = blocks_x.gather(1, idx[:, None]).squeeze(1)
        assert torch.allclose(got, want, rtol=2e-7, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_bf16_relative_and_none_exact(mode: str) -> None:
    x = torch.randn(3000, generator=_gen(2)) * torch.logspace(-20, 20, 3000)
    y = quant.roundtrip(x, mode)
    if mode == "none":
        assert torch.equal(y, x)
    elif mode == "bf16":
        assert bool(((y - x).abs() <= x.abs() * 2.0**-8).all())
        assert torch.equal(y, x.to(torch.bfloat16).float())


# -- bit-exact decode(encode(x)) == roundtrip(x) ---------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("n", "block"), [(1, 8), (5, 8), (8, 8), (9, 8), (1000, 64), (1000, 128), (4097, 128), (300, 256)]
)
def test_decode_encode_is_roundtrip_bit_exact(mode: str, n: int, block: int) -> None:
    x = torch.randn(n, generator=_gen(n * 7 + block)) * 0.01
    blob = codec.encode(x, mode, block)
    y = codec.decode(blob, expect_numel=n)
    assert torch.equal(y, quant.roundtrip(x, mode, block))
    assert codec.blob_info(blob) == (mode, n)
    q = codec.decode_quantized(blob)
    assert (q.mode, q.numel, q.block) == (mode, n, block)


@pytest.mark.parametrize("mode", MODES)
def test_all_zero_and_partly_zero_blocks(mode: str) -> None:
    x = torch.zeros(1000)
    assert torch.equal(codec.decode(codec.encode(x, mode, 128)), x)
    x[300:340] = torch.randn(40, generator=_gen(3))  # block 2 only
    y = codec.decode(codec.encode(x, mode, 128))
    assert torch.equal(y, quant.roundtrip(x, mode, 128))
    assert bool((y[:256] == 0).all()) and bool((y[384:] == 0).all())
    if mode in QMAX:
        scales = quant.quantize(x, mode, 128).scales
        assert scales.tolist()[0] == 0.0 and scales.tolist()[3] == 0.0 and scales.tolist()[2] > 0


def test_empty_tensor() -> None:
    for mode in MODES:
        x = torch.zeros(0)
        assert codec.decode(codec.encode(x, mode, 8), expect_numel=0).numel() == 0


def test_quantize_accepts_any_shape_and_dtype_and_flattens() -> None:
    x = torch.randn(4, 33, generator=_gen(4), dtype=torch.float64)
    y = quant.roundtrip(x, "int4", 16)
    assert y.shape == (132,) and y.dtype == torch.float32
    assert torch.equal(codec.decode(codec.encode(x, "int4", 16)), y)


def test_unknown_mode() -> None:
    with pytest.raises(CodecError):
        quant.quantize(torch.zeros(3), "int2")


# -- compression ratio -------------------------------------------------------------------------


def test_int4_compression_ratio_on_random_data() -> None:
    x = torch.randn(100_000, generator=_gen(5))
    fp32 = 4 * x.numel()
    ratios = {mode: len(codec.encode(x, mode, 128)) / fp32 for mode in MODES}
    assert ratios["int4"] < 0.15
    assert ratios["int8"] < 0.28
    assert ratios["bf16"] <= 0.51
    assert ratios["none"] > 0.85  # zstd alone does little on fp32 noise (ALGORITHM.md)
    assert ratios["int4"] < ratios["int8"] < ratios["bf16"] < ratios["none"]


# -- error feedback ----------------------------------------------------------------------------


def _accumulate(xs: list[torch.Tensor], feedback: bool, mode: str = "int4", block: int = 64) -> list[float]:
    """Max |sum of sent values - sum of true values| after each round."""
    residual = torch.zeros_like(xs[0])
    truth = torch.zeros_like(xs[0], dtype=torch.float64)  # float64 sums: no accumulation noise
    sent = torch.zeros_like(xs[0], dtype=torch.float64)
    errors = []
    for x in xs:
        target = x + residual if feedback else x
        q = quant.roundtrip(target, mode, block)
        if feedback:
            residual = target - q
        truth += x
        sent += q
        errors.append(float((sent - truth).abs().max()))
    return errors


def test_error_feedback_keeps_a_systematic_error_bounded() -> None:
    # every block: one large value (sets the scale, 1/7) and small ones (0.05) that int4 rounds
    # to zero every single time: without feedback they are never sent, the error grows linearly
    x = torch.full((512,), 0.05)
    x[::64] = 1.0
    xs = [x.clone() for _ in range(200)]
    with_fb = _accumulate(xs, feedback=True)
    without = _accumulate(xs, feedback=False)
    assert without[-1] == pytest.approx(200 * 0.05, rel=1e-3)  # linear growth
    assert without[-1] > 10 * without[9] * 0.99
    step = 1.0 / 7  # one quantization step of a block whose absmax is ~1
    assert max(with_fb) <= step  # bounded by one step, whatever the number of rounds
    assert max(with_fb[100:]) <= max(with_fb[:100]) + 1e-6  # no growth


def test_error_feedback_keeps_random_errors_bounded() -> None:
    g = _gen(6)
    xs = [torch.randn(4096, generator=g) for _ in range(400)]
    with_fb = _accumulate(xs, feedback=True)
    without = _accumulate(xs, feedback=False)
    # with feedback the accumulated error is the last residual: at most half a step of the last
    # rounds' blocks (absmax of ~N(0,2) over 64 values is < 8, so < 8/14 + margin)
    assert max(with_fb) < 1.0
    assert max(with_fb[200:]) < 1.5 * max(with_fb[:200])
    # without it the errors random-walk: clearly larger after 400 rounds than after 10
    assert without[-1] > 3 * without[9]
    assert without[-1] > 5 * with_fb[-1]


# -- syncer / learner bit identity --------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_learner_replica_stays_bit_identical_to_syncer(mode: str) -> None:
    """50 published updates: the syncer's theta + dequantize(q) == learner's latest + decode(blob)."""
    g = _gen(7)
    start = torch.randn(3001, generator=g) * 0.02
    theta = start.clone()  # the syncer's global fragment
    latest = start.clone()  # a learner's replica of it
    residual = torch.zeros_like(start)
    for step in range(50):
        new = theta - 0.7 * torch.randn(3001, generator=g) * 1e-3 * (1 + step % 5)
        change = (new - theta) + residual
        q = quant.quantize(change, mode, 128)
        applied = quant.dequantize(q)
        theta = theta + applied
        residual = change - applied
        blob = codec.encode_quantized(q)
        latest = latest + codec.decode(blob, expect_numel=3001)
        assert torch.equal(theta, latest), f"diverged at update {step}"
    assert not torch.equal(theta, start)
    assert torch.equal(theta, latest)


@pytest.mark.parametrize("mode", MODES)
def test_quantize_roundtrip_values_are_dequantize_bit_for_bit(mode: str) -> None:
    """The syncer publishes theta + the values of quantize_roundtrip; learners add decode(blob)."""
    g = _gen(11)
    x = torch.randn(4100, generator=g) * 1e-3
    x[::7] = -1e-9  # tiny negatives: their codes are 0, and must never dequantize to -0.0
    x[5:300] = 0.0
    q, values = quant.quantize_roundtrip(x, mode, 128)
    reference = quant.dequantize(quant.quantize(x, mode, 128))
    decoded = codec.decode(codec.encode_quantized(q), expect_numel=x.numel())
    for other in (reference, decoded):  # compare the bits: torch.equal treats -0.0 == 0.0
        assert torch.equal(values.view(torch.int32), other.view(torch.int32))
    latest = torch.full_like(x, -0.0)
    assert torch.equal((latest + values).view(torch.int32), (latest + decoded).view(torch.int32))
    scratch = torch.full((33 * 128,), float("nan"))  # working memory given by the caller: same bits
    q2, in_scratch = quant.quantize_roundtrip(x, mode, 128, out=scratch)
    assert torch.equal(in_scratch.view(torch.int32), values.view(torch.int32))
    assert codec.encode_quantized(q2) == codec.encode_quantized(q)
    if mode in QMAX:
        assert in_scratch.data_ptr() == scratch.data_ptr()


def test_int4_payload_layout_format_2() -> None:
    """Per block: byte k = code k (low nibble) | code k + block/2 (high nibble), two's complement."""
    x = torch.tensor([7.0, -7.0, 1.0, 2.0, -3.0, 0.0, 4.0, 5.0])  # absmax 7: scale 1, codes = x
    blob = codec.encode(x, "int4", 8)
    assert blob[2] == codec.FORMAT == 2
    assert _payload(blob) == struct.pack("<f", 1.0) + bytes([0xD7, 0x09, 0x41, 0x52])
    assert torch.equal(codec.decode(blob), x)


# -- hypothesis: bounds on random tensors -------------------------------------------------------

_values = st.lists(
    st.floats(
        min_value=-1.0000000150474662e30,
        max_value=1.0000000150474662e30,
        allow_nan=False,
        allow_infinity=False,
        allow_subnormal=False,
        width=32,
    ),
    min_size=1,
    max_size=600,
)


@FAST
@given(values=_values, mode=st.sampled_from(MODES), block=st.sampled_from([8, 16, 64, 128]))
def test_property_roundtrip_within_bounds_and_bit_exact(values: list[float], mode: str, block: int) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    x[x.abs() < 1e-30] = 0.0  # blocks of near-denormal absmax: see test_tiny_blocks below
    y = _check_within(x, mode, block)
    assert torch.equal(codec.decode(codec.encode(x, mode, block), expect_numel=x.numel()), y)


def test_tiny_blocks_stay_finite_in_range_and_bit_exact() -> None:
    """Blocks whose absmax is (near) denormal: qmax/absmax overflows to inf in quantize.

    The codes stay in range and decode(encode(x)) still equals roundtrip(x); the error is then
    only bounded by the absmax itself (about 1e-38, harmless), not by half a step.
    """
    for values in ([1e-40, 0.0, -1e-40, 5e-41], [1e-45, 0.0, 0.0, 0.0], [1.5e-38, 0.0, -1e-39, 1e-38]):
        x = torch.tensor(values + [0.0] * 4)
        for mode in ("int8", "int4"):
            q = quant.quantize(x, mode, 8)
            assert int(q.codes.abs().max()) <= QMAX[mode]
            y = codec.decode(codec.encode(x, mode, 8))
            assert torch.equal(y, quant.roundtrip(x, mode, 8))
            assert bool(((y - x).abs() <= x.abs().max()).all())


@FAST
@given(
    values=_values,
    mode=st.sampled_from(MODES),
    where=st.integers(min_value=0, max_value=10_000),
    bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
)
def test_property_non_finite_source_fails_decode(values: list[float], mode: str, where: int, bad: float) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    x[where % x.numel()] = bad
    blob = codec.encode(x, mode, 16)  # encoding does not check; the receiver must
    with pytest.raises(CodecError):
        codec.decode(blob)


def test_finite_scale_that_overflows_on_dequantize_is_rejected() -> None:
    # fp32 max in int8: scale = max/127, and 127 * scale rounds up to inf
    x = torch.tensor([3.4028235e38] + [1.0] * 7)
    assert bool(torch.isinf(quant.roundtrip(x, "int8", 8)).any())
    with pytest.raises(CodecError):
        codec.decode(codec.encode(x, "int8", 8))


# -- hypothesis: malformed blobs -------------------------------------------------------------------


def _decode_or_codec_error(blob: bytes, expect: int | None) -> None:
    try:
        y = codec.decode(blob, expect_numel=expect)
    except CodecError:
        return
    _mode, numel = codec.blob_info(blob)
    assert y.dtype == torch.float32 and y.numel() == numel
    if expect is not None:
        assert numel == expect
    assert bool(torch.isfinite(y).all())


@FAST
@given(blob=st.binary(max_size=200), expect=st.one_of(st.none(), st.integers(0, 100)))
def test_property_random_bytes(blob: bytes, expect: int | None) -> None:
    _decode_or_codec_error(blob, expect)
    _decode_or_codec_error(codec.MAGIC + bytes([codec.FORMAT]) + blob, expect)


_VALID = {mode: codec.encode(torch.randn(300, generator=_gen(8)), mode, 64) for mode in MODES}


@FAST
@given(
    mode=st.sampled_from(MODES),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 10_000)),
    tail=st.binary(max_size=8),
    expect=st.sampled_from([None, 300]),
)
def test_property_mutated_and_truncated_blobs(
    mode: str, edits: list[tuple[int, int]], cut: int | None, tail: bytes, expect: int | None
) -> None:
    blob = bytearray(_VALID[mode])
    for pos, value in edits:
        blob[pos % len(blob)] = value
    if cut is not None:
        blob = blob[: cut % (len(blob) + 1)]
    _decode_or_codec_error(bytes(blob) + tail, expect)


@pytest.mark.parametrize("mode", MODES)
def test_every_truncation_is_a_codec_error(mode: str) -> None:
    blob = _VALID[mode]
    for cut in range(len(blob)):
        with pytest.raises(CodecError):
            codec.decode(blob[:cut])


def _reheader(blob: bytes, **fields: int) -> bytes:
    magic, fmt, mode, numel, block, raw_len = struct.unpack_from("<2sBBQIQ", blob)
    values = {"magic": magic, "fmt": fmt, "mode": mode, "numel": numel, "block": block, "raw_len": raw_len}
    values.update(fields)
    return struct.pack("<2sBBQIQ", *values.values()) + blob[HS:]


@pytest.mark.parametrize(
    "fields",
    [
        {"magic": b"XX"},
        {"fmt": 1},
        {"fmt": 3},
        {"mode": 4},
        {"mode": 255},
        {"numel": 400},
        {"numel": 1 << 40},
        {"block": 0},
        {"block": 63},
        {"block": 1 << 21},
        {"raw_len": 0},
        {"raw_len": 1 << 60},
    ],
)
def test_header_mismatches(fields: dict) -> None:
    with pytest.raises(CodecError):
        codec.decode(_reheader(_VALID["int4"], **fields))


def test_expect_numel_mismatch_and_mode_mismatch() -> None:
    with pytest.raises(CodecError):
        codec.decode(_VALID["int8"], expect_numel=299)
    # a blob relabelled as another mode has the wrong payload length
    with pytest.raises(CodecError):
        codec.decode(_reheader(_VALID["int8"], mode=3))


def _payload(blob: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(blob[HS:])


def _with_payload(blob: bytes, raw: bytes) -> bytes:
    return blob[:HS] + zstandard.ZstdCompressor().compress(raw)


def test_int4_zero_nibble_and_negative_scale_rejected() -> None:
    blob = _VALID["int4"]
    raw = bytearray(_payload(blob))
    nblocks = -(-300 // 64)
    bad = raw.copy()
    bad[4 * nblocks] = 0x80  # high nibble 0b1000 = code -8 (two's complement), never produced
    with pytest.raises(CodecError, match="nibble"):
        codec.decode(_with_payload(blob, bytes(bad)))
    bad[4 * nblocks] = 0x18  # low nibble 0b1000: refused too
    with pytest.raises(CodecError, match="nibble"):
        codec.decode(_with_payload(blob, bytes(bad)))
    neg = raw.copy()
    neg[0:4] = struct.pack("<f", -1.0)
    with pytest.raises(CodecError):
        codec.decode(_with_payload(blob, bytes(neg)))
    # unchanged payload recompressed: still the same values
    assert torch.equal(codec.decode(_with_payload(blob, bytes(raw))), codec.decode(blob))


def _frame(raw: bytes, content_size: int) -> bytes:
    """A single-segment zstd frame with one raw block and a chosen declared content size."""
    head = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", content_size)
    return head + struct.pack("<I", (len(raw) << 3) | 1)[:3] + raw


def test_frame_declaring_a_huge_content_size_is_refused_before_allocating() -> None:
    blob = _VALID["int4"]
    raw = _payload(blob)
    assert torch.equal(codec.decode(blob[:HS] + _frame(raw, len(raw))), codec.decode(blob))
    for declared in (len(raw) + 1, 64 << 20, 1 << 40):  # 1 TiB used to raise MemoryError
        with pytest.raises(CodecError, match="declares"):
            codec.decode(blob[:HS] + _frame(raw, declared))


@pytest.mark.parametrize("mode", MODES)
def test_bytes_after_the_zstd_frame_are_refused(mode: str) -> None:
    blob = _VALID[mode]
    for extra in (b"\0", blob[HS:]):  # garbage, or a second frame
        with pytest.raises(CodecError, match="corrupt"):
            codec.decode(blob + extra)


def test_frame_without_content_size_that_decompresses_too_far() -> None:
    blob = _VALID["int8"]
    raw = _payload(blob)
    nosize = zstandard.ZstdCompressor(write_content_size=False)
    assert torch.equal(codec.decode(blob[:HS] + nosize.compress(raw)), codec.decode(blob))
    for other in (raw + b"\0" * 100, raw + b"\0" * (8 << 20), raw[:-4]):
        with pytest.raises(CodecError):
            codec.decode(blob[:HS] + nosize.compress(other))


# -- payloads stored without zstd ([run] zstd = false) ---------------------------------------------


def _stored(blob: bytes) -> bytes:
    """The same blob with its payload stored as it is (format byte | RAW)."""
    return _reheader(blob, fmt=codec.FORMAT | codec.RAW)[:HS] + _payload(blob)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("n", "block"), [(0, 8), (1, 8), (9, 8), (1000, 128), (4097, 128)])
def test_stored_payloads_roundtrip_bit_exact_and_decode_like_zstd_ones(mode: str, n: int, block: int) -> None:
    x = torch.randn(n, generator=_gen(n + 3)) * 0.01
    packed, stored = codec.encode(x, mode, block), codec.encode(x, mode, block, zstd=False)
    assert stored[2] == codec.FORMAT | codec.RAW and packed[2] == codec.FORMAT  # today's blobs: unchanged
    assert len(stored) == HS + quant.raw_length(mode, n, block) and stored == _stored(packed)
    assert torch.equal(codec.decode(stored, expect_numel=n), quant.roundtrip(x, mode, block))
    assert torch.equal(codec.decode(stored), codec.decode(packed)) and codec.blob_info(stored) == (mode, n)
    q = quant.quantize(x, mode, block)
    assert codec.encode_quantized(q, zstd=False) == stored
    payload = quant.payload_here(x, mode, block)
    assert codec.encode_payload(payload, mode, n, block, zstd=False) == stored
    encoder = codec.ChunkEncoder(mode, n, block, zstd=False)
    encoder.put(0, x, torch.empty(max(1, -(-n // block)) * block))
    assert encoder.finish() == stored


@pytest.mark.parametrize("mode", MODES)
def test_stored_payload_of_the_wrong_length_is_refused(mode: str) -> None:
    stored = codec.encode(torch.randn(300, generator=_gen(2)), mode, 64, zstd=False)
    for cut in range(len(stored)):  # every truncation, the header's too
        with pytest.raises(CodecError):
            codec.decode(stored[:cut])
    for extra in (b"\0", b"\0" * 4, stored[HS:]):  # trailing bytes: as strict as a zstd frame's length
        with pytest.raises(CodecError, match="stored payload"):
            codec.decode(stored + extra)
    with pytest.raises(CodecError):  # a zstd blob relabelled as stored: wrong length
        codec.decode(_reheader(codec.encode(torch.randn(300), mode, 64), fmt=codec.FORMAT | codec.RAW))


def test_stored_payloads_with_bad_codes_or_values_are_refused() -> None:
    from syncer import native

    kernel = native.load()
    nblocks = -(-300 // 64)
    int4 = bytearray(codec.encode(torch.randn(300, generator=_gen(4)), "int4", 64, zstd=False))
    for byte in (0x80, 0x08):  # nibble 0b1000 (-8), high then low: never produced
        bad = int4.copy()
        bad[HS + 4 * nblocks + 10] = byte
        for k in (None, kernel):
            with pytest.raises(CodecError, match="nibble"):
                codec.decode_quantized(bytes(bad), kernel=k)
    for mode in ("int4", "int8"):
        bad = bytearray(codec.encode(torch.randn(300, generator=_gen(5)), mode, 64, zstd=False))
        bad[HS : HS + 4] = struct.pack("<f", float("nan"))
        for k in (None, kernel):
            with pytest.raises(CodecError, match="non-finite"):
                codec.decode_quantized(bytes(bad), kernel=k)
    for mode, dtype in (("none", torch.float32), ("bf16", torch.bfloat16)):
        x = torch.randn(300, generator=_gen(6))
        x[17] = float("inf")
        raw = x.to(dtype).view(torch.uint8).numpy().tobytes()
        header = struct.pack(
            "<2sBBQIQ", codec.MAGIC, codec.FORMAT | codec.RAW, quant.MODES.index(mode), 300, 64, len(raw)
        )
        with pytest.raises(CodecError, match="NaN or Inf"):
            codec.decode(header + raw)


@FAST
@given(
    mode=st.sampled_from(MODES),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 10_000)),
    tail=st.binary(max_size=8),
)
def test_property_mutated_and_truncated_stored_blobs(
    mode: str, edits: list[tuple[int, int]], cut: int | None, tail: bytes
) -> None:
    blob = bytearray(codec.encode(torch.randn(300, generator=_gen(8)), mode, 64, zstd=False))
    for pos, value in edits:
        blob[pos % len(blob)] = value
    if cut is not None:
        blob = blob[: cut % (len(blob) + 1)]
    _decode_or_codec_error(bytes(blob) + tail, 300)


def test_decoded_stored_payload_views_the_blob_and_never_writes_it() -> None:
    x = torch.randn(1000, generator=_gen(9))
    stored = codec.encode(x, "int8", 128, zstd=False)
    before = bytes(stored)
    q = codec.decode_quantized(stored)
    y = quant.dequantize(q)  # a new tensor: the blob's bytes stay as they were
    y.add_(1.0)
    assert stored == before and torch.equal(codec.decode(stored), quant.roundtrip(x, "int8", 128))


def test_decoding_read_only_payloads_leaves_the_warning_filters_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the first read-only view is taken under catch_warnings (torch warns once per process);
    every later push must not swap the process's warning filters (costly, and racy for the
    syncer's other threads), and no UserWarning escapes either way."""
    import warnings

    blob = codec.encode(torch.randn(4096), "int4")
    codec.decode_quantized(blob, expect_numel=4096)  # the first may take torch's one warning
    entered = []
    real = warnings.catch_warnings

    def counting(*args: object, **kwargs: object) -> warnings.catch_warnings:
        entered.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(warnings, "catch_warnings", counting)
    with real(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            q = codec.decode_quantized(blob, expect_numel=4096)
    assert entered == [] and [w for w in caught if issubclass(w.category, UserWarning)] == []
    assert torch.equal(quant.dequantize(q), codec.decode(blob, expect_numel=4096))
