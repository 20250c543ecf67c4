"""A learner-like protocol client for tests: speaks the real wire protocol, step by step.

Unlike `learner.client.SyncerClient` (a background thread that hides timing), this one lets a
test decide exactly when a push leaves and with which counters, to pin down quorum, grace-window
and weighting behaviour of a real syncer process.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from syncer.common import keys
from syncer.wire import codec, fragments, quant
from syncer.wire.protocol import Message, decode, encode

# a small manifest: 6 tensors, 4 fragments
MANIFEST = [
    fragments.TensorSpec("wte", (32, 8), "embedding"),
    fragments.TensorSpec("a", (64,)),
    fragments.TensorSpec("b", (16, 8)),
    fragments.TensorSpec("c", (40,)),
    fragments.TensorSpec("d", (8, 8)),
    fragments.TensorSpec("e", (24,)),
]


class ProtoClient:
    """One DEALER connection to a syncer, driven synchronously by a test."""

    def __init__(
        self,
        address: str,
        learner: str,
        run_id: str,
        keydir: Path | None,
        key_name: str | None = None,
        fragments_count: int = 4,
        manifest: list[fragments.TensorSpec] | None = None,
    ) -> None:
        self.learner = learner
        self.run_id = run_id
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 5000)  # a refused handshake leaves no pipe: never block a test
        if keydir is not None:
            name = key_name or learner
            self.sock.curve_publickey, self.sock.curve_secretkey = keys.load_pair(keydir / f"{name}.key_secret")
            self.sock.curve_serverkey = keys.load_public(keydir / "syncer.key")
        self.sock.connect(address)
        self.manifest = manifest or MANIFEST
        self.plan = fragments.plan(self.manifest, fragments_count)
        self.incarnation = f"{os.getpid()}-{learner}-{time.monotonic_ns()}"
        self.inbox: list[Message] = []
        self.seq = 0

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def send(self, msg: Message) -> None:
        self.sock.send_multipart(encode(msg))

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, kind: str, timeout: float = 5.0, keep_others: bool = True) -> Message:
        """The next message of `kind` (others are kept in `inbox`)."""
        for i, msg in enumerate(self.inbox):
            if msg.kind == kind:
                return self.inbox.pop(i)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
                msg = decode(self.sock.recv_multipart())
                if msg.kind == kind:
                    return msg
                if keep_others:
                    self.inbox.append(msg)
        raise TimeoutError(f"{self.learner}: no {kind!r} within {timeout} s (inbox: {[m.kind for m in self.inbox]})")

    def poll_silent(self, timeout: float) -> bool:
        """True if nothing at all arrives within `timeout` (e.g. refused by CURVE)."""
        return not self.sock.poll(int(timeout * 1000))

    def hello(self) -> Message:
        self.send_hello()
        return self.recv("welcome")

    def send_hello(self) -> None:
        self.send(
            Message(
                "hello",
                {
                    "learner": self.learner,
                    "incarnation": self.incarnation,
                    "run": self.run_id,
                    "pid": os.getpid(),
                    "host": "test",
                    "device": "cpu",
                    "batch_size": 4,
                    "codecs": list(quant.MODES),
                    "manifest": fragments.manifest_to_json(self.manifest),
                    "fragments": self.plan.count,
                },
            )
        )

    def upload_init(self, values: list[torch.Tensor]) -> None:
        for p, t in enumerate(values):
            self.send(
                Message(
                    "init", {"fragment": p, "offset": 0, "numel": t.numel(), "total": t.numel()}, [t.numpy().tobytes()]
                )
            )

    def fetch(self) -> list[torch.Tensor]:
        out = []
        for p in range(self.plan.count):
            self.send(Message("state_req", {"fragment": p, "offset": 0}))
            msg = self.recv("state")
            out.append(torch.frombuffer(bytearray(msg.payloads[0]), dtype=torch.float32))
        return out

    def fetch_chunked(self) -> tuple[list[int], list[torch.Tensor]]:
        """(versions, values) of every fragment, in the syncer's chunks, each fragment pinned to
        the version of its first chunk (as learner.replica does)."""
        versions, out = [], []
        for p in range(self.plan.count):
            total, offset, version, parts = self.plan.numel(p), 0, -1, []
            while offset < total:
                self.send(Message("state_req", {"fragment": p, "offset": offset, "version": version}))
                msg = self.recv("state")
                assert version in (-1, msg["version"]), "the version moved while fetching"
                version = msg["version"]
                parts.append(torch.frombuffer(bytearray(msg.payloads[0]), dtype=torch.float32))
                offset += msg["numel"]
            versions.append(version)
            out.append(torch.cat(parts))
        return versions, out

    def push(
        self,
        p: int,
        delta: torch.Tensor,
        c_steps: int,
        c_tokens: int,
        step_time: float = 0.05,
        base_version: int = 0,
        compression: str = "int4",
        block: int = 128,
        blob: bytes | None = None,
    ) -> None:
        """Push `delta` coded in `compression` (or `blob` as it is: a malformed one)."""
        self.seq += 1
        self.send(
            Message(
                "push",
                {
                    "fragment": p,
                    "base_version": base_version,
                    "seq": self.seq,
                    "epoch": 1,
                    "c_steps": c_steps,
                    "c_tokens": c_tokens,
                    "c_time": c_steps * step_time,
                    "step_time": step_time,
                },
                [blob if blob is not None else codec.encode(delta, compression, block)],
            )
        )

    def heartbeat(self, **stats: Any) -> None:
        meta = {"step": 1, "tokens": 1, "state": "running", **stats}
        self.send(Message("heartbeat", meta))


def initial_values(plan: fragments.FragmentPlan, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in plan.sizes()]
