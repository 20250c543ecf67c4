"""How the data-parallel baseline's ranks average gradients, and what that costs on the wire.

Two reducers for `bench/ddp_worker.py` (its config "reducer"): DDP's stock all-reduce comm hook
plus a counter of the bytes it hands to all-reduce (`counting_allreduce_hook`, state in
`CommCounter`), or the explicit bucketed `dist.all_reduce` after backward (`FlatAllReduce`); and
`ring_wire_bytes`, the traffic a ring all-reduce of those bytes puts on each rank's link. Each
reducer is a `bench.baseline_loop.Strategy` (`reducer(...)`): the one inner loop the baselines
share runs its backward through it.
The worker runs as a script under torchrun: it puts the checkout on sys.path, then imports this as
`bench.ddp_comm`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.baseline_loop import Strategy


@dataclass
class CommCounter:
    """State of the counting comm hook."""

    process_group: Any = None
    payload_bytes: int = 0
    last_ready: float = 0.0


def counting_allreduce_hook(state: CommCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce (sum, then divide by world), counting the bucket's bytes."""
    buf = bucket.buffer()
    state.payload_bytes += buf.numel() * buf.element_size()
    state.last_ready = time.perf_counter()
    return allreduce_hook(state.process_group, bucket)


# DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings
counting_allreduce_hook.__annotations__.update(
    bucket=dist.GradBucket, state=CommCounter, **{"return": torch.futures.Future[torch.Tensor]}
)


class FlatAllReduce:
    """Gradient averaging by hand: flat fp32 buckets, `dist.all_reduce` (sum), divide by world."""

    def __init__(self, model: torch.nn.Module, world: int, bucket_mb: float, payload_bytes: int = 0) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world, self.payload_bytes = world, payload_bytes
        cap = max(1, int(bucket_mb * (1 << 20)))
        self.buckets: list[list[torch.nn.Parameter]] = [[]]
        for p in reversed(self.params):  # like DDP: the last layers' gradients are ready first
            size = sum(q.numel() * q.element_size() for q in self.buckets[-1])
            if self.buckets[-1] and size + p.numel() * p.element_size() > cap:
                self.buckets.append([])
            self.buckets[-1].append(p)

    def broadcast_params(self) -> None:
        """Rank 0's parameters on every rank (what DDP does at construction)."""
        for bucket in self.buckets:
            flat = torch.cat([p.detach().reshape(-1) for p in bucket])
            dist.broadcast(flat, src=0)
            with torch.no_grad():
                for p, value in zip(bucket, flat.split([q.numel() for q in bucket])):
                    p.copy_(value.view_as(p))

    def reduce(self) -> float:
        """Average every gradient across ranks; returns the seconds spent (all of it blocked)."""
        t0 = time.perf_counter()
        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.payload_bytes += flat.numel() * flat.element_size()
            dist.all_reduce(flat)
            flat.div_(self.world)
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p)
                offset += n
        return time.perf_counter() - t0


class DDPReduce(Strategy):
    """DistributedDataParallel: bucketed all-reduce overlapped with backward, its bytes counted.
    Exposed: what backward() spent after the last bucket became ready (local backward done)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, payload_bytes: int) -> None:
        ids = [device.index] if device.type == "cuda" else None
        self.comm = CommCounter(payload_bytes=payload_bytes)
        ddp = DDP(model, device_ids=ids, forward_sync_buffers=False)
        ddp.register_comm_hook(self.comm, counting_allreduce_hook)
        super().__init__(ddp)

    @property
    def payload_bytes(self) -> int:
        return self.comm.payload_bytes

    def backward(self, loss: torch.Tensor, began: float) -> float:
        self.comm.last_ready = began
        loss.backward()  # the comm hook all-reduces the buckets as they fill
        return max(0.0, time.perf_counter() - self.comm.last_ready)


class FlatReduce(Strategy):
    """No DDP: after backward, the explicit bucketed all-reduce (`FlatAllReduce`), all of it exposed."""

    def __init__(self, model: torch.nn.Module, world: int, bucket_mb: float, payload_bytes: int) -> None:
        super().__init__(model)
        self.flat = FlatAllReduce(model, world, bucket_mb, payload_bytes)
        self.flat.broadcast_params()

    @property
    def payload_bytes(self) -> int:
        return self.flat.payload_bytes

    def backward(self, loss: torch.Tensor, began: float) -> float:
        loss.backward()
        return self.flat.reduce()


def reducer(
    name: str, model: torch.nn.Module, device: torch.device, world: int, bucket_mb: float, payload_bytes: int
) -> DDPReduce | FlatReduce:
    """The worker config's "reducer": "ddp" or "flat" (counting on from `payload_bytes`)."""
    if name == "flat":
        return FlatReduce(model, world, bucket_mb, payload_bytes)
    return DDPReduce(model, device, payload_bytes)


def ring_wire_bytes(payload_bytes: float, world: int) -> float:
    """Bytes one rank sends (and receives) in a ring all-reduce of `payload_bytes`."""
    return 2.0 * (world - 1) / world * payload_bytes if world > 1 else 0.0
