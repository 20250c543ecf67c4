"""The codecs below int4 (syncer/wire/thin.py through quant and codec) and the learner's error
feedback (learner/feedback.py): each codec's stated error and size, malformed payloads refused,
the residual carrying exactly what a push did not, and the syncer's publish in a thin mode
bit-identical for learners across slice boundaries.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch

from learner.feedback import ErrorFeedback
from syncer import fused, merge
from syncer.wire import codec, quant, thin

TOPK = thin.topk_block(64)  # the default: 64 of every 4,096
SMALL_TOPK = thin.topk_block(16, 256)  # small chunks: many of them in a small tensor
SEGMENTS = [(0, 700, "embedding"), (700, 1900, "dense")]
NUMEL = 2600


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [0, 1, 3, 128, 1000, 70_001])
def test_2bit_codes_are_odd_levels_of_one_scale_a_block_and_a_quarter_byte_each(n: int) -> None:
    x = _x(n)
    q = codec.decode_quantized(codec.encode(x, "2bit", 128, zstd=False))
    assert set(q.codes.tolist()) <= {-3, -1, 1, 3}
    assert len(codec.encode(x, "2bit", 128, zstd=False)) == codec.HEADER_SIZE + 4 * -(-n // 128) + -(-n // 128) * 32
    if n >= 1000:  # near the 4-level optimum for a bell-shaped block (0.34 rms; absmax scales give 0.55)
        err = float((codec.decode(codec.encode(x, "2bit")) - x).norm() / x.norm())
        assert err < 0.4
        assert (q.codes[:n].sign() == x.sign().to(torch.int8)).all(), "every code keeps its value's sign"


@pytest.mark.parametrize("block", [TOPK, SMALL_TOPK])
@pytest.mark.parametrize("n", [0, 1, 200, 4096, 10_000])
def test_topk_keeps_each_chunks_largest_values_and_zeros_the_rest(block: int, n: int) -> None:
    chunk, keep = thin.topk_shape(block)
    x = _x(n, seed=1)
    decoded = codec.decode(codec.encode(x, "topk", block))
    assert decoded.numel() == n
    pad = torch.nn.functional.pad(x, (0, (-n) % chunk)).view(-1, chunk).abs()
    got = torch.nn.functional.pad(decoded, (0, (-n) % chunk)).view(-1, chunk)
    for row, values in zip(pad, got):
        kept = values != 0
        assert int(kept.sum()) <= keep
        if int(kept.sum()) and int((~kept).sum()):
            assert float(row[kept].min()) >= float(row[~kept].max()), "a dropped value outweighs a kept one"
    assert (decoded.sign() * x.sign() >= 0).all(), "a kept value keeps its sign"
    raw = len(codec.encode(x, "topk", block, zstd=False)) - codec.HEADER_SIZE
    chunks = -(-n // chunk)
    assert raw == chunks * (4 + 2 * keep + keep // 4)  # scale, int16 indices, 2-bit codes


def test_topk_is_about_16x_smaller_than_int4_on_the_wire() -> None:
    x = _x(1 << 18, seed=2)
    ratio = len(codec.encode(x, "int4")) / len(codec.encode(x, "topk", TOPK))
    assert 12 < ratio < 20


def _payload(blob: bytes) -> bytearray:
    return bytearray(blob[codec.HEADER_SIZE :])


def _reblob(blob: bytes, payload: bytearray) -> bytes:
    return blob[: codec.HEADER_SIZE] + bytes(payload)


def test_a_topk_payload_with_an_index_out_of_its_chunk_or_twice_is_refused() -> None:
    x = _x(600, seed=3)
    blob = codec.encode(x, "topk", SMALL_TOPK, zstd=False)
    chunks = -(-600 // 256)
    first_index = 4 * chunks
    outside = _payload(blob)
    outside[first_index : first_index + 2] = struct.pack("<h", 256)
    with pytest.raises(codec.CodecError, match="outside its chunk"):
        codec.decode(_reblob(blob, outside))
    twice = _payload(blob)
    twice[first_index + 2 : first_index + 4] = twice[first_index : first_index + 2]
    with pytest.raises(codec.CodecError, match="not increasing"):
        codec.decode(_reblob(blob, twice))
    negative = _payload(blob)
    negative[first_index : first_index + 2] = struct.pack("<h", -1)
    with pytest.raises(codec.CodecError):
        codec.decode(_reblob(blob, negative))


@pytest.mark.parametrize("mode, block", [("2bit", 128), ("topk", SMALL_TOPK)])
def test_a_thin_blob_truncated_or_with_a_nonfinite_scale_is_refused(mode: str, block: int) -> None:
    blob = codec.encode(_x(600, seed=4), mode, block, zstd=False)
    with pytest.raises(codec.CodecError):
        codec.decode(blob[:-1])
    bad = _payload(blob)
    bad[0:4] = struct.pack("<f", float("nan"))
    with pytest.raises(codec.CodecError, match="scale"):
        codec.decode(_reblob(blob, bad))
    header = bytearray(blob[: codec.HEADER_SIZE])
    struct.pack_into("<I", header, 12, 6 if mode == "2bit" else thin.topk_block(6, 256))  # not whole bytes
    with pytest.raises(codec.CodecError, match="block"):
        codec.decode(bytes(header) + blob[codec.HEADER_SIZE :])


@pytest.mark.parametrize("mode, block", [("2bit", 128), ("topk", SMALL_TOPK)])
def test_error_feedback_carries_exactly_what_a_push_did_not(mode: str, block: int) -> None:
    fb = ErrorFeedback()
    pushes = [_x(NUMEL, seed=10 + i) * 1e-3 for i in range(6)]
    received = torch.zeros(NUMEL)
    for i, values in enumerate(pushes):
        before = fb.residual.get(0, torch.zeros(NUMEL)).clone()
        blob = fb.encode(0, values, mode, block, zstd=True)
        decoded = codec.decode(blob, expect_numel=NUMEL)
        if i == 2:  # the socket did not take it: coded again later from the same residual
            fb.discard()
            assert torch.equal(fb.residual.get(0, torch.zeros(NUMEL)), before)
            assert fb.encode(0, values, mode, block, zstd=True) == blob, "deterministic: the same bytes again"
        fb.commit()
        # exactly: residual' = (values + residual) - what the blob carries, in fp32
        assert torch.equal(fb.residual[0], (values + before) - decoded)
        received += decoded
    # nothing is lost, only delayed: what arrived plus what is carried is what was trained
    torch.testing.assert_close(received + fb.residual[0], torch.stack(pushes).sum(0), rtol=0, atol=1e-8)
    assert fb.carried() > 0


def test_int4_keeps_no_residual_and_codes_as_before() -> None:
    fb, x = ErrorFeedback(), _x(1000)
    assert fb.encode(0, x, "int4", 128, zstd=True) == codec.encode(x, "int4", 128)
    fb.commit()
    assert fb.residual == {}


@pytest.mark.parametrize("out_mode, block", [("2bit", 128), ("topk", SMALL_TOPK)])
def test_a_thin_publish_is_bit_exact_for_learners_across_slices(
    out_mode: str, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Contributions in every codec (a thin host beside int4 ones), the update in a thin one:
    what a learner rebuilds from the blob is the syncer's new fragment, bit for bit, and the
    syncer's residual holds what the update did not carry."""
    monkeypatch.setattr(fused, "SLICE", 512)  # many slices, segments straddling them
    shared = _x(NUMEL, seed=20) * 1e-3
    modes = [("topk", SMALL_TOPK), ("2bit", 128), ("int4", 128), ("int8", 64)]
    qs = [
        codec.decode_quantized(codec.encode(shared + _x(NUMEL, 21 + i) * 1e-3, m, b)) for i, (m, b) in enumerate(modes)
    ]
    theta, momentum, residual = _x(NUMEL, 30), _x(NUMEL, 31) * 1e-3, torch.zeros(NUMEL)
    coefs = merge.coefficients(fused.gram(qs, SEGMENTS, 128), [1.0] * 4, [k for _, _, k in SEGMENTS])
    old, mom0 = theta.clone(), momentum.clone()
    blob, crc = fused.publish(qs, coefs, SEGMENTS, theta, momentum, residual, 0.7, 0.9, out_mode, block)
    assert codec.blob_info(blob) == (out_mode, NUMEL) and crc is not None
    assert torch.equal((old + codec.decode(blob)).view(torch.int32), theta.view(torch.int32))
    merged = merge.merge([quant.dequantize(q) for q in qs], [1.0] * 4, SEGMENTS, "rda")
    change = merge.nesterov_change_(torch.zeros(NUMEL), merged, mom0, 0.7, 0.9)
    torch.testing.assert_close(residual + codec.decode(blob), change, rtol=1e-4, atol=1e-8)


def test_a_round_with_a_sparse_push_is_merged_by_the_mean_not_rda() -> None:
    """RDA scales the merged direction to the pushes' mean norm; near-orthogonal sparse pushes
    would take a ~2x step from it. A round holding a topk push merges by the weighted mean."""
    from types import SimpleNamespace

    from syncer.outerstep import _rule

    def contrib(*modes: str) -> Any:
        return SimpleNamespace(parts=[SimpleNamespace(mode=m) for m in modes])

    assert _rule("rda", [contrib("int4"), contrib("2bit")]) == "rda"
    assert _rule("rda", [contrib("int4"), contrib("int4", "topk")]) == "mean"
    assert _rule("mean", [contrib("int4")]) == "mean"
