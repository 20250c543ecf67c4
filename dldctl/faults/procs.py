"""Injecting and undoing faults on a run's processes: a thin layer over the host interface.

    kill       signal the process group (the supervisor restarts it after its delay / --down-for)
    pause      SIGSTOP the group; undo: SIGCONT (a hung straggler)
    slow       the learner sleeps (F-1) x its compute time after each step; undo: factor 1
    partition  the learner closes its socket to the syncer and ignores it; undo: reconnect
    corrupt    the learner damages its weights or its pushes (dldctl/chaos/corruption.py's modes,
               done by learner/corrupt.py); undo: it stops

slow, partition and corrupt go through the learner's `control.json` (written atomically on its
host) and carry their own expiry time, so they end on time even if nobody is left to undo them;
pause is undone by the supervisor (or the command that paused, if it is still running).
"""

from __future__ import annotations

import json
import signal
import time
from typing import Any

from dldctl.hostruntime import HostRuntime
from dldctl.hosts import Host, ProcRef

KINDS = ("kill", "pause", "slow", "partition", "corrupt")


def control_file(runtime: HostRuntime, lid: str) -> str:
    return f"{runtime.learner_workdir(lid)}/control.json"


def read_control(host: Host, runtime: HostRuntime, lid: str) -> dict[str, Any]:
    path = control_file(runtime, lid)
    try:
        data = json.loads(host.read_bytes(path) or b"{}") if host.exists(path) else {}
    except ValueError:
        data = {}
    return data if isinstance(data, dict) else {}


def write_control(host: Host, runtime: HostRuntime, lid: str, updates: dict[str, Any]) -> None:
    """Merge `updates` into the learner's control.json (atomic on its host)."""
    data = read_control(host, runtime, lid)
    data.update(updates)
    host.mkdir(runtime.learner_workdir(lid))
    host.put_bytes(json.dumps(data).encode(), control_file(runtime, lid), 0o644)


def apply(
    kind: str,
    host: Host,
    runtime: HostRuntime,
    target: str,
    proc: ProcRef | None,
    duration: float,
    factor: float = 1.0,
    sig: int = signal.SIGKILL,
    mode: str = "",
) -> bool:
    """Inject a fault (`mode`: corrupt's); False if the target process was not there to receive it."""
    until = time.time() + duration
    if kind == "kill":
        return proc is not None and host.signal(proc, sig, group=True)
    if kind == "pause":
        return proc is not None and host.signal(proc, signal.SIGSTOP, group=True)
    if kind == "slow":
        write_control(host, runtime, target, {"slow_factor": factor, "slow_until": until})
        return True
    if kind == "partition":
        write_control(host, runtime, target, {"partition_until": until})
        return True
    if kind == "corrupt":
        write_control(host, runtime, target, {"corrupt_mode": mode, "corrupt_factor": factor, "corrupt_until": until})
        return True
    raise ValueError(f"unknown fault kind {kind!r}")


def undo(kind: str, host: Host, runtime: HostRuntime, target: str, proc: ProcRef | None) -> bool:
    """Undo a fault (idempotent); False if there was nothing left to undo."""
    if kind == "pause":
        return proc is not None and host.signal(proc, signal.SIGCONT, group=True)
    if kind == "slow":
        write_control(host, runtime, target, {"slow_factor": 1.0, "slow_until": 0})
        return True
    if kind == "partition":
        write_control(host, runtime, target, {"partition_until": 0})
        return True
    if kind == "corrupt":
        write_control(host, runtime, target, {"corrupt_until": 0})
        return True
    return False  # kill: the supervisor's restart is the undo
