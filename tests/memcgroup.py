"""A real memory cgroup for a test: a child of this process's own, with a limit, removed after.

The kernel enforces and reports its limit: a process started in it (`command(...)`) sees it in
/proc/self/cgroup and its memory files, as a process in a container or a Slurm job sees its own.
cgroup v1 (a `memory` hierarchy) or v2 (where the parent delegates the memory controller); None
from `unavailable()` when neither can be made here (not root, no memory controller).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from syncer.common import hostmem


def _own(version: str) -> tuple[Path, str] | None:
    """(directory of this process's cgroup, limit file name) for cgroup `version` ("v1"/"v2"),
    as the syncer finds it (syncer/common/hostmem.py); None where v2 does not delegate memory."""
    for key, point, parts in hostmem.own_cgroups():
        if key != version:
            continue
        where = Path(point, *parts)
        if key == "v2" and "memory" not in (where / "cgroup.subtree_control").read_text().split():
            return None
        return where, "memory.max" if key == "v2" else "memory.limit_in_bytes"
    return None


def unavailable() -> str | None:
    """Why no memory cgroup can be made here, or None."""
    if os.geteuid() != 0:
        return "a memory cgroup needs root"
    for version in ("v1", "v2"):
        try:
            own = _own(version)
        except OSError:
            continue
        if own is not None and os.access(own[0], os.W_OK):
            return None
    return "no writable memory cgroup (v1 memory hierarchy or v2 with the memory controller delegated)"


@contextlib.contextmanager
def limited(limit_bytes: int) -> Iterator[list[str]]:
    """A child cgroup limited to `limit_bytes`; yields the argv prefix that runs a command in it.
    Removed on exit, after SIGKILL to any process still in it (only ours can be: a test's command
    and what it started, say a fleet the test expected to be refused)."""
    with cgroup(limit_bytes) as child:
        procs = shlex.quote(str(child / "cgroup.procs"))
        yield ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh"]


@contextlib.contextmanager
def cgroup(limit_bytes: int) -> Iterator[Path]:
    """The directory of a child cgroup limited to `limit_bytes` (write a pid to its cgroup.procs
    to move that process in); removed on exit as `limited`'s is."""
    own = next(o for v in ("v1", "v2") if (o := _own(v)) is not None and os.access(o[0], os.W_OK))
    child = own[0] / f"dldctl-test-{os.getpid()}"
    child.mkdir()
    try:
        (child / own[1]).write_text(str(limit_bytes))
        yield child
    finally:
        _empty(child)
        child.rmdir()


def _empty(child: Path) -> None:
    """SIGKILL what is left in `child` and wait (up to 10 s) until the kernel has moved it out."""
    deadline = time.monotonic() + 10
    while pids := [int(p) for p in (child / "cgroup.procs").read_text().split()]:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
