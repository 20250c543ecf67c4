"""Reading a pseudo-terminal's screen in the end-to-end tests: wait for a pattern in what the
program drew, with its control sequences (colours, cursor moves) taken out."""

from __future__ import annotations

import os
import re
import select
import time


def read_until(fd: int, pattern: bytes, timeout: float) -> tuple[bool, bytes]:
    """Read the terminal until `pattern` (a regular expression) shows in its text; whether it did,
    and the text that came."""
    seen, deadline = bytearray(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen.extend(chunk)
        if re.search(pattern, plain(seen)):
            return True, plain(seen)
    return bool(re.search(pattern, plain(seen))), plain(seen)


def plain(screen: bytes | bytearray) -> bytes:
    """The terminal's output without its control sequences (colours, cursor moves)."""
    return re.sub(rb"\x1b(\[[0-9;?]*[ -/]*[@-~]|[()][0-9A-Za-z]|[=>78])", b"", bytes(screen))
