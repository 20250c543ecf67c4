"""The learner's link to the syncer: one background thread that owns the ZeroMQ DEALER socket.

The training thread never waits on the network: it hands outer gradients to `push()` (newest
wins per fragment while the syncer is away), reads the replies to its pushes with `take_updates()`, and
publishes its progress with `set_stats()`. This thread joins (hello, init upload if first, state
fetch in chunks), sends pushes and heartbeats, applies update blobs to the replica, and follows
the Paranoid Pirate pattern: heartbeats both ways, a liveness deadline on the syncer, socket
re-creation with capped backoff, LINGER 0.
"""

from __future__ import annotations

import os
import socket as pysocket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from learner.config import LearnerConfig
from learner.replica import Replica
from syncer.common import faultpoints, keys
from syncer.wire import codec
from syncer.wire.protocol import Message, ProtocolError, check_raw_fragment, decode, encode

FETCH_WINDOW = 4
GOODBYE_WAIT_S = 2.0  # at exit, how long to wait for the syncer's receipt of the bye


@dataclass
class PushItem:
    """An outer gradient waiting to leave (CPU fp32), with its counters."""

    fragment: int
    delta: torch.Tensor
    base_version: int
    c_steps: int
    c_tokens: int
    c_time: float
    step_time: float
    base_epoch: int = 0  # the syncer epoch in which base_version was applied


def coalesce(older: PushItem | None, newer: PushItem) -> PushItem:
    """The one push to send for a fragment whose earlier push has not left yet.

    Outer gradients taken from the same base telescope, (mark0 - x1) + (x1 - x2) = mark0 - x2,
    so the sum, with the counters summed, is exactly the outer gradient of all the steps since
    that base: the work of a learner cut off from the syncer reaches the model when it is back
    (the fragment "stays due", ALGORITHM.md). If a global value was applied in between (another
    base), the older one is dropped: newest wins."""
    if older is None or (older.base_version, older.base_epoch) != (newer.base_version, newer.base_epoch):
        return newer
    return PushItem(
        newer.fragment,
        older.delta + newer.delta,
        newer.base_version,
        older.c_steps + newer.c_steps,
        older.c_tokens + newer.c_tokens,
        older.c_time + newer.c_time,
        newer.step_time,
        newer.base_epoch,
    )


