"""The codecs below int4 (a leaf: torch only): 2-bit blockwise codes and chunkwise top-k.

For links too thin for int4 (docs/tuning.md, "Thin links"). Both lose far more of a tensor than
int4 does, so a sender keeps what it did not send and adds it to its next tensor (error
feedback: learner/feedback.py upstream, the syncer's residual downstream); what each decoder
computes is still one IEEE multiply per value, `code * scale`, so every replica stays
bit-identical to the syncer's.

2bit: one scale per block, as int4, and codes the odd integers -3, -1, 1, 3 (the levels
+-scale and +-3 scale, scale fit to the block: `quantize_2bit`; no zero level: error feedback
carries the difference). Packed four a byte, block by block: byte j of a block's block/4 bytes holds the
block's codes j, j + b/4, j + b/2 and j + 3b/4 at bits 0, 2, 4 and 6, each as (code + 3) / 2.
Every 2-bit pattern is a valid code.

topk: per chunk of C values, the k of largest magnitude (C = 4,096, k = 64 by default: 1.6%),
their within-chunk indices increasing, and their values 2-bit coded with one scale per chunk:

    scales fp32[chunks] | index int16[chunks * k] | 2-bit codes[chunks * k / 4] (block k)

The codec header's block field carries both: C | k << 16 (`topk_block`). The last chunk is
zero-padded; an index may point into the padding (its value is dropped). A decoder refuses an
index outside the chunk or not increasing (no value written twice).
"""

from __future__ import annotations

import torch

QMAX_2BIT = 3
TOPK_CHUNK = 4096  # values per top-k chunk (indices fit int16)
MAX_CHUNK = 1 << 15
_ROUNDER = 1.5 * 2.0**23  # y + R - R rounds an fp32 |y| < 2^22 to the nearest integer (ties to even)


def topk_block(keep: int, chunk: int = TOPK_CHUNK) -> int:
    """The header's block field of top-`keep`-of-`chunk`."""
    return chunk | keep << 16


def topk_shape(block: int) -> tuple[int, int]:
    """(chunk, keep) of a top-k block field."""
    return block & 0xFFFF, block >> 16


def valid_2bit(block: int) -> bool:
    """Whether a 2-bit block can be packed (whole bytes of four codes)."""
    return 4 <= block <= 1 << 20 and not block % 4


def valid_topk(block: int) -> bool:
    """Whether a top-k block field names a chunk of whole bytes and a whole-byte count kept."""
    chunk, keep = topk_shape(block)
    return 4 <= chunk <= MAX_CHUNK and 4 <= keep <= chunk and not keep % 4


