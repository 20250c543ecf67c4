"""Named fault points for crash tests (a leaf; stdlib only; off unless the variable is set).

    DLDCTL_FAULT_POINTS="checkpoint@3=30,merge=2"

makes the process print `fault point <name>` and sleep that many seconds when it reaches the
point (the first time, or the N-th time with `@N`: "checkpoint@3" pauses in the third checkpoint
write, after two good ones), so a test can SIGKILL it at exactly the worst moment: mid checkpoint write, mid merge,
while serving state to a joiner (syncer); mid state fetch, mid push (learner); or interrupt
`dldctl up` with the run directory made (`up_created`) or the supervisor started (`up_started`). Like torchft's
tests that inject failures at named steps, but against real processes.
"""

from __future__ import annotations

import os
import sys
import time

POINTS = ("checkpoint", "merge", "serve_state", "fetch", "push", "bad_round", "up_created", "up_started")


def _parse(spec: str) -> dict[str, tuple[int, float]]:
    """{point: (hit number, seconds)} from "name[@N][=seconds]" items; anything else is ignored."""
    out: dict[str, tuple[int, float]] = {}
    for item in spec.split(","):
        head, _, seconds = item.partition("=")
        name, _, nth = head.strip().partition("@")
        if name in POINTS:
            try:
                out[name] = (max(1, int(nth or 1)), float(seconds or 1.0))
            except ValueError:
                continue
    return out


_ACTIVE = _parse(os.environ.get("DLDCTL_FAULT_POINTS", ""))
_HITS: dict[str, int] = {}


def hit(name: str) -> None:
    """Pause at `name` if the environment asks for it (once per process and point, at its N-th hit)."""
    if name not in _ACTIVE:
        return
    _HITS[name] = _HITS.get(name, 0) + 1
    nth, seconds = _ACTIVE[name]
    if _HITS[name] == nth:
        del _ACTIVE[name]
        print(f"fault point {name} (hit {nth}): pausing {seconds:g} s", file=sys.stdout, flush=True)
        time.sleep(seconds)


def fires(name: str) -> float | None:
    """For points that inject damage instead of a pause ("bad_round@N=scale": after the N-th
    merge the syncer adds noise of that scale to its global model, for the quality guard's
    test): the value once, at the N-th hit; None otherwise."""
    if name not in _ACTIVE:
        return None
    _HITS[name] = _HITS.get(name, 0) + 1
    nth, value = _ACTIVE[name]
    if _HITS[name] != nth:
        return None
    del _ACTIVE[name]
    print(f"fault point {name} (hit {nth}): {value:g}", file=sys.stdout, flush=True)
    return value
