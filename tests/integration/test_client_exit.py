"""The learner's syncer client at exit: its goodbye leaves even when a large send is still queued.

A real DEALER (the client's own socket) against a bare ROUTER on 127.0.0.1. Closing with linger 0
dropped whatever libzmq had not written yet, so a learner stopped by SIGTERM could leave without a
goodbye (and without its last pushes); the syncer then saw it as unreachable, not as gone.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from learner.client import SyncerClient
from learner.config import LearnerConfig, LearnerSpec
from syncer.protocol import decode
from syncer.settings import RunSettings

pytestmark = pytest.mark.timeout(60)


def _received_kinds(router: zmq.Socket, seconds: float) -> list[str]:
    kinds: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and "bye" not in kinds:
        if router.poll(100, zmq.POLLIN):
            frames = router.recv_multipart(copy=False)[1:]   # drop the routing id
            try:
                kinds.append(decode(frames).kind)
            except Exception:   # the bulk frame is not a protocol message
                kinds.append("raw")
    return kinds


def test_the_goodbye_leaves_behind_a_large_queued_send(tmp_path: Path) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    cfg = LearnerConfig("run", RunSettings(), LearnerSpec("learner-1"), f"tcp://127.0.0.1:{port}", None, None, tmp_path)
    client = SyncerClient(cfg, [], [4], lambda: [], "inc")
    try:
        client._open_socket(time.monotonic())
        client._sock.send(b"x", zmq.SNDMORE)   # a first frame so the bulk frame is not a header
        client._sock.send(bytes(64 << 20))     # 64 MB still being written when the learner stops
        client._welcomed = True
        client._halt.set()
        client.run()                           # the thread body: says bye and closes
        kinds = _received_kinds(router, 30.0)
        assert kinds and kinds[-1] == "bye", kinds
    finally:
        router.close(linger=0)
        ctx.term()
