"""Processes a harness started, known by pid (and start time) only, never by name: whether one
still runs (`alive`), a signal to it or to the group it leads (`signal_pid`), and `Processes`,
named processes each spawned in its own session and always stopped at the end (tests/localrun.py
runs a syncer and learners on it without dldctl)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dldctl.hosts.local import read_stat


def alive(pid: int, start_ticks: int) -> bool:
    """Whether `pid` is running and is still the process that started at `start_ticks`."""
    stat = read_stat(pid)
    return stat is not None and stat.start_ticks == start_ticks and stat.state not in "ZX"


def signal_pid(pid: int, sig: int) -> bool:
    """Send `sig` to the process group `pid` leads, or to `pid` alone if it leads none; False if gone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class Processes(Mapping[str, subprocess.Popen[Any]]):
    """Processes a harness started itself, by name (the latest of a name; all are stopped)."""

    def __init__(self) -> None:
        self._latest: dict[str, subprocess.Popen[Any]] = {}
        self._all: list[subprocess.Popen[Any]] = []

    def __getitem__(self, name: str) -> subprocess.Popen[Any]:
        return self._latest[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._latest)

    def __len__(self) -> int:
        return len(self._latest)

    def add(self, name: str, proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
        """Track `proc` (started elsewhere) under `name`; it is stopped in `stop()`."""
        self._latest[name] = proc
        self._all.append(proc)
        return proc

    def spawn(self, name: str, argv: list[str], *, log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen[Any]:
        """Start `argv` in its own session (a process group to kill), stdout and stderr appended to `log`."""
        with open(log, "ab") as out:  # the child holds its own descriptor
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
        return self.add(name, proc)

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout: float = 30) -> None:
        """Send `sig` to `name`'s process (its group) if it still runs, and wait for it to exit."""
        proc = self._latest[name]
        if proc.poll() is None:
            signal_pid(proc.pid, sig)
        proc.wait(timeout=timeout)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop every process still running: SIGTERM and up to `grace_s` s to exit (if > 0), then SIGKILL."""
        running = [p for p in self._all if p.poll() is None]
        if grace_s > 0:
            for proc in running:
                signal_pid(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(p.poll() is None for p in running):
                time.sleep(0.1)
        for proc in running:
            if proc.poll() is None:
                signal_pid(proc.pid, signal.SIGKILL)
        for proc in running:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
