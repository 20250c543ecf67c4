"""The supervisor's watchdog: nobody supervises alone.

`dldctl up` starts two processes on the operator machine, and each keeps the other alive:

    supervisor   `python -m dldctl.supervise.supervisor`: keeps the fleet at its size; touches
                 RUN/supervisor.beat every loop (its heartbeat) and restarts a dead watchdog
    watchdog     `python -m dldctl.supervise.watchdog` (this module): every CHECK_S looks at the supervisor
                 (pid + start time, heartbeat) and restarts it when its pid is dead, or kills and
                 restarts it when it has not beaten for HUNG_S; a capped exponential backoff while
                 the restarted one keeps dying within FAST_S; events `supervisor_lost`,
                 `supervisor_restarted`

Both are recorded in state.json (`supervisor`, `watchdog`: pid, start_ticks, started, restarts)
and in procs.jsonl. `respawn` starts one of them under the state lock, and only while the run is
`starting`/`up` and the recorded one is dead: so there is never a second of either, and once
`dldctl down` has marked the run `stopping` neither brings the other back, while whatever started
before is already in procs.jsonl for `down` to stop. The rule for "missing / stale / hung" is the
pure `reconcile.supervisor_health`, the same one `dldctl status` reports.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from dldctl.errors import DldError, RunError
from dldctl.hosts import LocalHost, ProcRef
from dldctl.rundir import RunDir, proc_alive
from dldctl.runstate import Daemon, PidRecord
from dldctl.supervise import decisionlog, reconcile

CHECK_S = 1.0
FAST_S = 30.0  # a restarted supervisor that dies sooner than this is a fast death: back off
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 60.0
ROLES = ("supervisor", "watchdog")


def beat_path(run: RunDir) -> Path:
    return run.path / "supervisor.beat"


def beat(run: RunDir) -> None:
    """The supervisor's heartbeat: the beat file's mtime (utime needs no free disk space)."""
    path = beat_path(run)
    try:
        os.utime(path)
    except FileNotFoundError:
        try:
            path.touch()
        except OSError:
            pass
    except OSError:
        pass


def last_beat(run: RunDir) -> float | None:
    try:
        return beat_path(run).stat().st_mtime
    except OSError:
        return None


def alive(record: PidRecord | Daemon | None) -> bool:
    """Whether a recorded pid (and start time) is a live process on this machine (not reused)."""
    return record is not None and proc_alive(record.pid, record.start_ticks)


def log_path(run: RunDir, role: str) -> Path:
    return run.supervisor_log if role == "supervisor" else run.path / "watchdog.log"


def respawn(run: RunDir, role: str) -> tuple[ProcRef, Daemon | None] | None:
    """Start `role` unless the run is not live or the recorded one is alive; returns the new
    process and the record of the one it replaces (None for the first), or None if it started none."""
    assert role in ROLES
    with run.locked():
        state = run.read_state()
        before = state.daemon(role)
        if state.status not in reconcile.LIVE or alive(before):
            return None
        ref = LocalHost("local").start(
            [sys.executable, "-m", f"dldctl.supervise.{role}", "--run", str(run.path)],
            cwd=str(run.path),
            log=str(log_path(run, role)),
        )
        run.record_proc(role, "local", {"pid": ref.pid, "start_ticks": ref.start_ticks})
        restarts = before.restarts + 1 if before is not None else 0
        run.write_state(state.with_daemon(role, Daemon(ref.pid, ref.start_ticks, time.time(), restarts)))
    return ref, before


class Backoff:
    """Restarts of one process: at once, then doubling delays while each restarted one dies fast."""

    def __init__(self, base: float = BACKOFF_BASE_S, cap: float = BACKOFF_CAP_S) -> None:
        self.base, self.cap = base, cap
        self.fast = 0
        self.not_before = 0.0

    def ready(self, now: float) -> bool:
        return now >= self.not_before

    def restarted(self, lived: float | None, now: float) -> float:
        """Record a restart of one that lived `lived` s; returns the delay before the next may happen."""
        self.fast = self.fast + 1 if lived is not None and lived < FAST_S else 0
        delay = reconcile.backoff_delay(self.fast, self.base, self.cap) if self.fast else 0.0
        self.not_before = now + delay
        return delay


class Watchdog:
    """The loop that keeps one run's supervisor alive."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.stop = threading.Event()
        self.backoff = Backoff()
        self.lost: str | None = None  # why the supervisor is missing, from when we noticed until it is back

    def loop(self) -> None:
        self.run.event("watchdog_start", "watchdog", f"pid {os.getpid()}; watching the supervisor every {CHECK_S:g} s")
        while not self.stop.is_set() and self.step():
            self.stop.wait(CHECK_S)
        self.run.event("watchdog_stop", "watchdog", f"pid {os.getpid()}")

    def step(self) -> bool:
        """One look at the supervisor (and a restart if due); False once the watchdog should exit."""
        if not self.run.state_file.exists():
            return False  # the run directory is gone
        try:
            state = self.run.read_state()
        except RunError:
            return True  # corrupt: `down` still finds us in procs.jsonl
        if state.status not in reconcile.LIVE:
            return False
        mine = state.watchdog
        if mine is not None and mine.pid != os.getpid() and alive(mine):
            return False  # another watchdog is the recorded one
        record = state.supervisor
        now = time.time()
        health = reconcile.supervisor_health(record, alive(record), last_beat(self.run), now, state.status)
        if health in ("ok", "stale"):
            self.lost = None
            return True
        if self.lost is None:
            self.lost = self._why(record, health, now)
            self.run.event("supervisor_lost", "supervisor", f"{self.lost}; restarting it")
        if self.backoff.ready(time.monotonic()):
            self._restart(record, health, now)
        return True

    def _why(self, record: Daemon | None, health: str, now: float) -> str:
        heard = reconcile.last_heard(record, last_beat(self.run))
        ago = f"last heartbeat {now - heard:.1f} s ago" if heard is not None else "it never beat"
        pid = record.pid if record is not None else None
        return f"pid {pid} {'is dead' if health == 'missing' else 'is hung'} ({ago})"

    def _restart(self, record: Daemon | None, health: str, now: float) -> None:
        if health == "hung" and record is not None:
            self._kill(ProcRef(record.pid, record.start_ticks))
        try:
            started = respawn(self.run, "supervisor")
        except DldError as exc:
            delay = self.backoff.restarted(0.0, time.monotonic())
            self.run.event("supervisor_restart_failed", "supervisor", f"{exc.line()}; next try in {delay:.0f} s")
            return
        if started is None:
            return  # someone else restarted it, or the run is stopping
        ref, before = started
        lived = now - before.started if before is not None and before.started is not None else None
        delay = self.backoff.restarted(lived, time.monotonic())
        then = f"; it died within {FAST_S:.0f} s, so the next restart waits {delay:.0f} s" if delay else ""
        self.run.event("supervisor_restarted", "supervisor", f"{self.lost}; new pid {ref.pid}{then}")
        self.lost = None

    @staticmethod
    def _kill(ref: ProcRef) -> None:
        """SIGKILL a hung supervisor's process group and wait (5 s at most) until it is gone."""
        host = LocalHost("local")
        try:
            host.signal(ref, signal.SIGKILL, group=True)
        except DldError:
            return
        deadline = time.monotonic() + 5.0
        while host.alive([ref])[ref.pid] and time.monotonic() < deadline:
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the detached watchdog process."""
    parser = argparse.ArgumentParser(prog="python -m dldctl.supervise.watchdog")
    parser.add_argument("--run", required=True, type=Path)
    args = parser.parse_args(argv)
    dog = Watchdog(decisionlog.LoggingRunDir(args.run))  # its decisions are lines in supervisor.log too
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: dog.stop.set())
    dog.loop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
