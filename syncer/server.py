"""The syncer process: the ZeroMQ socket loop around SyncerCore.

Two ROUTER sockets, CURVE-authenticated unless the run is explicitly insecure (syncer/auth.py):
  learners  (ZAP domain "learners"): only the run's learner keys; the key names the learner
  control   (ZAP domain "control"):  only the operator's key; status and control requests
One loop: poll, decode (malformed input is dropped and counted), hand to the core, carry out its
outbox with non-blocking sends (ROUTER_MANDATORY: a send that cannot go out is counted, never
silently lost), close ready rounds. LINGER 0 everywhere. What it writes down (events, metrics,
the operator log) is syncer/records.py's; when it checkpoints and what it starts from,
syncer/checkpointing.py's; the final model's export, syncer/shardmodel.py's.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from syncer import checkpoint, native, shardmodel
from syncer.auth import Authenticator, Keyring, Provider
from syncer.checkpointing import Checkpoints
from syncer.common import faultpoints, hostmem, jsonl, keys, memfit
from syncer.config import SyncerConfig
from syncer.core import Outbox, SyncerCore
from syncer.oplog import send_dropped, stamp
from syncer.records import Records
from syncer.shardscore import scoring_for
from syncer.status import sample_record, snapshot
from syncer.usage import own_usage
from syncer.wire.protocol import Message, Payload, ProtocolError, decode, encode

SAMPLE_EVERY_S = 2.0
# Connection-level drops libzmq makes before a message reaches us, from the learner socket's monitor:
# a failed handshake (garbage that is not ZMTP, a peer gone mid-handshake) is a rejection; a dropped
# connection is also what a message over max_message_mb causes (libzmq does not say why).
WATCHED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_DISCONNECTED


class SyncerServer:
    """The sockets and the loop of one syncer process: messages go to the core, what is written
    down to its records (syncer/records.py), checkpoints to syncer/checkpointing.py."""

    def __init__(self, cfg: SyncerConfig, wall: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.wall = wall
        self.ctx = zmq.Context()
        self.auth: Authenticator | None = None
        self.keyring: Keyring | None = None
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        name = "syncer" if cfg.shard == 0 else f"syncer-{cfg.shard}"  # its events' target, as dldctl names it
        self.records = Records(cfg.run_dir, name, cfg.settings.max_log_bytes, wall)
        epoch = checkpoint.next_epoch(cfg.run_dir / "syncer.epoch", checkpoint.newest_name(cfg.checkpoint_dir)[0] + 1)
        self.kernel = native.load()
        self.core = SyncerCore(
            cfg.settings,
            cfg.run_id,
            list(cfg.learners),
            wall(),
            epoch=epoch,
            on_merge=self._on_merge,
            kernel=self.kernel,
            shard=(cfg.shard, cfg.shards),
        )
        self.checkpoints = Checkpoints(self.core, cfg, self.records)
        self.routes: dict[bytes, str] = {}  # routing id -> learner id (after hello)
        self.peers: dict[str, bytes] = {}  # learner id -> newest routing id
        self._last_sample = 0.0
        self.stop_reason = "stopped"  # said at shutdown: the operator's `down`, or the signal __main__ names
        self._export_name: Any = None
        self.stopping = threading.Event()
        self.learner_sock: zmq.Socket[bytes] | None = None  # the three are set by open()
        self.control_sock: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.disconnects = 0  # learner connections dropped, by a peer or by libzmq
        self.scoring = scoring_for(cfg)  # a sharded model: shard 0 scores the shards' checkpoints

    # -- set-up ------------------------------------------------------------------------------
    def open(self) -> None:
        """Resume from the newest valid checkpoint, start authentication, bind both sockets.
        Raises checkpoint.HistoryLostError (before binding anything) when the run had merged, no
        checkpoint is valid and on_no_checkpoint = "refuse"."""
        (self.cfg.run_dir / checkpoint.REFUSED).unlink(missing_ok=True)  # a previous refusal's marker
        if self.kernel is None:
            self.records.event("native_kernel", "syncer", f"not used ({native.problem}): merging with torch (slower)")
        self._memory()
        self.checkpoints.resume()
        if self.scoring.ev is not None:
            self.scoring.ev.start()
        server_keys = None
        if not self.cfg.settings.insecure:
            assert self.cfg.keys_dir is not None
            server_keys = keys.load_pair(self.cfg.keys_dir / "syncer.key_secret")
            self.keyring = Keyring(self.cfg.keys_dir)
            self.auth = Authenticator(self.ctx, self.keyring)
            self.auth.start()
            self.auth.configure_curve_callback(
                "learners", Provider(self.keyring, lambda n: n.startswith("learner-"), "learners")
            )
            self.auth.configure_curve_callback("control", Provider(self.keyring, lambda n: n == "operator", "control"))
        self.learner_sock = self._bind(self.cfg.bind, "learners", server_keys)
        self.monitor = self.learner_sock.get_monitor_socket(WATCHED)
        self.control_sock = self._bind(self.cfg.control_bind, "control", server_keys)
        security = f"{'INSECURE (no CURVE)' if self.cfg.settings.insecure else 'CURVE'} on {self.cfg.bind}"
        self.records.event("syncer_start", "syncer", f"epoch {self.core.epoch}, pid {os.getpid()}, {security}")

    def _memory(self) -> None:
        """What this host has free now, for a first learner's model (the core checks it at hello)."""
        free, which = memfit.free(hostmem.probe())
        self.core.memory_free = (free, which) if free is not None else None

    def _bind(self, address: str, domain: str, server_keys: tuple[bytes, bytes] | None) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 2000)
        sock.setsockopt(zmq.RCVHWM, 2000)
        # larger messages are refused by libzmq (the connection is dropped) before we see them
        sock.setsockopt(zmq.MAXMSGSIZE, int(self.cfg.settings.max_message_mb * (1 << 20)))
        if server_keys is not None:
            sock.zap_domain = domain.encode()
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = server_keys
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            sock.close()
            raise OSError(f"cannot bind {address}: {exc}") from exc
        return sock

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until `stopping` is set; then a final checkpoint."""
        learner, control, monitor = _bound(self.learner_sock), _bound(self.control_sock), _bound(self.monitor)
        poller = zmq.Poller()
        poller.register(learner, zmq.POLLIN)
        poller.register(control, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while not self.stopping.is_set():
            ready = dict(poller.poll(timeout=20))
            if monitor in ready:
                self._connection_events()
            if learner in ready:
                self._drain(learner, self._on_learner)
            if control in ready:
                self._drain(control, self._on_control)
            self._tick()
        self.records.say([f"{stamp(self.wall())} shutdown: {self.stop_reason}; writing the final checkpoint"])
        if self._export_name is not None:
            out = Outbox()
            self.scoring.final(self.core, self.wall(), out)
            self._flush(out)
        self.save_checkpoint(final=True)
        self.records.metrics.write(self._sample(self.wall()))  # where the run ended, for `dldctl runs`
        if self._export_name is not None:
            shardmodel.export_final(self.core, self.cfg, self._export_name, self.scoring.score, self.records)

    def _drain(self, sock: zmq.Socket[bytes], handler: Callable[[list[zmq.Frame]], None], budget: int = 256) -> None:
        for _ in range(budget):
            try:
                frames = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            handler(frames)

    def _connection_events(self) -> None:
        """Count what libzmq dropped at the connection level (see WATCHED)."""
        while True:
            try:
                event = recv_monitor_message(_bound(self.monitor), flags=zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self.disconnects += 1
            else:
                self.core.rejected["handshake_failed"] += 1
                self.records.quiet_event(
                    "reject:handshake",
                    "reject",
                    "unknown",
                    "a connection failed its handshake (not ZMTP, or gone mid-handshake); dropped",
                )

    def _tick(self) -> None:
        self.checkpoints.poll()
        now = self.wall()
        self.core.tick(now, out := Outbox())
        self._flush(out)  # the rounds' updates leave first; then their bookkeeping (before a checkpoint)
        self.core.settle(now, out := Outbox())
        due = self.checkpoints.due(now)
        scored = self.scoring.tick(self.core, now, out, checkpoint=due)  # a state whose score came back good
        self._flush(out)
        self.records.due(now)
        if now - self._last_sample >= SAMPLE_EVERY_S:
            self._last_sample = now
            self.records.metrics.write(self._sample(now))
        gated = self.scoring.gates_checkpoints and not self.scoring.overdue(now)
        self.checkpoints.tick(scored, due, gated)

    def _on_merge(self, p: int) -> None:
        """Fault points at a merge: a pause ("merge"), or damage for the quality guard's test
        ("bad_round": noise of that scale added to fragment p of the global model)."""
        faultpoints.hit("merge")
        scale = faultpoints.fires("bad_round")
        if scale is not None and self.core.model is not None:
            theta = self.core.model.writable(p)
            theta.add_(torch.randn(theta.shape, generator=torch.Generator().manual_seed(p)) * scale)

    # -- learners ----------------------------------------------------------------------------
    def _on_learner(self, frames: list[zmq.Frame]) -> None:
        rid = frames[0].bytes
        self.core.bytes_up += sum(len(f) for f in frames[1:])  # len(): f.bytes would copy every frame
        now = self.wall()
        try:
            msg = decode(frames[1:])
            learner = self._identify(rid, frames[1], msg)
            if learner is None:
                return
            if msg.kind == "hello" and self.core.model is None:
                self._memory()  # learners built theirs first: on a shared host, what is left now
            out = Outbox()
            self.core.handle(learner, msg, now, out)
            self._flush(out)
        except ProtocolError as exc:
            self.core.rejected[exc.reason] += 1
            self.records.quiet_event(f"reject:{exc.reason}", "reject", self.routes.get(rid, "unknown"), str(exc))

    def _identify(self, rid: bytes, frame: zmq.Frame, msg: Message) -> str | None:
        """Which learner sent this; None (after replying) if it must say hello first."""
        user = frame.get("User-Id") if self.keyring is not None else None
        if msg.kind == "hello":
            claimed = str(msg["learner"])
            if user is not None and user != claimed:
                raise ProtocolError("impersonation", f"key of {user!r} claimed to be {claimed!r}")
            old = self.peers.get(claimed)
            if old is not None and old != rid:
                self.routes.pop(old, None)
            self.routes[rid], self.peers[claimed] = claimed, rid
            return claimed
        learner = self.routes.get(rid)
        if learner is None or self.peers.get(learner) != rid:
            self._send_to_rid(rid, Message("error", {"reason": "say hello first", "fatal": False}))
            return None
        return learner

    def _flush(self, out: Outbox) -> None:
        for recipients, msg in out.sends:
            if msg.kind == "state":
                faultpoints.hit("serve_state")
            frames = encode(msg)
            for learner in recipients:
                rid = self.peers.get(learner)
                if rid is None:
                    self.core.counters["dropped_sends"] += 1
                    continue
                self._send_to_rid(rid, frames)
        self.records.outbox(out)

    def _send_to_rid(self, rid: bytes, payload: Message | list[Payload]) -> None:
        """Send without copying: a state chunk is a view of a value the core never writes again."""
        frames = encode(payload) if isinstance(payload, Message) else payload
        try:
            _bound(self.learner_sock).send_multipart([rid, *frames], flags=zmq.NOBLOCK, copy=False)
            self.core.bytes_down += sum(len(f) for f in frames)
        except zmq.ZMQError as exc:  # EAGAIN (high-water mark) or EHOSTUNREACH (gone)
            self.core.counters["dropped_sends"] += 1
            why = send_dropped(exc.errno, str(exc))
            self.records.quiet_event(f"drop:{exc.errno}", "send_dropped", self.routes.get(rid, "unknown"), why)

    # -- operator ----------------------------------------------------------------------------
    def _on_control(self, frames: list[zmq.Frame]) -> None:
        rid = frames[0].bytes
        try:
            msg = decode(frames[1:])
            reply = self._control(msg)
        except ProtocolError as exc:
            self.core.rejected[f"control_{exc.reason}"] += 1
            reply = Message("control_rep", {"ok": False, "detail": str(exc)})
        try:
            _bound(self.control_sock).send_multipart([rid, *encode(reply)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.core.counters["dropped_sends"] += 1

    def _control(self, msg: Message) -> Message:
        now = self.wall()
        if msg.kind == "status_req":
            return Message("status", {"snapshot": self.status(now)})
        if msg.kind != "control":
            raise ProtocolError("unexpected_kind", f"control socket does not take {msg.kind!r}")
        action = msg["action"]
        if action == "ping":
            return Message("control_rep", {"ok": True, "detail": f"pid {os.getpid()} epoch {self.core.epoch}"})
        if action == "checkpoint":
            path = self.save_checkpoint()
            return Message("control_rep", {"ok": path is not None, "detail": str(path)})
        if action == "flush":
            closed = self.core.flush(now, out := Outbox())
            self.core.settle(now, out)
            self._flush(out)
            return Message("control_rep", {"ok": True, "detail": f"closed {closed} rounds"})
        if action == "fleet":
            return self._set_fleet(msg.get("learners"), now)
        if action == "ending":  # `dldctl down`, before it stops the learners: they stay in the average
            self.core.fleet.ending = True
            return Message("control_rep", {"ok": True, "detail": "learners that leave now have finished"})
        if action == "shutdown":
            # stop taking messages now; export after the loop, so no round can close after it
            self._export_name = msg.get("export")
            export = f", final model export {self._export_name}" if self._export_name else ""
            self.stop_reason = f"the operator asked (`dldctl down`){export}"
            self.checkpoints.closed = True  # the operator stopped the run: its time down is nobody's lost work
            self.stopping.set()
            target = None if self.core.model is None else shardmodel.export_path(self.cfg.run_dir, self._export_name)
            return Message("control_rep", {"ok": True, "detail": str(target or "")})
        raise ProtocolError("unknown_action", f"control action {action!r}")

    def _set_fleet(self, learners: Any, now: float) -> Message:
        if not isinstance(learners, list) or not all(isinstance(x, str) for x in learners):
            raise ProtocolError("schema", "fleet: needs learners: [ids]")
        self.core.fleet.tick(now)
        self.core.fleet.declared = list(learners)
        self.records.event("fleet", "syncer", f"declared fleet is now {len(learners)} learners")
        return Message("control_rep", {"ok": True, "detail": f"{len(learners)} learners"})

    def status(self, now: float) -> dict[str, Any]:
        snap = snapshot(self.core, now)
        snap["syncer"]["address"] = self.cfg.bind
        snap["syncer"].update(pid=os.getpid(), **own_usage())
        snap["syncer"]["disconnects"] = self.disconnects
        snap["syncer"].update(shard=self.cfg.shard, shards=self.cfg.shards, owned=list(self.core.owned))
        if self.keyring is not None:
            with self.keyring.lock:
                for what, count in self.keyring.denied.items():
                    snap["syncer"]["rejected"][f"unauthenticated_{what}"] = count
        return snap

    # -- records ----------------------------------------------------------------------------
    def _sample(self, now: float) -> dict[str, Any]:
        return sample_record(self.status(now), now, jsonl.dropped())

    def save_checkpoint(self, final: bool = False) -> Path | None:
        """Checkpoint the current state now (syncer/checkpointing.py); its path, None if none."""
        return self.checkpoints.save(final=final)

    def close(self) -> None:
        if self.monitor is not None and self.learner_sock is not None:  # the monitor is the learner socket's
            self.learner_sock.disable_monitor()
        for sock in (self.monitor, self.learner_sock, self.control_sock):
            if sock is not None:
                sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        if self.scoring.ev is not None:
            self.scoring.ev.stop()
        self.records.close()
        self.ctx.term()


def _bound(sock: zmq.Socket[bytes] | None) -> zmq.Socket[bytes]:
    """One of the sockets `SyncerServer.open` binds; RuntimeError before it ran."""
    if sock is None:
        raise RuntimeError("the syncer's sockets are not bound: SyncerServer.open() first")
    return sock
