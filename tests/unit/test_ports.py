"""tests/ports.py: a test server's port comes from below the kernel's ephemeral range."""

from __future__ import annotations

import socket

from tests.ports import ephemeral_low, unused_port


def test_the_port_is_free_and_below_the_ephemeral_range() -> None:
    ports = {unused_port() for _ in range(20)}
    assert all(10000 <= p < max(ephemeral_low(), 10001) for p in ports) and len(ports) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # still free
