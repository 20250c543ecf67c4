"""The syncer's native merge kernel as a declared step of `dldctl up` and a line of `dldctl check`.

The syncer runs on this machine, so the kernel is built here, by the same Python, into the same
cache the syncer loads it from (`python -m syncer.native`, run as a process: dldctl never imports
the syncer's server side). Without a C compiler the syncer still works, merging with torch; the
operator is told so before the run instead of finding a slower merge later.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelStatus:
    ok: bool
    detail: str  # the library's path, or why there is none

    def line(self) -> str:
        if self.ok:
            return f"native merge kernel ready ({self.detail})"
        return f"native merge kernel unavailable ({self.detail}): the syncer merges with torch, slower"


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
