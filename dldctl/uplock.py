"""One `dldctl up` of a run at a time: an advisory lock per run name in $DLDCTL_HOME/locks.

Two `up` of one inventory started together both found no live run and started two (two
supervisors, two syncers, twice the learners). Each `up` and `up --resume` now holds
`locks/<name>.lock` (flock, exclusive, not waiting) from its look for a live run until it
returns; a second is refused with one line naming the run and the holder's pid. The kernel
drops the lock when its process ends, however it ends: a crashed `up` never leaves it held.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from dldctl.errors import UsageError
from dldctl.rundir import home


@contextlib.contextmanager
def holding(name: str) -> Iterator[None]:
    """Hold run `name`'s lock for the block; UsageError at once if another process holds it."""
    path = home() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise UsageError(
                f"another `dldctl up` of run {name} is under way (pid {holder})",
                hint="wait for it to return; `dldctl up` again then converges the run to the inventory",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
