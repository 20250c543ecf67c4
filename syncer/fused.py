"""The round step of one fragment, cache-blocked: merge, Nesterov outer step and publish, slice by slice.

The reference arithmetic (merge.merge, merge.nesterov_change_, quant.quantize_roundtrip) walks
whole fragments: ten-odd passes over fragment-sized fp32 vectors, every contribution decoded to
fp32 first. Here contributions stay in their wire precision (`quant.Quantized`: block scales and
codes, int8 one a byte or int4 still packed two a byte) and the fragment is walked twice in slices small
enough to stay in the core's L2 cache:

  1. `gram`: per tensor segment, G[m, n] = <v_m, v_n> over the contributions (one small matmul
     per slice piece). Its diagonal gives the norms (robust clipping, RDA); the norm of the RDA
     direction sum_m c_m v_m is sqrt(c^T G c), known before that sum is formed.
  2. `publish`: per slice, decode the contributions, merged = coef^T V (one matmul per segment
     piece, coefficients from merge.coefficients), Nesterov on the slice of the momentum and
     residual, quantize and pack it into the update payload (codec.ChunkEncoder), theta +=
     the dequantized values (a separate fp32 add, as every learner does), residual -= them, and
     the running crc32 of the new theta.

The published values are bit-identical to what a learner decodes from the blob; the merged
gradient agrees with the reference to fp32 rounding (the sums run in another order).

`kernel` (syncer/native: the same two loops in C, injected by the server) takes over when every
contribution is int4/int8 coded with the output's block: one pass per loop instead of a dozen
torch operations per slice, reading int4 codes still packed (two a byte, as they came) and
unpacking one block at a time in the L1 cache. Its Gram matrices come from integer dot products
of the codes (AVX-512 VNNI where the CPU has it); the crc32 of the new fragment is its carry-less
one (5x zlib's speed), and the update payload is built in memory kept from round to round.
Pure: torch, zlib.crc32 and the codec (no I/O).
"""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from syncer import merge
from syncer.wire import codec, quant

SLICE = 1 << 18  # values per slice: big enough that per-op overhead is small, M + 4 slices stay in L3
NATIVE_MAX_BLOCK = 4096  # fused.c MAX_BLOCK
NATIVE_MAX_CONTRIBUTIONS = 256  # fused.c MAX_M: pushes in one round (a learner that pushed twice counts twice)
Segments = Sequence[tuple[int, int, str]]
_local = threading.local()


