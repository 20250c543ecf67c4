"""The learner's syncer client at exit: it waits for the receipt of its goodbye before closing.

A real DEALER (the client's own socket) against a bare ROUTER on 127.0.0.1 standing in for the
syncer at the socket seam (the real syncer's echo is covered by the SIGTERM test in
test_learners.py). The socket closes with LINGER 0, which drops what libzmq has not written yet:
without the wait, a learner stopped by SIGTERM behind a large push could leave without a goodbye
(and without that push), and the syncer saw it as unreachable instead of gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from learner.client import SyncerClient
from learner.config import LearnerConfig, LearnerSpec
from syncer.common.settings import RunSettings
from syncer.wire.protocol import Message, ProtocolError, decode, encode

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def router() -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock
    finally:
        sock.close(linger=0)
        ctx.term()


def _serve(router: zmq.Socket, echo: bool, kinds: list[str]) -> None:
    """Receive until the bye (recording message kinds); answer it with the receipt if echo."""
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline and "bye" not in kinds:
        if router.poll(100, zmq.POLLIN):
            frames = router.recv_multipart(copy=False)
            try:
                kinds.append(decode(frames[1:]).kind)
            except ProtocolError:  # the bulk frame is not a protocol message
                kinds.append("raw")
    if echo and "bye" in kinds:
        router.send_multipart([frames[0].bytes, *encode(Message("bye", {"reason": "receipt"}))])


def _stop_behind_a_large_send(router: zmq.Socket, tmp_path: Path, echo: bool) -> tuple[SyncerClient, list[str], float]:
    address = router.getsockopt(zmq.LAST_ENDPOINT).decode()
    cfg = LearnerConfig("run", RunSettings(), LearnerSpec("learner-1"), address, None, None, tmp_path)
    client = SyncerClient(cfg, [], [4], list, "inc")
    kinds: list[str] = []
    server = threading.Thread(target=_serve, args=(router, echo, kinds), daemon=True)
    server.start()
    client._open_socket(time.monotonic())
    client._sock.send_multipart([b"x", bytes(64 << 20)])  # 64 MB still being written at the stop
    client._welcomed = True
    client._halt.set()
    started = time.monotonic()
    client.run()  # the thread body: says bye, closes
    took = time.monotonic() - started
    server.join(35.0)
    return client, kinds, took


def test_the_goodbye_leaves_behind_a_large_send_and_is_confirmed(router: zmq.Socket, tmp_path: Path) -> None:
    client, kinds, _ = _stop_behind_a_large_send(router, tmp_path, echo=True)
    assert kinds == ["raw", "bye"], kinds
    assert client.goodbye_confirmed


def test_a_syncer_that_never_confirms_costs_at_most_the_wait(router: zmq.Socket, tmp_path: Path) -> None:
    client, _, took = _stop_behind_a_large_send(router, tmp_path, echo=False)
    assert not client.goodbye_confirmed
    assert took < 4.0, f"the exit waited {took:.1f} s for a receipt that never came"
