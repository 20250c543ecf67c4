"""The blob format of outer gradients and global-fragment changes on the wire (torch + zstandard).

A blob frames the payload `quant` makes of a 1-D fp32 tensor (blockwise int4, int8, bf16 or fp32
values: the quantization math, the packing of codes and their checks live there), zstd-compressed
or not (the run's `zstd` setting). The blob is self-describing:

    header  = MAGIC(2) | format(u8) | mode(u8) | numel(u64) | block(u32) | raw_len(u64)
    payload = zstd( scales fp32[nblocks] | packed codes )          (int4 / int8)
            = zstd( bf16[numel] )  |  zstd( fp32[numel] )            (bf16 / none)

The mode byte is the mode's index in `quant.MODES`. The format byte is the packing version (2),
plus RAW (0x80) when the payload follows the header as it is, without a zstd frame: exactly
raw_len bytes, no more, no fewer. Both kinds decode everywhere; which one an encoder writes is the
caller's choice (`zstd=`). A blob that is malformed, truncated or holds non-finite values is
refused with `CodecError`.
"""

from __future__ import annotations

import struct
import threading
import warnings
from typing import Any

import torch
import zstandard

from syncer.wire import quant
from syncer.wire.quant import CodecError as CodecError  # what every decoder here raises: part of this API
from syncer.wire.quant import Quantized

MAGIC = b"DQ"
FORMAT = 2
RAW = 0x80  # format-byte flag: the payload is stored as it is (no zstd frame)
_HEADER = struct.Struct("<2sBBQIQ")
HEADER_SIZE = _HEADER.size  # bytes before the payload (a zstd frame, or the payload as it is)
MAX_NUMEL = 1 << 34  # a sanity bound: no fragment is 64 GiB of fp32


_local = threading.local()


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    """Per-thread compressor pair (zstandard objects must not be shared across threads)."""
    pair = getattr(_local, "pair", None)
    if pair is None:
        pair = (zstandard.ZstdCompressor(level=1, write_content_size=True), zstandard.ZstdDecompressor())
        _local.pair = pair
    return pair


def encode_payload(payload: torch.Tensor, mode: str, numel: int, block: int, zstd: bool = True) -> bytes:
    """The blob of a payload `quant.payload_here` made (moved to the CPU): header + zstd (or the
    payload as it is, `zstd=False`)."""
    if payload.numel() != quant.raw_length(mode, numel, block):
        raise CodecError(f"payload of {payload.numel()} bytes does not match {mode} x {numel} values")
    # ndarray.data is memoryview(array); numpy's stubs declare the buffer protocol for 3.12+ only
    return _blob(mode, numel, block, payload.contiguous().numpy().data, zstd)


def _blob(mode: str, numel: int, block: int, raw: Any, zstd: bool) -> bytes:
    """Header + payload `raw` (a bytes-like object of exactly raw_length bytes), zstd-compressed
    or stored as it is (format byte | RAW)."""
    nbytes = memoryview(raw).nbytes
    header = _HEADER.pack(MAGIC, FORMAT if zstd else FORMAT | RAW, quant.MODES.index(mode), numel, block, nbytes)
    return header + (_zstd()[0].compress(raw) if zstd else raw)


def encode_quantized(q: Quantized, zstd: bool = True) -> bytes:
    """Pack and compress (`zstd`) an already quantized tensor."""
    return _blob(q.mode, q.numel, q.block, quant.pack(q), zstd)


def encode(x: torch.Tensor, mode: str = "int4", block: int = 128, zstd: bool = True) -> bytes:
    """Quantize, pack and zstd-compress (`zstd`) a 1-D fp32 tensor into one self-describing blob."""
    return encode_quantized(quant.quantize(x, mode, block), zstd)


def _header(blob: bytes, expect_numel: int | None) -> tuple[str, int, int, int, bool]:
    """(mode, numel, block, raw_len, zstd) of a blob, every field checked."""
    if len(blob) < _HEADER.size:
        raise CodecError(f"blob of {len(blob)} bytes is shorter than its {_HEADER.size}-byte header")
    magic, fmt, mode_i, numel, block, raw_len = _HEADER.unpack_from(blob)
    if magic != MAGIC or fmt not in (FORMAT, FORMAT | RAW):
        raise CodecError(f"not a codec blob (magic {magic!r}, format {fmt})")
    if mode_i >= len(quant.MODES):
        raise CodecError(f"unknown compression mode index {mode_i}")
    mode = quant.MODES[mode_i]
    if numel > MAX_NUMEL or (expect_numel is not None and numel != expect_numel):
        raise CodecError(f"blob holds {numel} values, expected {expect_numel}")
    if not quant.valid_block(mode, block):
        raise CodecError(f"invalid block size {block}")
    if raw_len != quant.raw_length(mode, numel, block):
        raise CodecError(f"payload length {raw_len} does not match {mode} x {numel} values")
    return mode, numel, block, raw_len, fmt == FORMAT


