"""A scripted stand-in for the syncer at the socket seam: a bare ROUTER on 127.0.0.1 that speaks
just enough of the protocol for one learner link to join (welcome, state chunks of zeros with
their checksums, acks to heartbeats), records what arrives, and sends what a test queues.

For tests of the link's shell (`learner.client.SyncerClient`: its thread, socket, waits and
exit); the real syncer is exercised against real learners in tests/integration and tests/e2e.
"""

from __future__ import annotations

import queue
import threading
from types import TracebackType

import torch
import zmq

from learner.replica import checksum
from syncer.wire.protocol import Message, ProtocolError, decode, encode

EPOCH = 1


class ScriptedSyncer(threading.Thread):
    """Serves one learner with fragments of `sizes` zeros at version 0, until closed."""

    def __init__(self, sizes: list[int], echo_bye: bool = True) -> None:
        super().__init__(name="scripted-syncer", daemon=True)
        self.sizes, self.echo_bye = sizes, echo_bye
        self.kinds: list[str] = []  # what arrived, in order ("raw" for frames that are no message)
        self.pushes: list[Message] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._outgoing: queue.Queue[Message] = queue.Queue()
        self._peer: bytes | None = None
        self._halt = threading.Event()

    def __enter__(self) -> ScriptedSyncer:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._halt.set()
        self.join(5.0)

    def send(self, msg: Message) -> None:
        """Queue a message for the learner (sent from the server's own thread)."""
        self._outgoing.put(msg)

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                if self._sock.poll(10, zmq.POLLIN):
                    frames = self._sock.recv_multipart()
                    self._peer = frames[0]
                    self._answer(frames[1:])
                while self._peer is not None and not self._outgoing.empty():
                    self._reply(self._outgoing.get())
        finally:
            self._sock.close(linger=0)
            self._ctx.term()

    def _answer(self, frames: list[bytes]) -> None:
        try:
            msg = decode(frames)
        except ProtocolError:
            self.kinds.append("raw")
            return
        self.kinds.append(msg.kind)
        versions = [0] * len(self.sizes)
        if msg.kind == "hello":
            welcome = {"epoch": EPOCH, "initialized": True, "init_owner": False, "chunk_numel": 1 << 20, "step": 0}
            self._reply(Message("welcome", {**welcome, "versions": versions}))
        elif msg.kind == "state_req":
            self._reply(self._state(msg["fragment"], msg["offset"]))
        elif msg.kind == "heartbeat":
            self._reply(Message("ack", {"epoch": EPOCH, "versions": versions, "initialized": True}))
        elif msg.kind == "push":
            self.pushes.append(msg)
        elif msg.kind == "bye" and self.echo_bye:
            self._reply(Message("bye", {"reason": "receipt"}))

    def _state(self, p: int, offset: int) -> Message:
        total = self.sizes[p]
        values = torch.zeros(total)[offset : offset + (1 << 20)]
        meta = {"fragment": p, "version": 0, "offset": offset, "numel": values.numel(), "total": total}
        meta.update(epoch=EPOCH, crc=checksum(torch.zeros(total)))
        return Message("state", meta, [values.numpy().tobytes()])

    def _reply(self, msg: Message) -> None:
        assert self._peer is not None, "a reply goes to the learner that spoke"
        self._sock.send_multipart([self._peer, *encode(msg)])
