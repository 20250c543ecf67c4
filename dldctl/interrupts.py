"""Ctrl-C and SIGTERM for the foreground commands that run until stopped (monkey, experiment, status,
events, logs -f): both raise KeyboardInterrupt, except inside `Interrupts.atomic()`, where the
interrupt waits until the block ends. A fault's injection is such a block: its record is written to
state.json, then applied, and an interrupt between the two would leave a fault the interrupted
command does not know it started (so does not heal) and that lasts to its expiry. A second signal
while one waits interrupts at once: a hung injection (an SSH host gone quiet) can still be stopped.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """SIGTERM, and SIGINT unless ignored (a shell's background job), as KeyboardInterrupt."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: int | None = None

    def handler(self, signum: int, frame: Any) -> None:
        if self.depth and self.pending is None:
            self.pending = signum  # raised when the atomic block ends
            return
        raise KeyboardInterrupt(f"signal {signum}")

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block an interrupt does not cut in two (a second signal still does)."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending is not None:
                signum, self.pending = self.pending, None
                raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def interruptible() -> Iterator[Interrupts]:
    """Inside, SIGTERM (and a SIGINT not ignored) raise KeyboardInterrupt (main thread only: off it,
    the handlers stay as they are); restored after."""
    guard = Interrupts()
    if threading.current_thread() is not threading.main_thread():
        yield guard
        return
    previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    for sig, before in previous.items():
        if before is not signal.SIG_IGN:
            signal.signal(sig, guard.handler)
    try:
        yield guard
    finally:
        for sig, before in previous.items():
            if before is not signal.SIG_IGN:  # None: a handler set outside Python, restored as the default
                signal.signal(sig, signal.SIG_DFL if before is None else before)
