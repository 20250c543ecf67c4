"""Drive a `learner.link.LinkCore` as its shell would, with real protocol frames and a made-up clock.

`joined()` takes a fresh core through open, hello, welcome and the chunked state fetch, answering
every request with real `state` frames of zeros, so each test starts from a link that is up.
"""

from __future__ import annotations

from typing import Any

import torch

from learner.link import Identity, LinkCore, LinkOutbox
from learner.replica import checksum
from learner.sends import PushItem, Send
from syncer.common.settings import RunSettings
from syncer.wire import codec
from syncer.wire.protocol import Message, encode

N = 16
EPOCH = 3
ME = Identity("learner-1", "inc", "run", 42, "host-a", "cpu", 8, [])


def frames(kind: str, payloads: list[bytes] | None = None, **meta: Any) -> list[bytes]:
    """The frames the syncer would send."""
    return encode(Message(kind, meta, payloads or []))


def new_core(sizes: list[int] | None = None, **run: Any) -> LinkCore:
    return LinkCore(ME, sizes or [N, N], RunSettings(**{"round_clock": "learner", **run}))


def welcome(epoch: int = EPOCH, initialized: bool = True, init_owner: bool = False, step: int = 0) -> list[bytes]:
    return frames(
        "welcome",
        epoch=epoch,
        initialized=initialized,
        init_owner=init_owner,
        versions=[0, 0],
        chunk_numel=1024,
        step=step,
    )


def state_for(core: LinkCore, send: Send, version: int = 0, fill: float = 0.0) -> list[bytes]:
    """The syncer's answer to one state request: the chunk asked for, of a fragment full of `fill`."""
    assert send.msg is not None and send.msg.kind == "state_req"
    p, offset, total = send.msg["fragment"], send.msg["offset"], core.replica.sizes[send.msg["fragment"]]
    whole = torch.full((total,), fill)
    chunk = whole[offset : offset + core.chunk]
    meta = {"fragment": p, "version": version, "offset": offset, "numel": chunk.numel(), "total": total}
    return frames("state", [chunk.numpy().tobytes()], epoch=core.replica.epoch, crc=checksum(whole), **meta)


def kinds(out: LinkOutbox) -> list[str]:
    return [s.msg.kind if s.msg else "push" if s.push else "init" for s in out.sends]


def fetch(core: LinkCore, now: float, version: int = 0) -> float:
    """Answer state requests until the replica is complete; returns the clock."""
    for _ in range(20):
        if core.ready:
            return now
        now += 0.01
        for send in core.tick(now).sends:
            if send.msg is not None and send.msg.kind == "state_req":
                core.receive(now, state_for(core, send, version))
    raise AssertionError("the replica did not complete")


def joined(core: LinkCore | None = None, now: float = 100.0) -> tuple[LinkCore, float]:
    """A core that is up and ready, and the clock at that point."""
    core = core or new_core()
    assert core.tick(now).open
    core.opened(now)
    core.receive(now, welcome())
    return core, fetch(core, now)


def item(p: int, value: float, base: int = 0, steps: int = 8, epoch: int = EPOCH) -> PushItem:
    return PushItem(p, torch.full((N,), value), base, steps, steps * 256, steps * 0.01, 0.01, epoch)


def update(p: int, version: int, contributors: list[str], epoch: int = EPOCH) -> list[bytes]:
    change = codec.encode(torch.full((N,), 0.5), "int8")
    meta = {"fragment": p, "version": version, "from_version": version - 1, "epoch": epoch}
    return frames("update", [change], contributors=contributors, **meta)
