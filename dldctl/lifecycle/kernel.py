"""The syncer's native merge kernel as a declared step of `dldctl up` and a line of `dldctl check`.

The syncer runs on this machine, so the kernel is built here, by the same Python, into the same
cache the syncer loads it from (`python -m syncer.native`, run as a process: dldctl never imports
the syncer's server side). Without a C compiler the syncer still works, merging with torch; the
operator is told so before the run instead of finding a slower merge later. A syncer on another
host builds its own kernel when it starts (nothing is built here, where torch may be missing).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from dldctl import extras
from dldctl.inventory import Inventory


@dataclass(frozen=True)
class KernelStatus:
    ok: bool
    detail: str  # the library's path, or why there is none
    elsewhere: str = ""  # the syncer's host when it is not this machine (it builds the kernel there)
    runnable: bool = True  # False: the syncer cannot run here at all (no torch)

    def line(self) -> str:
        if not self.runnable:
            return f"the syncer cannot run on this machine: {self.detail}"
        if self.elsewhere:
            return f"native merge kernel: built on {self.elsewhere}, where the syncer runs, when it starts"
        if self.ok:
            return f"native merge kernel ready ({self.detail})"
        return f"native merge kernel unavailable ({self.detail}): the syncer merges with torch, slower"


def for_syncer(inv: Inventory) -> KernelStatus:
    """`build()` when the syncer runs on this machine; else a status naming its host."""
    if not extras.syncer_here(inv):
        return KernelStatus(True, "", elsewhere=inv.syncer.host)
    if not extras.installed("torch"):  # `up` refuses before this; `check` reports it
        return KernelStatus(False, f"this Python has no torch ({extras.fix('torch')})", runnable=False)
    return build()


def build(python: str = sys.executable, timeout_s: float = 180.0) -> KernelStatus:
    """Build or find the kernel now; never raises (a failure is a status, not an error)."""
    try:
        proc = subprocess.run(
            [python, "-m", "syncer.native"], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return KernelStatus(False, f"could not run {python} -m syncer.native: {exc}")
    lines = proc.stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        return KernelStatus(False, tail[-1][:200] if tail else f"exit status {proc.returncode}")
    return KernelStatus(bool(doc.get("ok")), str(doc.get("path") or doc.get("problem") or "unknown"))
