"""Nobody supervises alone, with the real CLI on a local fleet: kill -9 the supervisor and status
says so in red while it is missing; the watchdog brings a new one within seconds without any
command; a learner killed afterwards reads `dead` at once (never `running`/`partitioned` with its
dead pid) and is restarted; a killed watchdog is restarted by the supervisor; and `dldctl down`
leaves neither of them (nor anything else) alive."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dldctl.runstate import Daemon, PidRecord, ProcStatus
from dldctl.testing import DldctlHome, wait_until
from dldctl.testing import alive as running
from tests.e2e.fleetutil import learner, run_table

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

INVENTORY = (
    run_table("watch", quorum=1)
    + """
[[hosts]]
name = "here"
address = "local"
learners = 2
"""
)


def alive(record: PidRecord | Daemon | None) -> bool:
    return record is not None and running(record.pid, record.start_ticks)


def until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `check` (cheap: the state file, /proc) until it returns something true."""
    return wait_until(check, timeout, what, every=0.2)


def test_the_supervisor_and_its_watchdog_heal_each_other(tmp_path: Path) -> None:
    inv = tmp_path / "inv.toml"
    inv.write_text(INVENTORY)
    dl = DldctlHome(tmp_path / "home")
    paused: int | None = None
    try:
        dl("up", str(inv), "-d")
        dl.wait(lambda s: all(r["state"] == "running" for r in s["learners"]), 150, "both learners running")
        first = dl.state()
        sup, dog = first.supervisor, first.watchdog
        assert sup is not None and dog is not None
        assert alive(sup) and alive(dog) and dl.status()["supervisor"]["state"] == "ok"

        # (a) while the watchdog cannot act (SIGSTOP), a killed supervisor shows as missing, in red
        os.kill(dog.pid, signal.SIGSTOP)
        paused = dog.pid
        os.kill(sup.pid, signal.SIGKILL)
        until(lambda: not alive(sup), 10, "the supervisor to die")
        # ... and a learner that dies meanwhile is `dead`, though its record still says running
        gone = first.procs["learner-0"].proc
        assert gone is not None
        os.killpg(gone.pid, signal.SIGKILL)
        until(lambda: not alive(gone), 10, "learner-0 to die")
        snap = dl.status()
        assert snap["supervisor"]["state"] == "missing" and snap["supervisor"]["alive"] is False, snap["supervisor"]
        assert dl.state().procs["learner-0"].status is ProcStatus.RUNNING  # the stale record
        assert learner(snap, "learner-0")["state"] == "dead" and learner(snap, "learner-0")["pid"] is None
        once = dl("status", "--once").stdout
        assert "SUPERVISOR MISSING" in once and "the watchdog restarts it" in once, once

        # (b) healed without any command, within seconds of the watchdog running again
        os.kill(dog.pid, signal.SIGCONT)
        paused = None
        t0 = time.monotonic()
        new = until(
            lambda: (s := dl.state().supervisor) and s.pid != sup.pid and alive(s) and s, 15, "a new supervisor"
        )
        assert time.monotonic() - t0 < 15
        restarted = dl.events("supervisor_restarted")
        assert restarted and f"pid {sup.pid} is dead" in restarted[-1]["detail"], restarted
        assert dl.events("supervisor_lost")
        until(lambda: dl.status()["supervisor"]["state"] == "ok", 30, "status to say the supervisor is ok")

        # (c) the new supervisor restarts the learner that died without one, and one killed now
        victim = dl.state().procs["learner-1"].proc
        assert victim is not None
        os.killpg(victim.pid, signal.SIGKILL)
        until(lambda: not alive(victim), 10, "learner-1 to die")
        row = learner(dl.status(), "learner-1")
        assert row["pid"] != victim.pid and (row["state"] != "running" or row["restarts"] >= 1), row
        dl.wait(
            lambda s: all(r["restarts"] >= 1 and r["state"] == "running" for r in s["learners"]),
            180,
            "both learners restarted by the new supervisor",
        )
        assert {e["target"] for e in dl.events("restart")} == {"learner-0", "learner-1"}
        assert alive(new), "the restarted supervisor is still the one"

        # the supervisor restarts a killed watchdog in turn
        os.kill(dog.pid, signal.SIGKILL)
        dog2 = until(lambda: (d := dl.state().watchdog) and d.pid != dog.pid and alive(d) and d, 15, "a new watchdog")
        # the event is appended just after the state names the new watchdog: wait for it, not race it
        until(
            lambda: any(f"pid {dog.pid} is dead" in e["detail"] for e in dl.events("watchdog_restarted")),
            10,
            "the watchdog_restarted event",
        )

        # (d) down stops both, and everything else
        dl("down", timeout=180)
        assert not alive(new) and not alive(dog2)
        assert dl.leftovers() == []
        assert dl.state().status == "down"
    finally:
        if paused is not None:
            try:
                os.kill(paused, signal.SIGCONT)
            except ProcessLookupError:
                pass
        dl.close()
