"""One synthetic learner's link to one syncer shard (bench/loadgen_worker.py runs many).

`ShardLink` is the real learner's link (`learner.link.LinkCore`: hello with backoff, welcome,
the first upload when it owns the initialization, chunked state fetches, heartbeats, the push
queue, Paranoid Pirate reconnects, round calls) behind its own DEALER socket and CURVE key,
exactly as `learner.client.SyncerClient` drives it, minus the model and the thread. A learner of
a sharded syncer holds one per shard (learner/syncerlink.py): the link speaks the shard's local
fragment numbers (0..k-1, syncer/wire/shards.py) and carries `ShardRole`, so the shard's welcome
is checked against the map the learner computed; `owned` maps local numbers back to global ones.

- its replica (`LeanReplica`) keeps versions, not values: fetched state chunks are checked and
  dropped, update blobs are decoded (when `decode`) and dropped;
- a push carries one of a few outer gradients encoded once by the parent (`Blobs`, int4 + zstd
  of realistic statistics), so the worker spends its time on the protocol, not on encoding;
- each reply to a push is recorded as a `loadgen_core.Reply` dict, with the shard and the
  global fragment, and an update of a pushed fragment that does not list us is a missed round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from learner.link import Identity, LinkCore
from learner.replica import Fetch, Replica
from learner.sends import Send, push_meta
from syncer.common import keys
from syncer.common.settings import RunSettings
from syncer.wire import codec
from syncer.wire.protocol import Message, encode

EMPTY = torch.empty(0)  # the replica keeps no values; a push's delta travels as a pre-encoded blob


@dataclass(frozen=True)
class Shard:
    """A syncer shard: its address and the global fragments it owns, in its local order (one
    shard owning every fragment: an unsharded syncer)."""

    address: str
    fragments: tuple[int, ...]


def check_shards(shards: tuple[Shard, ...], fragments: int) -> None:
    """ValueError unless the shards own every fragment of the run exactly once."""
    owned = sorted(p for s in shards for p in s.fragments)
    if not shards or owned != list(range(fragments)):
        raise ValueError(f"the shards own fragments {owned}, not each of 0..{fragments - 1} once")


class LeanReplica(Replica):
    """A replica that tracks versions only: state chunks and update blobs are taken in, checked
    (chunks by the link, blobs by decoding them where `decode`), counted and dropped."""

    def __init__(self, sizes: list[int], decode: bool) -> None:
        super().__init__(sizes)
        self.decode = decode
        self.decoded = 0
        self.applied: list[tuple[int, int]] = []  # (fragment, version) applied since the shell last looked

    def on_state(self, p: int, version: int, offset: int, values: np.ndarray, crc: int | None = None) -> bool:
        f = self.fetches.get(p)
        if f is None or offset not in f.in_flight:
            return False
        if f.version is None:
            f.version, f.crc = version, crc
        elif version != f.version:
            self.fetches[p] = Fetch(pending=f.pending)
            return False
        del f.in_flight[offset]
        f.received += values.size
        if f.received < self.sizes[p]:
            return False
        assert f.version is not None
        self.latest[p], self.versions[p], self.crcs[p] = EMPTY, f.version, f.crc
        del self.fetches[p]
        for from_version, v, blob, c in sorted(f.pending, key=lambda u: u[1]):
            if self.on_update(p, from_version, v, blob, c) in ("gap", "mismatch"):
                break
        return True

    def on_update(self, p: int, from_version: int, version: int, blob: bytes, crc: int | None = None) -> str:
        if p in self.fetches:
            pending = self.fetches[p].pending
            pending.append((from_version, version, blob, crc))
            del pending[:-64]
            return "buffered"
        if self.latest[p] is None or version <= self.versions[p]:
            return "stale"
        if from_version != self.versions[p]:
            self.refetch(p)
            return "gap"
        if self.decode:
            codec.decode(blob, expect_numel=self.sizes[p])  # what a learner pays before its add
            self.decoded += 1
        self.versions[p], self.crcs[p] = version, crc
        self.applied.append((p, version))
        return "applied"


class Blobs:
    """The pre-encoded outer gradients (a few per global fragment) and a chunk of initial values."""

    def __init__(self, files: dict[int, list[str]], seed: int) -> None:
        self.by_fragment = {p: [Path(f).read_bytes() for f in paths] for p, paths in files.items()}
        self._init: bytes | None = None
        self.seed = seed

    def pick(self, p: int, turn: int) -> bytes:
        choices = self.by_fragment[p]
        return choices[turn % len(choices)]

    def init_chunk(self, numel: int) -> bytes:
        """fp32 values for an upload chunk (one random chunk, reused: the values do not matter)."""
        if self._init is None or len(self._init) < 4 * numel:
            g = torch.Generator().manual_seed(self.seed)
            self._init = (torch.randn(max(numel, 1 << 20), generator=g) * 0.02).numpy().tobytes()
        return self._init[: 4 * numel]


@dataclass
class Outstanding:
    """A push that left and has no reply yet."""

    pushed_at: float  # wall clock
    missed: int = 0


COUNTERS = ("updates", "refetches", "reconnects", "bad_messages", "bytes_sent", "bytes_received")


class ShardLink:
    """One learner's LinkCore, socket and push accounting for one shard (local fragment numbers)."""

    def __init__(
        self,
        me: Identity,
        index: int,
        shard: Shard,
        sizes: list[int],
        settings: RunSettings,
        ctx: zmq.Context[zmq.Socket[bytes]],
        blobs: Blobs,
        keys_dir: str | None,
        decode: bool,
    ) -> None:
        self.lid, self.index, self.shard = me.learner, index, me.role.index
        self.address, self.owned = shard.address, shard.fragments
        self.ctx, self.blobs, self.keys_dir = ctx, blobs, keys_dir
        self.core = LinkCore(me, [sizes[p] for p in shard.fragments], settings)
        self.core.replica = self.replica = LeanReplica(self.core.replica.sizes, decode)
        self.sock: zmq.Socket[bytes] | None = None
        self.outstanding: dict[int, Outstanding] = {}  # local fragment -> its push in flight
        self.replies: list[dict[str, Any]] = []
        self.pushes = self.missed_updates = self.fetched_replies = 0

    def tick(self, now: float) -> None:
        """learner/client.py `_cycle` minus the poll: what the time asks for, carried out."""
        out = self.core.tick(now)
        if out.close:
            self.close_socket()
        if out.open:
            self._open(now)
        failed: set[str] = set()  # after one push or upload chunk cannot leave, the later ones go back
        for send in out.sends:
            kind = "push" if send.push is not None else "init" if send.init is not None else "msg"
            if kind in failed or not self._send(send):
                if kind != "msg":
                    failed.add(kind)
                self.core.unsent(send)

    # -- socket ------------------------------------------------------------------------------
    def _open(self, now: float) -> None:
        """A DEALER socket set up like learner/client.py's (Paranoid Pirate: LINGER 0, IMMEDIATE)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.SNDTIMEO, 5000)
        if self.keys_dir is not None:
            keydir = Path(self.keys_dir)
            sock.curve_publickey, sock.curve_secretkey = keys.load_pair(keydir / f"{self.lid}.key_secret")
            sock.curve_serverkey = keys.load_public(keydir / "syncer.key")
        sock.connect(self.address)
        self.sock = sock
        self.core.opened(now)

    def close_socket(self, linger_ms: int = 0) -> None:
        if self.sock is not None:
            self.sock.close(linger=linger_ms)
            self.sock = None

    def _send(self, send: Send) -> bool:
        if self.sock is None:
            return False
        frames = encode(self._message(send))
        try:
            self.sock.send_multipart(frames, flags=0 if send.block else zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        self.core.sent(send, sum(len(f) for f in frames))
        if send.push is not None:
            q = send.push.fragment
            self.outstanding[q] = Outstanding(time.time(), self.outstanding[q].missed if q in self.outstanding else 0)
            self.pushes += 1
        return True

    def _message(self, send: Send) -> Message:
        """learner/link.py `push_message` with a pre-encoded blob; upload chunks of random values."""
        if send.push is not None:
            blob = self.blobs.pick(self.owned[send.push.fragment], self.index + self.pushes)
            return Message("push", push_meta(send), [blob])
        if send.init is not None:
            c = send.init
            meta = {"fragment": c.fragment, "offset": c.offset, "numel": c.numel, "total": c.total}
            return Message("init", meta, [self.blobs.init_chunk(c.numel)])
        assert send.msg is not None, "a send is a message, a push or an upload chunk"
        return send.msg

    def receive_all(self, now: float) -> None:
        """Every waiting message into the link; each reply to a push is recorded with its times."""
        while self.sock is not None:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            received_at = time.time()
            self.core.receive(now, frames)
            self._account(received_at)

    def _account(self, received_at: float) -> None:
        """A reply is an update whose round merged our push (LinkCore's replies); an update of a
        fragment whose push is out that does not list us is a round our push missed."""
        replies, _ = self.core.take_updates()
        applied, self.replica.applied = self.replica.applied, []
        for q, version in applied:
            o = self.outstanding.get(q)
            if o is None:
                continue
            if q not in replies:
                o.missed += 1
                self.missed_updates += 1
                continue
            del self.outstanding[q]
            self.replies.append(
                {
                    "learner": self.lid,
                    "fragment": self.owned[q],
                    "version": version,
                    "pushed_at": o.pushed_at,
                    "received_at": received_at,
                    "missed": o.missed,
                    "shard": self.shard,
                }
            )
        for q in replies - {q for q, _ in applied}:
            if self.outstanding.pop(q, None) is not None:  # a fetched state answered it (after a gap)
                self.fetched_replies += 1

    def counters(self) -> dict[str, int]:
        """What this link counted so far (`COUNTERS` from the LinkCore, and the shell's own)."""
        c = self.core.counters
        out = {k: int(getattr(c, k)) for k in COUNTERS}
        out.update(
            pushes=self.pushes,
            outstanding=len(self.outstanding),
            missed_updates=self.missed_updates,
            fetched_replies=self.fetched_replies,
            decoded=self.replica.decoded,
        )
        return out

    def stop(self) -> None:
        """Say bye (if linked) and close, leaving libzmq a moment to send it."""
        bye = self.core.goodbye()
        if bye is not None and self.sock is not None:
            try:
                self.sock.send_multipart(encode(self._message(bye)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.close_socket(linger_ms=200)
