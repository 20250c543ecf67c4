"""The outer gradient's way off a GPU without stalling the inner loop, and a global fragment's way on.

On the CPU nothing changes: an outer gradient is a CPU fp32 tensor that the sender thread
encodes. On CUDA the delta `mark - local` is computed on the device, quantized and packed there
(`quant.payload_here`: int4 codes are 8x fewer bytes over PCIe than fp32), and copied into pinned
host memory with a non-blocking copy that an event marks done. The training thread hands the
`DeviceDelta` to the sender and trains on; the sender waits for the event (the copy, not the
training stream) and zstd-compresses the payload. The blob is byte for byte what `codec.encode`
makes of the same delta on the CPU: the codec's quantization is IEEE multiplies, adds and one
division, identical on any device.

A global fragment goes the other way through pinned memory too (`to_device`): the copy is
queued on the stream and the apply that follows it at the step boundary runs after it, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from syncer.wire import codec, quant


@dataclass
class DeviceDelta:
    """An outer gradient encoded on the GPU, on its way into pinned host memory."""

    payload: torch.Tensor  # uint8, pinned host memory; valid once `done` has fired
    done: Any  # torch.cuda.Event recorded after the copy
    mode: str
    numel: int
    block: int

    def blob(self, zstd: bool = True) -> bytes:
        """The codec blob (the sender thread: waits for the copy, then compresses unless `zstd`
        is off)."""
        self.done.synchronize()
        return codec.encode_payload(self.payload, self.mode, self.numel, self.block, zstd)

    def values(self) -> torch.Tensor:
        """The fp32 values a receiver reconstructs (CPU): what `coalesce` adds when two pushes of
        one fragment wait to leave."""
        return codec.decode(self.blob(), expect_numel=self.numel)


@dataclass(frozen=True)
class Sent:
    """A push already encoded and sent, kept to go again (learner/kept.py): its wire bytes."""

    data: bytes
    numel: int

    def blob(self, zstd: bool = True) -> bytes:
        return self.data

    def values(self) -> torch.Tensor:
        return codec.decode(self.data, expect_numel=self.numel)


Delta = torch.Tensor | DeviceDelta | Sent


def take(delta: torch.Tensor, mode: str, block: int) -> Delta:
    """An outer gradient for the sender: on the CPU the tensor itself; on CUDA encoded there and
    copied out asynchronously (the caller's stream goes on at once)."""
    if delta.device.type != "cuda" or mode in quant.THIN:  # a thin mode adds its residual on the CPU
        return delta.to("cpu", torch.float32)
    payload = quant.payload_here(delta, mode, block)
    host = torch.empty(payload.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(payload, non_blocking=True)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event() unannotated
    done.record()
    return DeviceDelta(host, done, mode, delta.numel(), block)


def blob(delta: Delta, mode: str, block: int, zstd: bool = True) -> bytes:
    """The push's codec blob, wherever its outer gradient was encoded (`zstd`: the run's setting)."""
    if isinstance(delta, (DeviceDelta, Sent)):
        return delta.blob(zstd)
    return codec.encode(delta, mode, block, zstd)


def values(delta: Delta) -> torch.Tensor:
    """fp32 CPU values of an outer gradient (a DeviceDelta: as the syncer will decode them)."""
    return delta.values() if isinstance(delta, (DeviceDelta, Sent)) else delta


def to_device(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU fp32 global fragment on `device`: through pinned memory without blocking on CUDA
    (the pinned block is kept until the copy is done by torch's caching host allocator)."""
    if device.type != "cuda":
        return value.to(device)
    return value.pin_memory().to(device, non_blocking=True)
