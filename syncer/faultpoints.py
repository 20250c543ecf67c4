"""Named fault points for crash tests (a leaf; stdlib only; off unless the variable is set).

    DLDCTL_FAULT_POINTS="checkpoint=3,merge=2"

makes the process print `fault point <name>` and sleep that many seconds when it reaches the
point, so a test can SIGKILL it at exactly the worst moment: mid checkpoint write, mid merge,
while serving state to a joiner (syncer); mid state fetch, mid push (learner). Like torchft's
tests that inject failures at named steps, but against real processes.
"""

from __future__ import annotations

import os
import sys
import time

POINTS = ("checkpoint", "merge", "serve_state", "fetch", "push")


def _parse(spec: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in spec.split(","):
        name, _, seconds = item.partition("=")
        if name.strip() in POINTS:
            try:
                out[name.strip()] = float(seconds or 1.0)
            except ValueError:
                continue
    return out


_ACTIVE = _parse(os.environ.get("DLDCTL_FAULT_POINTS", ""))


def hit(name: str) -> None:
    """Pause at `name` if the environment asks for it (once per process and point)."""
    seconds = _ACTIVE.pop(name, None)
    if seconds is not None:
        print(f"fault point {name}: pausing {seconds:g} s", file=sys.stdout, flush=True)
        time.sleep(seconds)