def decode_quantized(blob: bytes, expect_numel: int | None = None, kernel: Any = None) -> Quantized:
    """Inverse of `encode_quantized`; raises CodecError on anything malformed or non-finite.

    With `kernel` (syncer.native.Kernel, which reads them so) int4 codes stay packed as on the
    wire (`Quantized.packed`), checked in one read-only pass. The codes and scales returned may
    view `blob` itself (a payload stored without zstd): never write into them."""
    mode, numel, block, raw_len, compressed = _header(blob, expect_numel)
    buf = _payload(blob, raw_len) if compressed else _bytes(_stored(blob, raw_len))
    return quant.unpack(buf, mode, numel, block, kernel)


def _payload(blob: bytes, raw_len: int) -> torch.Tensor:
    """The decompressed payload of a zstd blob (exactly raw_len bytes, else CodecError)."""
    payload = memoryview(blob)[_HEADER.size :]
    try:
        # the frame's own content size decides the allocation: check it before decompressing
        declared = zstandard.frame_content_size(payload)
        if declared not in (-1, raw_len):
            raise CodecError(f"compressed frame declares {declared} bytes, header says {raw_len}")
        if declared == -1:  # no size in the frame (a streaming compressor): read at most raw_len + 1
            return _decompress(payload, raw_len)
        # one call (what every encoder here writes: ~3% faster than a stream reader); zstd checks
        # the content against the declared size, and nothing may follow the frame
        raw = _zstd()[1].decompress(payload, max_output_size=raw_len, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"corrupt compressed payload: {exc}") from exc
    if len(raw) != raw_len:
        raise CodecError(f"payload decompressed to {len(raw)} bytes, header says {raw_len}")
    return _bytes(memoryview(raw))


def _stored(blob: bytes, raw_len: int) -> memoryview:
    """The payload of a blob stored without zstd: exactly raw_len bytes after the header."""
    if len(blob) - _HEADER.size != raw_len:
        raise CodecError(f"stored payload of {len(blob) - _HEADER.size} bytes, header says {raw_len}")
    return memoryview(blob)[_HEADER.size :]


def _bytes(raw: memoryview) -> torch.Tensor:
    """A uint8 tensor viewing `raw` (no copy; a read-only buffer is never written through it)."""
    if not len(raw):  # torch.frombuffer refuses an empty buffer (a 0-value tensor is legal)
        return torch.empty(0, dtype=torch.uint8)
    if not raw.readonly or _readonly_warned:
        return torch.frombuffer(raw, dtype=torch.uint8)
    return _first_readonly(raw)


_readonly_warned = False  # torch warns once per process (TORCH_WARN_ONCE) that it cannot mark a tensor read-only


def _first_readonly(raw: memoryview) -> torch.Tensor:
    """The first read-only view, with torch's one warning about it silenced (catch_warnings is
    costly: every later push of every round would pay it for a warning torch no longer gives)."""
    global _readonly_warned
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(raw, dtype=torch.uint8)
    _readonly_warned = True
    return t


def _decompress(payload: memoryview, raw_len: int) -> torch.Tensor:
    """The frame's content, read straight into a new uint8 tensor of exactly raw_len bytes (not
    zeroed first, no copy after); CodecError if it holds fewer or more."""
    raw = torch.empty(raw_len, dtype=torch.uint8)
    # ndarray.data is memoryview(array); numpy's stubs declare the buffer protocol for 3.12+ only
    view, got = raw.numpy().data, 0
    with _zstd()[1].stream_reader(payload, read_across_frames=False) as reader:
        while got < raw_len:
            n = reader.readinto(view[got:])
            if n == 0:
                break
            got += n
        extra = reader.read(1) if got == raw_len else b""
    if got != raw_len or extra:
        raise CodecError(
            f"payload decompressed to {got + len(extra)}{'+' if extra else ''} bytes, header says {raw_len}"
        )
    return raw


def decode(blob: bytes, expect_numel: int | None = None) -> torch.Tensor:
    """fp32 values of a blob (CPU); raises CodecError on anything malformed or non-finite."""
    # quant.unpack has ruled out non-finite values, including products that overflow fp32
    return quant.dequantize(decode_quantized(blob, expect_numel))


class ChunkEncoder(quant.PayloadWriter):
    """`encode(x)` built a slice at a time: `put` quantizes and packs x[start:stop] in place in
    the payload and returns its dequantized values; `finish` compresses. The blob is byte for
    byte the one `encode` makes of the whole tensor (slices must start on a block boundary)."""

    def __init__(
        self, mode: str, numel: int, block: int, zstd: bool = True, scratch: torch.Tensor | None = None
    ) -> None:
        """`scratch`: uint8 CPU memory to build the payload in (used if it holds raw_length bytes;
        free again once `finish` has returned): a caller encoding every round saves an allocation."""
        super().__init__(mode, numel, block, scratch)
        self.zstd = zstd

    def finish(self) -> bytes:
        """The blob: header + zstd of the payload (or the payload as it is, `zstd=False`)."""
        # ndarray.data is memoryview(array); numpy's stubs declare the buffer protocol for 3.12+ only
        return _blob(self.mode, self.numel, self.block, self.raw.numpy().data, self.zstd)


def blob_info(blob: bytes) -> tuple[str, int]:
    """(mode, numel) of a blob without decompressing it."""
    mode, numel, _block, _raw, _zstd = _header(blob, None)
    return mode, numel
