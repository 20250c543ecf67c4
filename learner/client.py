"""The learner's link to the syncer, the thin shell: one thread that owns the ZeroMQ DEALER socket.

Everything the link decides is in the pure `learner.link.LinkCore`; this thread feeds it the
clock and the frames it receives, carries out what it returns (open or close the socket, send),
and wakes the training thread when something changed. The training thread never waits on the
network: it hands outer gradients to `push()`, reads the replies to its pushes with
`take_updates()`, publishes its progress with `set_stats()`, and where it must wait (joining,
synchronous rounds, `max_lag`) it waits on `wait_for`, woken by the messages that answer it.
Socket options follow the Paranoid Pirate pattern: LINGER 0, IMMEDIATE, capped reconnects.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from learner.config import LearnerConfig
from learner.feedback import ErrorFeedback
from learner.link import Identity, LinkCore, LinkEvent, LinkOutbox, ShardRole
from learner.logline import log
from learner.sends import PushItem, Send, push_message
from syncer.common import faultpoints, keys
from syncer.wire.protocol import Message, ProtocolError, encode

GOODBYE_WAIT_S = 2.0  # at exit, how long to wait for the syncer's receipt of the bye
POLL_MS = 20  # how long one cycle waits for the syncer's messages
QUIET_EVENTS = ("welcome", "ready")  # logged by the trainer itself


class SyncerClient(threading.Thread):
    """Background syncer link; all public methods are safe to call from the training thread."""

    def __init__(
        self,
        cfg: LearnerConfig,
        manifest: list[list[Any]],  # fragments.manifest_to_json: [[name, shape, kind], ...]
        sizes: list[int],
        init_values: Callable[[], list[torch.Tensor]],
        incarnation: str,
        role: ShardRole = ShardRole(),
    ) -> None:
        suffix = f"-{role.index}" if role.shards > 1 else ""
        super().__init__(name=f"syncer-client-{cfg.spec.id}{suffix}", daemon=True)
        self.cfg, self.init_values = cfg, init_values
        self.address = cfg.syncer_addresses[role.index] if cfg.syncer_addresses else cfg.syncer_address
        me = Identity(
            cfg.spec.id,
            incarnation,
            cfg.run_id,
            os.getpid(),
            cfg.spec.host,  # the inventory's name, as `dldctl status` shows it (not the machine's hostname)
            cfg.spec.device,
            cfg.batch_size,
            manifest,
            role,
        )
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified whenever the core moved
        self._core = LinkCore(me, sizes, cfg.settings, fault=faultpoints.hit)
        self.feedback = ErrorFeedback()  # a thin codec's residual: this thread's alone (learner/feedback.py)
        self.ready = threading.Event()
        self._halt = threading.Event()
        self._sock: zmq.Socket[bytes] | None = None  # this thread only
        self._connecting = False  # a fresh socket whose connection is not up yet (POLLOUT tells)
        self._ctx = zmq.Context()

    # -- training-thread API -----------------------------------------------------------------
    def push(self, item: PushItem) -> None:
        """Queue an outer gradient; an unsent one of the same fragment is folded in (`coalesce`)."""
        with self._lock:
            self._core.push(item)

    def take_updates(self) -> tuple[set[int], set[int]]:
        """(fragments with a reply to our push, fragments the syncer wants overwritten): LinkCore.take_updates."""
        with self._lock:
            return self._core.take_updates()

    def queued_units(self) -> dict[int, tuple[int, ...]]:
        """Work units named by pushes not sent yet, per (local) fragment: LinkCore.queued_units."""
        with self._lock:
            return self._core.queued_units()

    def take_units(self) -> tuple[list[int], list[int]]:
        """Work units handed out and taken back by the syncer's data ledger: LinkCore.take_units."""
        with self._lock:
            return self._core.take_units()

    def take_calls(self) -> set[int]:
        """Fragments whose round the syncer called since the last take (round_clock = syncer)."""
        with self._lock:
            return self._core.take_calls()

    def has_reply(self, p: int) -> bool:
        """Whether a reply for fragment p is waiting to be taken (see take_updates)."""
        with self._lock:
            return self._core.has_reply(p)

    def linked(self) -> bool:
        """Whether the syncer is reachable now (welcomed, not cut off by a chaos partition)."""
        with self._lock:
            return self._core.linked()

    def latest(self, p: int) -> tuple[int, torch.Tensor]:
        """(version, a private copy) of the global fragment p."""
        with self._lock:
            value = self._core.replica.latest[p]
            assert value is not None, "fragment not fetched yet"
            return self._core.replica.versions[p], value.clone()

    def versions(self) -> list[int]:
        with self._lock:
            return list(self._core.replica.versions)

    def epoch(self) -> int:
        """The syncer epoch the replica belongs to (0 before the first welcome)."""
        with self._lock:
            return self._core.replica.epoch or 0

    @property
    def fatal(self) -> str | None:
        """Why the syncer refused this learner (restarting cannot help), or None."""
        with self._lock:
            return self._core.fatal

    @property
    def restart(self) -> str | None:
        """Why this process must restart from the global state (quarantined), or None."""
        with self._lock:
            return self._core.restart

    def held_s(self, now: float) -> float:
        """Seconds of a quarantine left to wait out before training (0: none)."""
        with self._lock:
            return max(0.0, self._core.hold_until - now)

    @property
    def resume_step(self) -> int:
        with self._lock:
            return self._core.resume_step

    @property
    def goodbye_confirmed(self) -> bool:
        with self._lock:
            return self._core.goodbye_confirmed

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(vars(self._core.counters))

    def set_stats(self, **stats: Any) -> None:
        with self._lock:
            self._core.stats.update(stats)

    def set_partitioned(self, cut: bool) -> None:
        """Chaos: cut every byte to and from the syncer (the socket is closed) or restore."""
        with self._changed:
            self._core.partitioned = cut
            self._changed.notify_all()

    def replica_snapshot(self) -> dict[str, Any]:
        """The replica's versions and values (for `replica.pt` at exit)."""
        with self._lock:
            replica = self._core.replica
            return {
                "versions": list(replica.versions),
                "epoch": replica.epoch,
                "fragments": [t.clone() if t is not None else None for t in replica.latest],
            }

    def pending(self) -> int:
        with self._lock:
            return self._core.pending()

    def wait_for(self, done: Callable[[LinkCore], bool], timeout: float) -> bool:
        """Block until `done(core)` (checked under the lock, after every change) or the timeout;
        whether it is done. A refusal or the end of this thread also ends the wait."""
        with self._changed:
            return self._changed.wait_for(lambda: done(self._core) or self._core.fatal is not None, timeout)

    def stop(self, flush_s: float = 2.0, finished: bool = False) -> None:
        """Send what is pending (up to flush_s, while the syncer is reachable), say bye (that the
        budget is spent, with `finished`), close."""
        with self._lock:
            self._core.finished = finished
        if self.is_alive():
            self.wait_for(lambda core: core.pending() == 0 or not core.linked(), flush_s)
        self._halt.set()
        self.join(timeout=flush_s + 2.0)

    # -- the thread --------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self._halt.is_set() and self.fatal is None:
                self._cycle()
            self._say_goodbye()
        finally:
            self._close_socket()
            self._ctx.term()
            with self._changed:
                self._changed.notify_all()

    def _cycle(self) -> None:
        with self._lock:
            out = self._core.tick(time.monotonic())
        self._carry_out(out)
        if self._sock is None:
            self._halt.wait(0.05)  # partitioned: nothing to do until it is lifted
            return
        # with IMMEDIATE, a fresh socket turns writable once connected (and CURVE's handshake is done)
        ready = self._sock.poll(POLL_MS, zmq.POLLIN | (zmq.POLLOUT if self._connecting else 0))
        if ready & zmq.POLLOUT:
            self._connecting = False
            with self._lock:
                self._core.connected(time.monotonic())
        if ready & zmq.POLLIN:
            self._receive_all()

    def _carry_out(self, out: LinkOutbox) -> None:
        """Close, open, then send in order. After one push (or upload chunk) cannot leave, the
        later ones of its kind go back to the core instead of being tried."""
        if out.close:
            self._close_socket()
        if out.open:
            self._open_socket()
        failed: set[str] = set()
        values: list[torch.Tensor] | None = None
        for send in out.sends:
            kind = "push" if send.push is not None else "init" if send.init is not None else "msg"
            if kind in failed:
                ok = False
            else:
                if send.init is not None and values is None:
                    values = self.init_values()
                ok = self._send(send, values)
                if not ok and kind != "msg":
                    failed.add(kind)
            if not ok:
                with self._lock:
                    self._core.unsent(send)
        self._report(out.events)
        if out.sends:
            with self._changed:
                self._changed.notify_all()

    def _say_goodbye(self) -> None:
        """Send bye and wait for the syncer's receipt. The socket closes with LINGER 0, which drops
        whatever libzmq has not written yet; the receipt says the bye, and every push queued before
        it on the same connection, arrived."""
        with self._lock:
            bye = self._core.goodbye() if self._sock is not None else None
        if bye is None or not self._send(bye, None):
            return
        deadline = time.monotonic() + GOODBYE_WAIT_S
        while (left := deadline - time.monotonic()) > 0 and not self.goodbye_confirmed:
            if not self._socket().poll(max(1, int(left * 1000)), zmq.POLLIN):
                return
            self._receive_all()

    # -- socket ------------------------------------------------------------------------------
    def _open_socket(self) -> None:
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
        sock.connect(self.address)
        self._sock, self._connecting = sock, True
        with self._lock:
            self._core.opened(time.monotonic())

    def _socket(self) -> zmq.Socket[bytes]:
        """The open socket: only this thread's sends and receives use it."""
        assert self._sock is not None, "no socket open"
        return self._sock

    def _close_socket(self) -> None:
        """Drop the socket with LINGER 0: what is still queued is discarded (see _say_goodbye)."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _send(self, send: Send, values: list[torch.Tensor] | None) -> bool:
        """Encode and send one message (unlocked: a large push encodes while the trainer trains)."""
        if self._sock is None:
            return False
        try:
            msg = self._message(send, values)
            frames = encode(msg)
        except (ProtocolError, ValueError) as exc:  # a bug must not kill the link thread
            self.feedback.discard()
            with self._lock:
                event = self._core.encode_failed(send, exc)
            self._report([event])
            return True  # dropped and counted, never retried
        try:
            self._sock.send_multipart(frames, flags=0 if send.block else zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.feedback.discard()
            return False
        self.feedback.commit()
        blob = msg.payloads[0] if send.push is not None else None  # kept until a syncer checkpoint holds it
        with self._lock:
            self._core.sent(send, sum(len(f) for f in frames), blob if isinstance(blob, bytes) else None)
        return True

    def _message(self, send: Send, values: list[torch.Tensor] | None) -> Message:
        if send.push is not None:
            faultpoints.hit("push")
            return push_message(send, self.cfg.settings, self.feedback)
        if send.init is not None:
            assert values is not None, "upload chunks are sent with the trainer's initial values"
            c = send.init
            chunk = values[c.fragment][c.offset : c.offset + c.numel].contiguous()
            meta = {"fragment": c.fragment, "offset": c.offset, "numel": c.numel, "total": c.total}
            return Message("init", meta, [chunk.numpy().tobytes()])
        assert send.msg is not None, "a send is a message, a push or an upload chunk"
        return send.msg

    def _receive_all(self) -> None:
        events: list[LinkEvent] = []
        while True:
            try:
                frames = self._socket().recv_multipart(flags=zmq.NOBLOCK, copy=False)  # state chunks: no copy
            except zmq.Again:
                break
            with self._lock:
                events.extend(self._core.receive(time.monotonic(), frames).events)
        self._report(events)
        with self._changed:
            self._changed.notify_all()

    def _report(self, events: list[LinkEvent]) -> None:
        """Log what the trainer does not log itself; `ready` releases a joining trainer."""
        for event in events:
            if event.kind == "ready":
                self.ready.set()
            elif event.kind not in QUIET_EVENTS:
                log(f"link {event.kind}: {event.detail}")
