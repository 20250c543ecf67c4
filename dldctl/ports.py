"""Free TCP ports for the syncer (and its shards), taken below the kernel's ephemeral range.

A port picked now and bound by another process seconds later must not be one the kernel can hand
out meanwhile: every outgoing connection takes its source port from the ephemeral range
(net.ipv4.ip_local_port_range, 32768-60999 by default). Worse, while a syncer is down (restarting,
or stopped by chaos), the learners on its machine keep redialing its port; a dial from inside that
range can get the port itself as its source port, a TCP self-connect, and then holds it just when
the supervisor restarts the syncer, which fails with "Address already in use". A port below the
range is never a source port, so only a listener can take it.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below this lie the well-known and registered ports most daemons use
TRIES = 200


def ephemeral_low(read: Callable[[], str] = RANGE_FILE.read_text) -> int:
    """The first port of this machine's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port in [10000, the ephemeral range) that nothing at `host` holds now (bound a moment
    ago); a port from the kernel (bind to 0) where that range is all taken or empty."""
    top = ephemeral_low()
    rng = random.Random()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(TRIES if top > LOWEST else 0):
        port = rng.randrange(LOWEST, top)
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as s:
        s.bind((host, 0))
        got: int = s.getsockname()[1]
        return got
