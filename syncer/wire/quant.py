"""Blockwise quantization of a 1-D fp32 tensor and the payload its codes make (a leaf: torch only).

The math the wire format (`codec`: header, zstd, blobs) carries, kept apart from that framing so a
quantizer is added here, beside int4 and int8, without touching how a blob is framed. A tensor is
quantized blockwise (one absmax scale per `block` values) to int4 (default), int8, bf16 or left as
fp32 ("none"); its payload is

    scales fp32[nblocks] | packed codes        (int4 / int8)
    bf16[numel]  |  fp32[numel]                (bf16 / none)

int4 packing (codec format 2): block by block (the last block zero-padded), byte k of a block's
block/2 bytes holds the block's code k in its low nibble and code k + block/2 in its high nibble,
each a 4-bit two's complement number (-7..7; the nibble 0b1000 = -8 is never produced and is
refused). Each half unpacks with one or two int8 shifts, no interleaving (format 1 interleaved
offset-binary nibbles, several strided passes per blob). Both nibbles of a byte come from the same
block, as in format 1: that keeps zstd's gain on outlier-heavy tensors (about 1.5% more than
pairing codes of different blocks).

Dequantization is one IEEE multiply per value (`code * scale`), and callers add it to their copy
with a separate fp32 add: the same bytes give bit-identical values on any CPU or GPU, which is
what keeps every learner's global fragments identical to the syncer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from syncer.wire import thin

MODES = ("none", "bf16", "int8", "int4", "2bit", "topk")  # a mode's index is its byte in a blob's header: append only
# the blockwise modes with scales and integer codes, and their largest code
QMAX = {"int8": 127, "int4": 7, "2bit": thin.QMAX_2BIT}
THIN = ("2bit", "topk")  # the modes below int4 (syncer/wire/thin.py): a sender keeps what they lose (error feedback)
_BAD_NIBBLE = "int4 code out of range (nibble 0b1000 = -8)"
_BAD_SCALE = "non-finite or negative quantization scale, or scale x code overflows fp32 (NaN/Inf in the source)"
_ROUNDER = 1.5 * 2.0**23  # y + R - R rounds an fp32 |y| < 2^22 to the nearest integer (ties to even)


class CodecError(ValueError):
    """A blob is malformed, truncated, of the wrong size, or holds non-finite values."""


@dataclass(frozen=True)
class Quantized:
    """Codes and scales of one tensor, before packing; `dequantize` inverts it exactly."""

    mode: str
    numel: int
    block: int
    codes: torch.Tensor  # int8 codes (int4/int8), bf16 or fp32 values; `packed`: int4 as on the wire
    scales: torch.Tensor  # fp32, one per block (empty for bf16/none)
    packed: bool = False  # int4 codes kept two a byte (uint8, blocks * block/2: codec format 2)
    index: torch.Tensor | None = None  # topk: int64 (chunks, keep), each kept value's place in its chunk

    def int_codes(self, first: int = 0, count: int | None = None) -> torch.Tensor:
        """int8 codes of blocks [first, first + count) (int4/int8; all blocks by default),
        unpacked if `packed` (a new tensor then, else a view)."""
        nblocks = self.scales.numel() if count is None else count
        if not self.packed:
            return self.codes[first * self.block : (first + nblocks) * self.block]
        half = self.block // 2
        return _unpack_nibbles(self.codes[first * half : (first + nblocks) * half], self.block)


def check_mode(mode: str) -> None:
    """CodecError unless `mode` is one of MODES."""
    if mode not in MODES:
        raise CodecError(f"unknown compression mode {mode!r}; use one of {', '.join(MODES)}")


def valid_block(mode: str, block: int) -> bool:
    """Whether `block` is a block size `mode` can carry (any for the modes without blocks; for
    topk the field thin.topk_block makes)."""
    if mode == "2bit":
        return thin.valid_2bit(block)
    if mode == "topk":
        return thin.valid_topk(block)
    return mode not in QMAX or (block >= 2 and not block % 2 and block <= 1 << 20)


def granule(mode: str, block: int) -> int:
    """The values a slice of a tensor in this mode must start on a multiple of: its block (for
    topk its chunk), 1 for the modes without blocks."""
    if mode == "topk":
        return thin.topk_shape(block)[0]
    return block if mode in QMAX else 1


def wire_block(mode: str, block: int, keep: int) -> int:
    """The block field a run's settings give `mode`: `block` values per scale, or for topk its
    keep-of-4,096 (thin.topk_block)."""
    return thin.topk_block(keep) if mode == "topk" else block


def raw_length(mode: str, numel: int, block: int) -> int:
    """Exact uncompressed payload size for these parameters (the decoder insists on it)."""
    if mode == "none":
        return 4 * numel
    if mode == "bf16":
        return 2 * numel
    if mode == "2bit":
        return thin.length_2bit(numel, block)
    if mode == "topk":
        return thin.length_topk(numel, block)
    nblocks = -(-numel // block)
    codes = nblocks * block if mode == "int8" else nblocks * block // 2
    return 4 * nblocks + codes


def quantize(x: torch.Tensor, mode: str = "int4", block: int = 128) -> Quantized:
    """Blockwise absmax quantization of a 1-D fp32 tensor (any device; result on CPU)."""
    return _quantize(x, mode, block)[0]


def quantize_roundtrip(
    x: torch.Tensor, mode: str = "int4", block: int = 128, out: torch.Tensor | None = None
) -> tuple[Quantized, torch.Tensor]:
    """`quantize(x)` and `dequantize` of it in one go (the syncer's publish step).

    The values are bit-identical to `dequantize(q)` (the same `code * scale` products); computing
    them from the float codes still in hand saves a pass over the data. `out`, a contiguous fp32
    tensor of at least nblocks * block values not overlapping `x`, is used as the working memory
    (int modes) and the values returned are then a view of it: it saves a fragment-sized
    allocation when the caller has a dead buffer at hand.
    """
    q, values = _quantize(x, mode, block, want_values=True, out=out)
    return q, dequantize(q) if values is None else values


def _quantize(
    x: torch.Tensor, mode: str, block: int, want_values: bool = False, out: torch.Tensor | None = None
) -> tuple[Quantized, torch.Tensor | None]:
    check_mode(mode)
    return _quantize_here(x.detach().reshape(-1).to("cpu", torch.float32), mode, block, want_values, out)


def _quantize_here(
    x: torch.Tensor, mode: str, block: int, want_values: bool = False, out: torch.Tensor | None = None
) -> tuple[Quantized, torch.Tensor | None]:
    """`_quantize` of a flat fp32 tensor on its own device (IEEE ops only: the same codes on any)."""
    n = x.numel()
    empty = torch.empty(0, dtype=torch.float32, device=x.device)
    if mode == "none":
        return Quantized(mode, n, block, x.contiguous(), empty), None
    if mode == "bf16":
        return Quantized(mode, n, block, x.to(torch.bfloat16), empty), None
    if mode == "topk":
        return _quantize_topk(x, block, want_values, out)
    pad = (-n) % block
    xb = (torch.nn.functional.pad(x, (0, pad)) if pad else x.contiguous()).view(-1, block)
    if mode == "2bit":
        codes2, scales2, float_codes = thin.quantize_2bit(xb)
        values2 = float_codes.mul_(scales2[:, None]).view(-1)[:n] if want_values else None
        return Quantized(mode, n, block, codes2, scales2), values2
    qmax = QMAX[mode]
    # max(|max|, |min|) per block: two reads, no |x| temporary (abs also turns -0.0 into 0.0)
    absmax = torch.maximum(xb.amax(dim=1).abs_(), xb.amin(dim=1).abs_())
    scales = absmax / qmax
    # floor the divisor: qmax / 1e-38 would overflow; codes of such tiny blocks stay in range
    inv = torch.where(absmax > 0, qmax / absmax.clamp_min(1e-30), torch.zeros_like(absmax))
    # round half to even by adding and subtracting 1.5 * 2^23 (exact for |y| < 2^22): one pass
    # cheaper than round_, and a zero code comes out as +0.0, never -0.0. |x * inv| <= qmax *
    # (1 + 2^-23) for finite x, so the codes are within [-qmax, qmax] without a clamp (non-finite
    # x gives a non-finite scale, which every decoder refuses)
    scratch = _scratch(out, xb.numel())
    if scratch is not None:
        codes_f = torch.mul(xb, inv[:, None], out=scratch.view(-1)[: xb.numel()].view(-1, block))
    else:
        codes_f = torch.mul(xb, inv[:, None])
    codes_f.add_(_ROUNDER).sub_(_ROUNDER)
    codes = codes_f.to(torch.int8).view(-1)
    values = None
    if want_values:  # the same products as dequantize: codes_f holds exactly float(codes)
        values = codes_f.mul_(scales[:, None]).view(-1)[:n]
    return Quantized(mode, n, block, codes, scales), values


def _quantize_topk(
    x: torch.Tensor, block: int, want_values: bool, out: torch.Tensor | None
) -> tuple[Quantized, torch.Tensor | None]:
    """Top-k of each chunk, its kept values 2-bit coded (syncer/wire/thin.py); the dense values
    (zeros but the kept products) in `out` when it fits."""
    chunk, _ = thin.topk_shape(block)
    index, kept = thin.select_topk(x, block)
    codes, scales, float_codes = thin.quantize_2bit(kept)
    q = Quantized("topk", x.numel(), block, codes, scales, index=index)
    if not want_values:
        return q, None
    work = _scratch(out, index.shape[0] * chunk)
    if work is None:
        work = torch.empty(index.shape[0] * chunk, dtype=torch.float32, device=x.device)
    return q, thin.scatter(index, float_codes.mul_(scales[:, None]), chunk, work)[: x.numel()]


def _scratch(out: torch.Tensor | None, numel: int) -> torch.Tensor | None:
    """`out` if the codes of `numel` values can be computed in it (CPU, fp32, contiguous, large
    enough), else None."""
    if out is None or out.device.type != "cpu" or out.dtype != torch.float32:
        return None
    return out if out.is_contiguous() and out.numel() >= numel else None


def dequantize(q: Quantized) -> torch.Tensor:
    """fp32 values of `q`: `code * scale` (one multiply per value), no fused ops."""
    if q.mode == "none":
        return q.codes.clone()
    if q.mode == "bf16":
        return q.codes.to(torch.float32)
    if q.mode == "topk":
        chunk = thin.topk_shape(q.block)[0]
        return values_into(q, 0, q.numel, torch.empty(-(-q.numel // chunk) * chunk, dtype=torch.float32))
    # each code converts to fp32 exactly, then one rounding of the product (a mixed int8 x fp32
    # torch.mul gives the same bits but runs ~40% slower than convert + in-place multiply)
    values = q.int_codes().view(-1, q.block).to(torch.float32).mul_(q.scales[:, None])
    return values.view(-1)[: q.numel]


def roundtrip(x: torch.Tensor, mode: str = "int4", block: int = 128) -> torch.Tensor:
    """What a receiver reconstructs from `codec.encode(x)`: the syncer publishes exactly this."""
    return dequantize(quantize(x, mode, block))


def values_into(q: Quantized, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
    """fp32 values [start, stop) of `q` written into `out` (fp32, contiguous); returns that view.

    The same `code * scale` products as `dequantize`, a slice at a time, so a caller can work on
    cache-sized pieces of a fragment without ever holding all of it in fp32. `start` must be a
    multiple of the block (int modes); `out` needs room for `stop - start` values rounded up to
    a whole block.
    """
    if q.mode == "topk":
        return _topk_into(q, start, stop, out)
    if q.mode not in QMAX:
        dst = out[: stop - start]
        dst.copy_(q.codes[start:stop])
        return dst
    if start % q.block:
        raise ValueError(f"slice start {start} is not a multiple of the block {q.block}")
    padded = -(-(stop - start) // q.block) * q.block  # codes are stored padded to whole blocks
    dst = out[:padded]
    first = start // q.block
    dst.copy_(q.int_codes(first, padded // q.block))
    dst.view(-1, q.block).mul_(q.scales[first : first + padded // q.block, None])
    return dst[: stop - start]


def _topk_into(q: Quantized, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
    """`values_into` of a top-k tensor: the chunks' kept products scattered into zeros."""
    chunk, keep = thin.topk_shape(q.block)
    if start % chunk:
        raise ValueError(f"slice start {start} is not a multiple of the top-k chunk {chunk}")
    assert q.index is not None, "a topk Quantized holds its indices"
    first, count = start // chunk, -(-(stop - start) // chunk)
    codes = q.codes.view(-1, keep)[first : first + count].to(torch.float32)
    products = codes.mul_(q.scales[first : first + count, None])
    return thin.scatter(q.index[first : first + count], products, chunk, out)[: stop - start]


def pack(q: Quantized) -> bytes:
    """The payload of `q` (module docstring), raw_length bytes."""
    if q.mode == "none":
        return q.codes.numpy().tobytes()
    if q.mode == "bf16":
        return q.codes.view(torch.int16).numpy().tobytes()
    if q.mode in THIN:
        raw = torch.empty(raw_length(q.mode, q.numel, q.block), dtype=torch.uint8)
        writer = PayloadWriter(q.mode, q.numel, q.block, raw)
        writer.write(0, q)
        return raw.numpy().tobytes()
    if q.mode == "int8" or q.packed:  # the codes as they go on the wire already
        return q.scales.numpy().tobytes() + q.codes.numpy().tobytes()
    packed = torch.empty(q.codes.numel() // q.block, q.block // 2, dtype=torch.uint8)
    _pack_int4(q.codes, q.block, packed)
    return q.scales.numpy().tobytes() + packed.numpy().tobytes()


def _pack_int4(codes: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """int8 codes of whole blocks -> out (blocks, block/2) uint8: two's complement nibbles, per
    block code k low and code k + block/2 high (module docstring)."""
    u = codes.view(torch.uint8).view(-1, 2, block // 2)
    torch.bitwise_left_shift(u[:, 1], 4, out=out)
    out.bitwise_or_(u[:, 0].bitwise_and(15))


def payload_here(x: torch.Tensor, mode: str = "int4", block: int = 128) -> torch.Tensor:
    """The uncompressed payload of `codec.encode(x)` as one uint8 tensor on x's own device (scales,
    then the packed codes; or the bf16/fp32 values): quantized and packed where x lives, so a GPU
    copies out 8x fewer bytes at int4 than the fp32 values. `codec.encode_payload` of it is
    `codec.encode(x)`, byte for byte."""
    check_mode(mode)
    x = x.detach().reshape(-1).to(torch.float32)
    if mode in THIN:  # packed on the CPU (a learner sends these from there: learner/offload.py)
        raw = bytearray(pack(_quantize(x, mode, block)[0]))
        return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if mode == "none":
        return x.contiguous().view(torch.uint8)
    if mode == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    q, _ = _quantize_here(x, mode, block)
    if mode == "int8":
        body = q.codes.view(torch.uint8)
    else:
        body = torch.empty(q.codes.numel() // block, block // 2, dtype=torch.uint8, device=x.device)
        _pack_int4(q.codes, block, body)
    return torch.cat([q.scales.view(torch.uint8), body.reshape(-1)])


def unpack(buf: torch.Tensor, mode: str, numel: int, block: int, kernel: Any = None) -> Quantized:
    """The `Quantized` of a payload (uint8, raw_length bytes), every value checked finite and every
    code in range; CodecError if not. With `kernel` (syncer.native.Kernel, which reads them so)
    int4 codes stay packed as in the payload (`Quantized.packed`), checked in one read-only pass.
    The codes and scales returned view `buf`."""
    if mode in ("none", "bf16"):
        empty = torch.empty(0, dtype=torch.float32)
        q = Quantized(mode, numel, block, buf.view(torch.float32 if mode == "none" else torch.bfloat16), empty)
        _check_finite(q)
        return q
    if mode in THIN:
        q = _unpack_thin(buf, mode, numel, block)
        _check_finite(q)
        return q
    nblocks = -(-numel // block)
    scales, codes = buf[: 4 * nblocks].view(torch.float32), buf[4 * nblocks :]
    packed = mode == "int4" and kernel is not None
    if kernel is not None:  # one read-only pass checks the codes and the scales
        codes_ok, scales_ok = kernel.check(codes, scales, QMAX[mode], packed)
        if not codes_ok or not scales_ok:
            raise CodecError(_BAD_NIBBLE if not codes_ok else _BAD_SCALE)
    elif mode == "int4":
        codes = _unpack_int4(codes, block)
    q = Quantized(mode, numel, block, codes if packed else codes.view(torch.int8), scales, packed)
    if kernel is None:
        _check_finite(q)
    return q


def _unpack_thin(buf: torch.Tensor, mode: str, numel: int, block: int) -> Quantized:
    """The `Quantized` of a 2bit or topk payload (codes unpacked to int8, one a value)."""
    if mode == "2bit":
        nblocks = -(-numel // block)
        scales = buf[: 4 * nblocks].view(torch.float32)
        return Quantized(mode, numel, block, thin.unpack_2bit(buf[4 * nblocks :], block), scales)
    try:
        scales, index, codes = thin.split_topk(buf, numel, block)
    except ValueError as exc:
        raise CodecError(str(exc)) from None
    return Quantized(mode, numel, block, codes, scales, index=index)


def _unpack_int4(packed: torch.Tensor, block: int) -> torch.Tensor:
    """int8 codes of an int4 payload's packed codes; refuses the never-produced nibble -8."""
    codes = _unpack_nibbles(packed, block)
    if codes.numel() and int(codes.min()) < -7:
        raise CodecError(_BAD_NIBBLE)
    return codes


def _unpack_nibbles(packed: torch.Tensor, block: int) -> torch.Tensor:
    """int8 codes (a new tensor) of whole int4 blocks, packed (blocks * block/2 bytes, format 2)."""
    src = packed.view(torch.int8).view(-1, block // 2)
    codes = torch.empty(src.shape[0], 2, block // 2, dtype=torch.int8)
    # arithmetic shifts of int8 sign-extend: (b << 4) >> 4 is the low nibble, b >> 4 the high one
    low = codes[:, 0]
    torch.bitwise_left_shift(src, 4, out=low)
    low.bitwise_right_shift_(4)
    torch.bitwise_right_shift(src, 4, out=codes[:, 1])
    return codes.view(-1)


def _check_finite(q: Quantized) -> None:
    if q.mode in QMAX or q.mode == "topk":
        if not q.scales.numel():
            return
        # |code| <= qmax and rounding is monotonic, so every code * scale is finite iff qmax * scale
        # is: one check per block instead of one per value. NaN fails both comparisons below.
        low, high = torch.aminmax(q.scales * QMAX[q.mode if q.mode != "topk" else "2bit"])
        if not (float(low) >= 0 and float(high) < float("inf")):
            raise CodecError(_BAD_SCALE)
    elif q.codes.numel() and not _all_finite(q.codes):
        raise CodecError("NaN or Inf values")


def _all_finite(x: torch.Tensor) -> bool:
    """Whether every value is finite: max and min propagate NaN and show +-Inf (no bool temporary)."""
    return bool(torch.isfinite(x.amax()) and torch.isfinite(x.amin()))


class PayloadWriter:
    """A payload built a slice at a time: `put` quantizes and packs x[start:stop] in place in `raw`
    and returns its dequantized values; the payload is byte for byte `pack(quantize(whole))`
    (slices must start on a block boundary)."""

    def __init__(self, mode: str, numel: int, block: int, scratch: torch.Tensor | None = None) -> None:
        """`scratch`: uint8 CPU memory to build the payload in (used if it holds raw_length bytes):
        a caller building one every round saves an allocation."""
        check_mode(mode)
        self.mode, self.numel, self.block = mode, numel, block
        size = raw_length(mode, numel, block)
        fits = scratch is not None and scratch.dtype == torch.uint8 and scratch.numel() >= size
        self.raw = scratch[:size] if fits and scratch is not None else torch.empty(size, dtype=torch.uint8)
        self.granule = granule(mode, block)
        self.nblocks = -(-numel // self.granule)
        scaled = mode in QMAX or mode == "topk"
        self.scales = self.raw[: 4 * self.nblocks].view(torch.float32) if scaled else None
        self.codes = self.raw[4 * self.nblocks :] if scaled else None

    def put(self, start: int, x: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
        """Quantize x (values start .. start + len(x)) into the payload; `work`, fp32 scratch of
        at least len(x) rounded up to a block (not overlapping x), holds the returned values."""
        stop = start + x.numel()
        if self.mode == "none":
            dst = self.raw.view(torch.float32)[start:stop]
            return dst.copy_(x)
        if self.mode == "bf16":
            dst = self.raw.view(torch.bfloat16)[start:stop]
            dst.copy_(x)
            return work[: x.numel()].copy_(dst)
        if start % self.granule:
            raise ValueError(f"slice start {start} is not a multiple of the block {self.granule}")
        q, values = _quantize(x, self.mode, self.block, want_values=True, out=work)
        self.write(start, q)
        assert values is not None
        return values

    def write(self, start: int, q: Quantized) -> None:
        """Pack the quantized values start .. start + q.numel (a block-mode or topk `q` of this
        writer's mode and block) into their place in the payload."""
        # a mode with scales from here on (MODES is checked in __init__)
        assert self.scales is not None and self.codes is not None
        first, count = start // self.granule, q.scales.numel()
        self.scales[first : first + count] = q.scales
        if self.mode == "topk":
            assert q.index is not None, "a topk Quantized holds its indices"
            thin.put_topk(self.raw, self.numel, self.block, first, q.index, q.codes)
        elif self.mode == "int8":
            self.codes.view(torch.int8)[first * self.block : (first + count) * self.block] = q.codes
        elif self.mode == "2bit":
            thin.pack_2bit(q.codes, self.block, self.codes.view(self.nblocks, self.block // 4)[first : first + count])
        else:
            _pack_int4(q.codes, self.block, self.codes.view(self.nblocks, self.block // 2)[first : first + count])
