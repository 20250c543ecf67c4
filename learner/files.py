"""The small files a learner leaves in its work dir for the supervisor: markers (`finished`,
`refused`) and the last replica, each written atomically so a full disk never leaves half a file
nor kills the learner; and `control.json`, the chaos controls it reads (`Controls`)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from learner import corrupt
from learner.logline import log
from syncer.common.atomic import atomic_file, atomic_write
from syncer.common.smallmath import ema


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_marker(path: Path, text: str) -> None:
    """A marker file the supervisor checks for; on a full disk at least the (empty) file, which
    needs no data block, so `finished` still stops restarts."""
    try:
        atomic_write(path, text)
    except OSError as exc:
        log(f"cannot write {path.name} ({exc.strerror or exc}); leaving it empty")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
        except OSError:
            pass


def save_replica(snapshot: Any, path: Path) -> None:
    """replica.pt, atomically (a full disk leaves the previous one, or none, never half a file)."""
    try:
        with atomic_file(path) as fh:
            torch.save(snapshot, fh)
    except (OSError, RuntimeError) as exc:  # torch reports a failed write as RuntimeError
        log(f"cannot write {path.name} ({exc}); the last replica is not kept")


class Controls:
    """Chaos hooks from `control.json` (dldctl chaos slow / partition / corrupt), re-read only
    when the file's mtime changes: `partition_until`, `slow_until` and `corrupt_until` are
    wall-clock deadlines. A value of the wrong type reads as the control being off."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mtime = 0.0
        self.values: dict[str, Any] = {}

    def read(self) -> None:
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            mtime = 0.0
        if mtime != self.mtime:
            self.mtime = mtime
            self.values = read_json(self.path)

    def _number(self, key: str, default: float) -> float:
        value = self.values.get(key, default)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    def partitioned(self) -> bool:
        return time.time() < self._number("partition_until", 0)

    def slow_factor(self) -> float:
        """> 1 while a slow-down is in force: the learner stretches each step by it."""
        if time.time() < self._number("slow_until", 0):
            return max(1.0, self._number("slow_factor", 1.0))
        return 1.0

    def corruption(self) -> tuple[str, float, float] | None:
        """(mode, factor, until) while `dldctl chaos corrupt` is in force (learner/corrupt.py), else None."""
        until, mode = self._number("corrupt_until", 0), self.values.get("corrupt_mode")
        if time.time() >= until or not isinstance(mode, str) or mode not in corrupt.MODES:
            return None
        factor = self._number("corrupt_factor", 0.0)
        return mode, factor if 0 < factor < math.inf else corrupt.default_factor(mode), until


class Slowdown:
    """How long a slowed learner (a host's `throttle`, `dldctl chaos slow`) waits after each step:
    (factor - 1) x the step's compute time, with that time bounded by STRETCH x its running
    average. A step the process spent stopped in (a chaos pause: SIGSTOP) or swapped out is not
    compute: unbounded, a 20 s pause kept a throttled learner idle for 20 s more after it resumed."""

    STRETCH = 3.0

    def __init__(self) -> None:
        self.average: float | None = None  # of the bounded compute times

    def wait_s(self, compute: float, factor: float) -> float:
        bounded = compute if self.average is None else min(compute, self.STRETCH * self.average)
        self.average = ema(self.average, bounded)
        return max(0.0, factor - 1.0) * bounded
