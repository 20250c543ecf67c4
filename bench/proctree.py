"""Processes found and signalled through /proc, never by name: a job's descendants, the RANK torchrun
gave a worker, and signals that check a pid still belongs to the process it named (no pid reuse).

Linux only (it reads /proc/PID/stat and /proc/PID/environ); `bench/ddp_baseline.py` uses it to find
and kill torchrun's workers, which live in their own sessions (a killpg of the agent misses them).
"""

from __future__ import annotations

import os
from pathlib import Path


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    if rest[0] == "Z":
        return None  # a zombie: dead, only waiting to be reaped
    return int(rest[1]), int(rest[19])


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live process below `root`, found by walking /proc (never by name)."""
    parent: dict[int, int] = {}
    start: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None:
                parent[int(entry)], start[int(entry)] = st
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in found:
                found[child] = start[child]
                frontier.append(child)
    return found


def worker_rank(pid: int) -> int | None:
    """The RANK torchrun gave a worker (from its environment), or None."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def signal_if_same(pid: int, start: int, sig: int) -> bool:
    """Send `sig` to `pid` only if it is still the process that started at `start` (no pid reuse)."""
    st = proc_stat(pid)
    if st is None or st[1] != start:
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
