"""A free TCP port for a test's server that a process other than the test binds later.

Taken below the kernel's ephemeral range (net.ipv4.ip_local_port_range): a port from inside it can
be handed to any outgoing connection in the seconds before the server binds, and to a client that
dials it before the server listens as its own source port (a TCP self-connect: the client talks
to itself until it times out). Both made two torch ranks miss their rendezvous once in this suite.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def unused_port(host: str = "127.0.0.1") -> int:
    """A port in [10000, the ephemeral range) that `host` lets us bind now."""
    top = max(ephemeral_low(), 10001)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [10000, {top}) at {host}")