def slice_size(deltas: Sequence[quant.Quantized], granule: int, numel: int) -> int:
    """A slice length near SLICE that every block size (inputs' and the output's `granule`,
    quant.granule) divides."""
    step = granule
    for d in deltas:
        step = math.lcm(step, quant.granule(d.mode, d.block))
    size = max(step, SLICE // step * step)
    return min(size, -(-max(numel, 1) // step) * step)


def _pieces(segments: Segments, numel: int, size: int) -> Iterator[tuple[int, int, list[tuple[int, int, int]]]]:
    """(start, stop, [(segment, lo, hi), ...]) per slice, lo/hi relative to the slice start."""
    s = 0
    for start in range(0, numel, size):
        stop = min(numel, start + size)
        parts = []
        while s < len(segments) and segments[s][0] < stop:
            offset, n, _ = segments[s]
            lo, hi = max(offset, start), min(offset + n, stop)
            if hi > lo:
                parts.append((s, lo - start, hi - start))
            if offset + n > stop:
                break
            s += 1
        yield start, stop, parts


def _decode(deltas: Sequence[quant.Quantized], start: int, stop: int, rows: torch.Tensor) -> torch.Tensor:
    """rows[m, :stop - start] = values [start, stop) of contribution m; returns that (M, L) view."""
    for m, d in enumerate(deltas):
        quant.values_into(d, start, stop, rows[m])
    return rows[:, : stop - start]


def _scratch(nbytes: int) -> torch.Tensor:
    """This thread's payload scratch memory, grown to at least `nbytes` (the update payload is
    built in it every round and copied out by zstd or into the blob: no fresh pages per round)."""
    buf: torch.Tensor | None = getattr(_local, "payload", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.payload = torch.empty(nbytes, dtype=torch.uint8)
    return buf


def native_fits(deltas: Sequence[quant.Quantized], block: int, mode: str | None = None) -> bool:
    """Whether the native kernel handles these contributions (and this output mode)."""
    return (
        all(d.mode in ("int4", "int8") and d.block == block for d in deltas)
        and block <= NATIVE_MAX_BLOCK
        and len(deltas) <= NATIVE_MAX_CONTRIBUTIONS
        and (mode is None or mode in ("int4", "int8"))
    )


def _native_args(deltas: Sequence[quant.Quantized]) -> tuple[list[torch.Tensor], list[bool], list[torch.Tensor]]:
    """The kernel's view of the contributions: codes (int4 packed or int8), packed flags, scales."""
    return [d.codes for d in deltas], [d.packed for d in deltas], [d.scales for d in deltas]


def _bounds(segments: Segments, numel: int) -> torch.Tensor:
    return torch.tensor([o for o, _, _ in segments] + [numel], dtype=torch.int64)


def gram(deltas: Sequence[quant.Quantized], segments: Segments, block: int, kernel: Any = None) -> torch.Tensor | None:
    """(segments, M, M) float64: per segment, the Gram matrix of the contributions; None if any
    entry overflowed fp32 (values near 1e19: the caller falls back to the reference path)."""
    numel = deltas[0].numel
    grams = torch.zeros(len(segments), len(deltas), len(deltas), dtype=torch.float64)
    if kernel is not None and native_fits(deltas, block):
        codes, packed, scales = _native_args(deltas)
        kernel.gram(codes, packed, scales, block, _bounds(segments, numel), grams)
        return grams if bool(torch.isfinite(grams).all()) else None
    size = slice_size(deltas, block, numel)
    rows = torch.empty(len(deltas), size, dtype=torch.float32)
    for start, stop, parts in _pieces(segments, numel, size):
        v = _decode(deltas, start, stop, rows)
        for s, lo, hi in parts:
            piece = v[:, lo:hi]
            grams[s] += torch.mm(piece, piece.t()).double()
    return grams if bool(torch.isfinite(grams).all()) else None


def publish(
    deltas: Sequence[quant.Quantized],
    coefs: torch.Tensor,
    segments: Segments,
    theta: torch.Tensor,
    momentum: torch.Tensor,
    residual: torch.Tensor,
    lr: float,
    beta: float,
    mode: str,
    block: int,
    kernel: Any = None,
    want_crc: bool = True,
    zstd: bool = True,
    share: float = 1.0,
) -> tuple[bytes, int | None]:
    """Merge (coefs: (segments, M) fp32), outer step and publish; returns (blob, zstd-compressed
    unless `zstd` is False, and the crc32 of theta, or None unless `want_crc`).

    In place, slice by slice:  g = merged gradient;  momentum <- g + decay * momentum;
    residual <- residual - lr * g - lr * look * momentum  (the change to publish);
    theta <- theta + dequantize(quantize(residual));  residual <- residual - that;
    (decay, look) = merge.partial_momentum(beta, share): both beta for a round of a whole period.
    """
    numel = theta.numel()
    decay, look = merge.partial_momentum(beta, share)
    if kernel is not None and native_fits(deltas, block, mode):
        encoder = codec.ChunkEncoder(mode, numel, block, zstd, _scratch(quant.raw_length(mode, numel, block)))
        codes, packed, scales = _native_args(deltas)
        kernel.publish(
            codes,
            packed,
            scales,
            block,
            coefs.contiguous(),
            _bounds(segments, numel),
            (theta, momentum, residual),
            lr,
            (decay, look),
            7 if mode == "int4" else 127,
            encoder.scales,
            encoder.codes,
        )
        return encoder.finish(), kernel.crc32(theta) if want_crc else None
    size = slice_size(deltas, quant.granule(mode, block), numel)
    rows = torch.empty(len(deltas), size, dtype=torch.float32)
    merged = torch.empty(size, dtype=torch.float32)
    encoder = codec.ChunkEncoder(mode, numel, block, zstd, _scratch(quant.raw_length(mode, numel, block)))
    crc = 0
    for start, stop, parts in _pieces(segments, numel, size):
        v = _decode(deltas, start, stop, rows)
        g = merged[: stop - start]
        for s, lo, hi in parts:
            torch.mm(coefs[s : s + 1], v[:, lo:hi], out=g[lo:hi].view(1, -1))
        buf, change, values = momentum[start:stop], residual[start:stop], theta[start:stop]
        torch.add(g, buf, alpha=decay, out=buf)
        change.add_(g, alpha=-lr).add_(buf, alpha=-lr * look)
        applied = encoder.put(start, change, merged)  # g is dead: its memory is the work area
        values.add_(applied)
        change.sub_(applied)
        if want_crc:
            crc = zlib.crc32(values.numpy().data, crc)
    return encoder.finish(), crc if want_crc else None
