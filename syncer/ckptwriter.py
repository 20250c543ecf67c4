"""The syncer's checkpoint writer: one checkpoint at a time, written on a thread of its own.

A checkpoint of gpt2-124m's syncer is 1.5 GB (parameters, momentum, residual); serializing,
hashing and writing it took 8-17 s, and written in the loop it stopped the syncer that long
(no heartbeat answered, learners reconnecting, rounds late: bench/loadgen.py). The loop now hands
the writer a snapshot (`checkpoint.state_dict(copy=True)`: the vectors lent copy-on-write, the
counters copied) and goes on merging; it polls `result()` each tick and accounts for the
checkpoint once it is on disk. A failed write (a full disk) comes back as the error, never as an
exception in the loop.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from syncer import checkpoint


@dataclass
class Written:
    """One finished write: the state it held, where it went (None if it failed) and why not."""

    state: dict[str, Any]
    path: Path | None
    error: str | None
    took_s: float
    final: bool
    size: int = 0  # bytes on disk


class CheckpointWriter:
    """Writes `checkpoint.save(directory, state, keep)` off the caller's thread, one at a time."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory, self.keep = directory, keep
        self._thread: threading.Thread | None = None
        self._done: Written | None = None

    @property
    def busy(self) -> bool:
        """Whether a write is under way or its result has not been taken yet."""
        return self._thread is not None

    def start(self, state: dict[str, Any], final: bool = False) -> None:
        """Begin writing `state` (a snapshot: nothing may change it while it is written)."""
        assert self._thread is None, "one checkpoint at a time"
        self._thread = threading.Thread(target=self._write, args=(state, final), name="checkpoint", daemon=True)
        self._thread.start()

    def write(self, state: dict[str, Any], final: bool = False) -> Written:
        """Write `state` now, on this thread (take a write under way first: `wait`)."""
        assert self._thread is None, "one checkpoint at a time"
        self._write(state, final)
        done, self._done = self._done, None
        assert done is not None
        return done

    def result(self) -> Written | None:
        """The finished write, once (None while it runs or when none was started)."""
        if self._thread is None or self._thread.is_alive():
            return None
        self._thread.join()
        self._thread = None
        done, self._done = self._done, None
        return done

    def wait(self, timeout: float | None = None) -> Written | None:
        """Block until the write under way (if any) has finished; its result, once."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.result()

    def _write(self, state: dict[str, Any], final: bool) -> None:
        began = time.monotonic()
        try:
            path: Path | None = checkpoint.save(self.directory, state, self.keep)
            error = None
        except checkpoint.CheckpointError as exc:
            path, error = None, str(exc)
        except Exception as exc:  # a bug in a write must not end the syncer's run
            path, error = None, f"{type(exc).__name__}: {exc}"
        try:
            size = path.stat().st_size if path is not None else 0
        except OSError:
            size = 0
        self._done = Written(state, path, error, time.monotonic() - began, final, size)