def length_2bit(numel: int, block: int) -> int:
    """Payload bytes of 2-bit codes: scales, then four codes a byte."""
    nblocks = -(-numel // block)
    return 4 * nblocks + nblocks * block // 4


def length_topk(numel: int, block: int) -> int:
    """Payload bytes of top-k: scales, int16 indices, 2-bit codes."""
    chunk, keep = topk_shape(block)
    chunks = -(-numel // chunk)
    return 4 * chunks + 2 * chunks * keep + chunks * keep // 4


def quantize_2bit(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int8 flat, scales, float codes (blocks, block)) of xb (blocks, block) fp32.

    Each value to the nearest of -3, -1, 1, 3 times a first scale of rms / 2 (levels at 0.5 and
    1.5 rms, near the 4-level optimum for a bell-shaped block; larger values clip to 1.5 rms and
    error feedback carries the rest), then the block's scale refit to the least-squares one for
    those codes, sum(x * code) / sum(code^2) (never negative: a code has its value's sign)."""
    rms = xb.square().mean(dim=1).sqrt_()
    inv = torch.where(rms > 0, 2.0 / rms.clamp_min(1e-30), torch.zeros_like(rms))
    # the nearest odd integer to y is 2 * round((y - 1) / 2) + 1 (ties to even); clamped to [-3, 3]
    codes_f = (xb * inv[:, None]).sub_(1.0).mul_(0.5).add_(_ROUNDER).sub_(_ROUNDER).mul_(2.0).add_(1.0)
    codes_f.clamp_(-QMAX_2BIT, QMAX_2BIT)
    scales = (xb * codes_f).sum(dim=1).div_(codes_f.square().sum(dim=1)).clamp_min_(0.0)
    return codes_f.to(torch.int8).view(-1), scales, codes_f


def pack_2bit(codes: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """int8 codes of whole blocks -> out (blocks, block/4) uint8 (module docstring)."""
    u = codes.add(QMAX_2BIT).bitwise_right_shift_(1).view(torch.uint8).view(-1, 4, block // 4)
    out.copy_(u[:, 0])
    for j in (1, 2, 3):
        out.bitwise_or_(torch.bitwise_left_shift(u[:, j], 2 * j))


def unpack_2bit(packed: torch.Tensor, block: int) -> torch.Tensor:
    """int8 codes (a new tensor) of whole 2-bit blocks, packed (blocks * block/4 bytes)."""
    src = packed.view(-1, block // 4)
    codes = torch.empty(src.shape[0], 4, block // 4, dtype=torch.uint8)
    for j in range(4):
        torch.bitwise_right_shift(src, 2 * j, out=codes[:, j]).bitwise_and_(3)
    return codes.view(torch.int8).mul_(2).sub_(QMAX_2BIT).view(-1)


def select_topk(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index int64 (chunks, keep), increasing per row; kept values (chunks, keep)) of a flat fp32
    x: per chunk, the `keep` values of largest magnitude."""
    chunk, keep = topk_shape(block)
    pad = (-x.numel()) % chunk
    xb = (torch.nn.functional.pad(x, (0, pad)) if pad else x.contiguous()).view(-1, chunk)
    index = xb.abs().topk(keep, dim=1, sorted=False).indices.sort(dim=1).values
    return index, xb.gather(1, index)


def scatter(index: torch.Tensor, products: torch.Tensor, chunk: int, out: torch.Tensor) -> torch.Tensor:
    """out[:chunks * chunk] zeroed, then each chunk's kept products written at their indices;
    returns that (chunks * chunk) view."""
    dst = out[: index.shape[0] * chunk].zero_().view(-1, chunk)
    dst.scatter_(1, index, products)
    return dst.view(-1)


def split_topk(buf: torch.Tensor, numel: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scales fp32, index int64 (chunks, keep), codes int8) of a top-k payload; ValueError on an
    index outside its chunk or not increasing."""
    chunk, keep = topk_shape(block)
    chunks = -(-numel // chunk)
    scales = buf[: 4 * chunks].view(torch.float32)
    index = buf[4 * chunks : 4 * chunks + 2 * chunks * keep].view(torch.int16).to(torch.int64).view(chunks, keep)
    codes = unpack_2bit(buf[4 * chunks + 2 * chunks * keep :], keep)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= chunk):
        raise ValueError(f"top-k index outside its chunk of {chunk}")
    if keep > 1 and index.numel() and not bool((index[:, 1:] > index[:, :-1]).all()):
        raise ValueError("top-k indices not increasing within a chunk")
    return scales, index, codes


def put_topk(raw: torch.Tensor, numel: int, block: int, first: int, index: torch.Tensor, codes: torch.Tensor) -> None:
    """Write chunks [first, first + len(index)) of a top-k payload's indices and codes into `raw`
    (its scales are the caller's: they sit where blockwise scales do)."""
    chunk, keep = topk_shape(block)
    chunks = -(-numel // chunk)
    count = index.shape[0]
    idx = raw[4 * chunks : 4 * chunks + 2 * chunks * keep].view(torch.int16).view(chunks, keep)
    idx[first : first + count] = index.to(torch.int16)
    body = raw[4 * chunks + 2 * chunks * keep :].view(chunks, keep // 4)
    pack_2bit(codes, keep, body[first : first + count])