class SyncerClient(threading.Thread):
    """Background syncer client; all public methods are safe to call from the training thread."""

    def __init__(
        self,
        cfg: LearnerConfig,
        manifest: list[list[Any]],  # fragments.manifest_to_json: [[name, shape, kind], ...]
        sizes: list[int],
        init_values: Callable[[], list[torch.Tensor]],
        incarnation: str,
    ) -> None:
        super().__init__(name=f"syncer-client-{cfg.spec.id}", daemon=True)
        self.cfg, self.s = cfg, cfg.settings
        self.manifest, self.init_values = manifest, init_values
        self.incarnation = incarnation
        self.replica = Replica(sizes)
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.fatal: str | None = None
        self.goodbye_confirmed = False
        self.bytes_sent = self.bytes_received = 0
        self.counters: dict[str, int] = {
            "pushes_sent": 0,
            "updates": 0,
            "refetches": 0,
            "reconnects": 0,
            "bad_messages": 0,
        }
        self._pending: dict[int, PushItem] = {}
        self._sending = 0  # a push taken off _pending while it is sent
        self._replies: set[int] = set()  # fragments whose new global value answers one of our pushes
        self._forced: set[int] = set()
        self._calls: set[int] = set()  # fragments whose round the syncer has called (round_clock = syncer)
        self._stats: dict[str, Any] = {"step": 0, "tokens": 0, "state": "joining"}
        self.resume_step = 0  # where the syncer says this incarnation's step counter starts
        self._partitioned = False
        self._halt = threading.Event()
        self._flush = threading.Event()
        self._sock: zmq.Socket[bytes] | None = None  # open while the link is up (this thread only)
        self._ctx = zmq.Context()
        self._welcomed = False
        self._hello_at = 0.0
        self._heard_at = 0.0
        self._beat_at = 0.0
        self._backoff = 0.1
        self._init_queue: list[tuple[int, int]] = []
        self._chunk = 1 << 20

    # -- training-thread API -----------------------------------------------------------------
    def push(self, item: PushItem) -> None:
        """Queue an outer gradient; an unsent one of the same fragment is folded in (`coalesce`)."""
        with self.lock:
            self._pending[item.fragment] = coalesce(self._pending.get(item.fragment), item)

    def take_updates(self) -> tuple[set[int], set[int]]:
        """(fragments with a reply to our push, fragments the syncer wants overwritten).

        A reply is an update whose round merged this learner's push (it is in the update's
        contributors), or a fetched state (after a gap; who it merged is not known). An update of
        a round without our push is kept in the replica but is no reply: applying it would drop
        the pushed work, still in flight, from the model until the next reply."""
        with self.lock:
            replies, forced = self._replies, self._forced
            self._replies, self._forced = set(), set()
        return replies, forced

    def take_calls(self) -> set[int]:
        """Fragments whose round the syncer called since the last take: push them now."""
        with self.lock:
            calls, self._calls = self._calls, set()
        return calls

    def has_reply(self, p: int) -> bool:
        """Whether a reply for fragment p is waiting to be taken (see take_updates)."""
        with self.lock:
            return p in self._replies or p in self._forced

    def linked(self) -> bool:
        """Whether the syncer is reachable now (welcomed, not cut off by a chaos partition)."""
        return self._welcomed and not self._partitioned

    def latest(self, p: int) -> tuple[int, torch.Tensor]:
        """(version, a private copy) of the global fragment p."""
        with self.lock:
            value = self.replica.latest[p]
            assert value is not None, "fragment not fetched yet"
            return self.replica.versions[p], value.clone()

    def versions(self) -> list[int]:
        with self.lock:
            return list(self.replica.versions)

    def epoch(self) -> int:
        """The syncer epoch the replica belongs to (0 before the first welcome)."""
        with self.lock:
            return self.replica.epoch or 0

    def set_stats(self, **stats: Any) -> None:
        with self.lock:
            self._stats.update(stats)

    def set_partitioned(self, cut: bool) -> None:
        """Chaos: cut every byte to and from the syncer (the socket is closed) or restore."""
        self._partitioned = cut

    def replica_snapshot(self) -> dict[str, Any]:
        """The replica's versions and values (for `replica.pt` at exit)."""
        with self.lock:
            return {
                "versions": list(self.replica.versions),
                "epoch": self.replica.epoch,
                "fragments": [t.clone() if t is not None else None for t in self.replica.latest],
            }

    def pending(self) -> int:
        with self.lock:
            return len(self._pending) + self._sending

    def stop(self, flush_s: float = 2.0) -> None:
        """Send what is pending (up to flush_s), say bye, close."""
        self._flush.set()
        deadline = time.monotonic() + flush_s
        while self.pending() and time.monotonic() < deadline and self.is_alive() and self._welcomed:
            time.sleep(0.02)
        self._halt.set()
        self.join(timeout=flush_s + 2.0)

    # -- the thread --------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self._halt.is_set() and self.fatal is None:
                self._cycle()
            if self._sock is not None and self._welcomed and not self._partitioned:
                self._say_goodbye()
        finally:
            self._close_socket()
            self._ctx.term()

    def _say_goodbye(self) -> None:
        """Send bye and wait for the syncer's receipt. The socket closes with LINGER 0, which drops
        whatever libzmq has not written yet; the receipt says the bye, and every push queued before
        it on the same connection, arrived."""
        if not self._send(Message("bye", {"reason": "learner stopping"})):
            return
        sock = self._socket()
        deadline = time.monotonic() + GOODBYE_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                return
            try:
                if decode(sock.recv_multipart(copy=False)).kind == "bye":
                    self.goodbye_confirmed = True
                    return
            except ProtocolError:
                self.counters["bad_messages"] += 1

    def _cycle(self) -> None:
        if self._partitioned:
            self._close_socket()
            self._set_link("partitioned")
            time.sleep(0.05)
            return
        now = time.monotonic()
        if self._sock is None:
            self._open_socket(now)
        if self._socket().poll(20, zmq.POLLIN):
            self._receive_all()
        now = time.monotonic()
        if not self._welcomed:
            if now - self._hello_at > min(2.0, self._backoff):
                self._backoff = min(self._backoff * 2, 2.0)
                self._hello(now)
        else:
            self._work(now)
        if now - self._heard_at > 3 * self.s.liveness_s and now - self._hello_at > self.s.liveness_s:
            self.counters["reconnects"] += 1  # Paranoid Pirate: silence means a fresh socket
            self._close_socket()

    def _work(self, now: float) -> None:
        self._send_init_chunks()
        for p, offset, version in self.replica.requests(now, self._chunk, FETCH_WINDOW):
            self._send(Message("state_req", {"fragment": p, "offset": offset, "version": version}))
        if self.ready.is_set() and self._hears_syncer(now):
            self._send_pushes()
        if now - self._beat_at >= self.s.heartbeat_s:
            self._beat_at = now
            self._send(Message("heartbeat", self._heartbeat_meta()))

    def _hears_syncer(self, now: float) -> bool:
        """Whether the syncer answered recently (its acks come every heartbeat). Pushes sent into
        a silent syncer (hung, SIGSTOPped) wait in libzmq and are lost with the socket when the
        link gives up on it: after a 20 s hang only 0.36 of the trained tokens were merged. While
        it is silent they stay queued here, folded per fragment, and go out once it answers."""
        return now - self._heard_at <= max(1.0, 4 * self.s.heartbeat_s)

    def _heartbeat_meta(self) -> dict[str, Any]:
        with self.lock:
            meta = dict(self._stats)
            meta.update(
                versions=list(self.replica.versions),
                crcs=list(self.replica.crcs),
                crc_mismatches=self.replica.mismatches,
            )
        meta.update(
            bytes_sent=self.bytes_sent, bytes_received=self.bytes_received, pending_pushes=len(self._pending), link="up"
        )
        return meta

    def _set_link(self, state: str) -> None:
        with self.lock:
            self._stats["link"] = state

    # -- socket ------------------------------------------------------------------------------
    def _open_socket(self, now: float) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing to a syncer that is not there
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.SNDTIMEO, 5000)
        if self.cfg.secret_key is not None:
            assert self.cfg.syncer_key is not None, "a secret key comes with the syncer's key"  # config.load sets both
            sock.curve_publickey, sock.curve_secretkey = keys.load_pair(self.cfg.secret_key)
            sock.curve_serverkey = keys.load_public(self.cfg.syncer_key)
        sock.connect(self.cfg.syncer_address)
        self._sock = sock
        self._welcomed = False
        self._hello_at = self._heard_at = now
        self._backoff = 0.1

    def _socket(self) -> zmq.Socket[bytes]:
        """The open socket: only the link thread's sends and receives use it, after _open_socket."""
        assert self._sock is not None, "no socket open"
        return self._sock

    def _close_socket(self) -> None:
        """Drop the socket with LINGER 0: what is still queued is discarded (see _say_goodbye)."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
            self._welcomed = False

    def _send(self, msg: Message, block: bool = False) -> bool:
        try:
            frames = encode(msg)
        except (ProtocolError, ValueError) as exc:  # a bug must not kill the link thread
            self.counters["bad_messages"] += 1
            print(f"learner: could not encode {msg.kind}: {exc}", flush=True)
            return False
        try:
            self._socket().send_multipart(frames, flags=0 if block else zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        self.bytes_sent += sum(len(f) for f in frames)
        return True

    def _hello(self, now: float) -> None:
        self._hello_at = now
        self._send(
            Message(
                "hello",
                {
                    "learner": self.cfg.spec.id,
                    "incarnation": self.incarnation,
                    "run": self.cfg.run_id,
                    "pid": os.getpid(),
                    "host": pysocket.gethostname(),
                    "device": self.cfg.spec.device,
                    "batch_size": self.cfg.batch_size,
                    "codecs": list(codec.MODES),
                    "manifest": self.manifest,
                    "fragments": self.replica.count,
                },
            )
        )

    # -- incoming ----------------------------------------------------------------------------
    def _receive_all(self) -> None:
        while True:
            try:
                frames = self._socket().recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.bytes_received += sum(len(f) for f in frames)
            self._heard_at = time.monotonic()
            try:
                self._dispatch(decode(frames))
            except (ProtocolError, codec.CodecError) as exc:
                self.counters["bad_messages"] += 1
                print(f"learner: dropped a bad message from the syncer: {exc}", flush=True)

    def _dispatch(self, msg: Message) -> None:
        handler = {
            "welcome": self._on_welcome,
            "ack": self._on_ack,
            "state": self._on_state,
            "update": self._on_update,
            "resync": self._on_resync,
            "error": self._on_error,
            "call": self._on_call,
        }.get(msg.kind)
        if handler is None:
            raise ProtocolError("unexpected_kind", f"syncer sent {msg.kind!r}")
        handler(msg)

    def _on_welcome(self, msg: Message) -> None:
        self._welcomed = True
        self._backoff = 0.1
        self._chunk = max(1024, int(msg["chunk_numel"]))
        self.resume_step = max(0, int(msg["step"]))
        self._set_link("up")
        self._sync_epoch(msg["epoch"], msg["initialized"], msg["versions"])
        if msg["init_owner"] and not msg["initialized"]:
            self._init_queue = [
                (p, off) for p in range(self.replica.count) for off in range(0, self.replica.sizes[p], self._chunk)
            ]

    def _on_ack(self, msg: Message) -> None:
        self._sync_epoch(msg["epoch"], msg["initialized"], msg["versions"])

    def _sync_epoch(self, epoch: int, initialized: bool, versions: list[Any]) -> None:  # JSON: int() below
        """A new syncer epoch (it restarted) means our replica may be ahead or behind: refetch."""
        with self.lock:
            if not initialized:
                return
            if epoch != self.replica.epoch:
                self.replica.epoch = epoch
                self.replica.refetch_all()
                self.counters["refetches"] += self.replica.count
                return
            for p in self.replica.behind([int(v) for v in versions]):
                self.replica.refetch(p)
                self.counters["refetches"] += 1

    def _on_state(self, msg: Message) -> None:
        if msg["epoch"] != self.replica.epoch:
            return
        faultpoints.hit("fetch")
        values = check_raw_fragment(msg, self.replica.sizes)
        with self.lock:
            if self.replica.on_state(msg["fragment"], msg["version"], msg["offset"], values, msg.get("crc")):
                self._replies.add(msg["fragment"])
                if self.replica.complete():
                    self.ready.set()

    def _on_update(self, msg: Message) -> None:
        p = msg["fragment"]
        if msg["epoch"] != self.replica.epoch or not 0 <= p < self.replica.count or len(msg.payloads) != 1:
            return
        with self.lock:
            result = self.replica.on_update(p, msg["from_version"], msg["version"], msg.payloads[0], msg.get("crc"))
            if result == "applied":
                if self.cfg.spec.id in msg["contributors"]:
                    self._replies.add(p)
                self.counters["updates"] += 1
            elif result in ("gap", "mismatch"):
                self.counters["refetches"] += 1

    def _on_call(self, msg: Message) -> None:
        p = msg["fragment"]
        if msg["epoch"] == self.replica.epoch and 0 <= p < self.replica.count and self.ready.is_set():
            with self.lock:
                self._calls.add(p)

    def _on_resync(self, msg: Message) -> None:
        p = msg["fragment"]
        with self.lock:
            targets = range(self.replica.count) if p < 0 else [p] if p < self.replica.count else []
            for q in targets:
                self._forced.add(q)
                self.replica.refetch(q)
        print(f"learner: syncer asked for a resync of fragment {p}: {msg['reason']}", flush=True)

    def _on_error(self, msg: Message) -> None:
        if msg["fatal"]:
            self.fatal = str(msg["reason"])
        elif "hello" in str(msg["reason"]):
            self._welcomed = False
            self._hello_at = 0.0  # the syncer restarted and does not know us: hello at once

    # -- outgoing ----------------------------------------------------------------------------
    def _send_init_chunks(self) -> None:
        if not self._init_queue:
            return
        values = self.init_values()
        while self._init_queue:
            p, off = self._init_queue[0]
            chunk = values[p][off : off + self._chunk].contiguous()
            meta = {"fragment": p, "offset": off, "numel": chunk.numel(), "total": self.replica.sizes[p]}
            if not self._send(Message("init", meta, [chunk.numpy().tobytes()]), block=True):
                return  # syncer gone mid-upload: the next welcome decides who uploads
            self._init_queue.pop(0)

    def _send_pushes(self) -> None:
        """Send the queued pushes, lowest fragment first. Each is taken off the queue while it is
        encoded and sent (a push queued meanwhile cannot fold it in and send it twice); one that
        cannot leave goes back, the newer one for its fragment folded onto it."""
        sent: set[int] = set()
        while True:
            with self.lock:
                waiting = sorted(p for p in self._pending if p not in sent)
                if not waiting:
                    return
                item = self._pending.pop(waiting[0])
                self._sending = 1
            ok = False
            try:
                ok = self._send_push(item)
            finally:
                with self.lock:
                    self._sending = 0
                    if not ok:  # not connected: keep it for when the link is back
                        self._pending[item.fragment] = (
                            coalesce(item, self._pending[item.fragment]) if item.fragment in self._pending else item
                        )
            if not ok:
                return
            sent.add(item.fragment)
            self.counters["pushes_sent"] += 1

    def _send_push(self, item: PushItem) -> bool:
        blob = codec.encode(item.delta, self.s.compression, self.s.block)
        meta = {
            "fragment": item.fragment,
            "base_version": item.base_version,
            "seq": self.counters["pushes_sent"],
            "epoch": item.base_epoch,
            "c_steps": item.c_steps,
            "c_tokens": item.c_tokens,
            "c_time": item.c_time,
            "step_time": item.step_time,
        }
        faultpoints.hit("push")
        return self._send(Message("push", meta, [blob]))
