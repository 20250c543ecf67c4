"""What a learner sends the syncer that is more than a header: pushes and chunks of the first
upload (`Send`), an outer gradient waiting to leave (`PushItem`), the one push a fragment's
unsent ones fold into (`coalesce`), and the push message built from one (`push_meta`,
`push_message`: called by the link's shell outside its lock, its only state the error
feedback it is handed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from learner import offload
from learner.feedback import ErrorFeedback
from syncer.common.settings import RunSettings
from syncer.wire import quant
from syncer.wire.protocol import Message


@dataclass(frozen=True)
class PushItem:
    """An outer gradient waiting to leave (CPU fp32, or encoded on a GPU: learner/offload.py), with
    its counters."""

    fragment: int
    delta: offload.Delta
    base_version: int
    c_steps: int
    c_tokens: int
    c_time: float
    step_time: float
    base_epoch: int = 0  # the syncer epoch in which base_version was applied
    last: bool = False  # the partial window of a learner stopped by a signal (kept out at `down`)
    units: tuple[int, ...] = ()  # work units whose last sequence was trained in this window (the data ledger)
    resent: bool = False  # kept after it left, going again to a restarted syncer (learner/kept.py)


def coalesce(older: PushItem | None, newer: PushItem) -> PushItem:
    """The one push to send for a fragment whose earlier push has not left yet.

    Outer gradients taken from the same base telescope, (mark0 - x1) + (x1 - x2) = mark0 - x2,
    so the sum, with the counters summed, is exactly the outer gradient of all the steps since
    that base: the work of a learner cut off from the syncer reaches the model when it is back
    (the fragment "stays due", ALGORITHM.md). If a global value was applied in between (another
    base), the older one is dropped: newest wins (a sum is never `last`: it holds earlier work).
    An outer gradient already encoded on a GPU
    enters the sum as the values the syncer would have decoded (one quantization more: rare, a
    push waits only while the link is down)."""
    if older is None or (older.base_version, older.base_epoch) != (newer.base_version, newer.base_epoch):
        return dataclasses.replace(newer, units=older.units + newer.units) if older and older.units else newer
    return PushItem(
        newer.fragment,
        offload.values(older.delta) + offload.values(newer.delta),
        newer.base_version,
        older.c_steps + newer.c_steps,
        older.c_tokens + newer.c_tokens,
        older.c_time + newer.c_time,
        newer.step_time,
        newer.base_epoch,
        units=older.units + newer.units,
    )


@dataclass(frozen=True)
class InitChunk:
    """One chunk of the first upload of the global model (its values come from the trainer)."""

    fragment: int
    offset: int
    numel: int
    total: int


@dataclass(frozen=True)
class Send:
    """One message to send: ready (`msg`), a push to encode, or a chunk of the first upload."""

    msg: Message | None = None
    push: PushItem | None = None
    seq: int = 0  # the push's sequence number (increasing within an incarnation)
    init: InitChunk | None = None

    @property
    def block(self) -> bool:
        """Upload chunks wait for the socket; everything else is dropped if it cannot leave now."""
        return self.init is not None


def push_meta(send: Send) -> dict[str, Any]:
    """The push message's metadata for a push send: fragment, versions, sequence and counters."""
    item = send.push
    assert item is not None, "a push send carries its push"
    return {
        "fragment": item.fragment,
        "base_version": item.base_version,
        "seq": send.seq,
        "epoch": item.base_epoch,
        "c_steps": item.c_steps,
        "c_tokens": item.c_tokens,
        "c_time": item.c_time,
        "step_time": item.step_time,
        **({"last": True} if item.last else {}),
        **({"units": list(item.units)} if item.units else {}),
    }


def push_message(send: Send, settings: RunSettings, feedback: ErrorFeedback | None = None) -> Message:
    """The push message for a push send (CPU-heavy for a large fragment: call it unlocked). An
    fp32 outer gradient is coded through `feedback` (its residual added under a thin codec:
    the caller commits or discards it once it knows whether the push left)."""
    item = send.push
    assert item is not None, "a push send carries its push"
    block = quant.wire_block(settings.compression, settings.block, settings.topk_keep)
    if isinstance(item.delta, torch.Tensor):
        coder = feedback or ErrorFeedback()
        blob = coder.encode(item.fragment, item.delta, settings.compression, block, settings.zstd)
    else:
        blob = offload.blob(item.delta, settings.compression, block, settings.zstd)
    return Message("push", push_meta(send), [blob])
