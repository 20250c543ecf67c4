"""`dldctl logs` on a real local fleet: several targets at once (a glob, prefixed lines, `-f`
ended by Ctrl-C), the supervisor's decision lines after a `chaos kill`, the syncer's start and
checkpoint lines, and the restarted learner's new incarnation in its log."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest

from dldctl.testing import DldctlHome, inventory_text, local_host
from tests.e2e.fleetutil import run_table

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def test_logs_of_a_fleet_that_healed_a_kill(tmp_path: Path) -> None:
    inv = tmp_path / "inv.toml"
    inv.write_text(run_table("logs", quorum=1) + inventory_text({}, [local_host("here", 2)]).split("\n", 1)[1])
    with DldctlHome(tmp_path / "home") as dl:
        dl("up", str(inv), "-d", "--wait")
        dl("chaos", "kill", "learner-1", timeout=60)
        dl.wait_for(lambda: dl.events("restart") or None, 60, "the supervisor to restart learner-1")
        dl.wait_for(lambda: "[#2] learner-1: " in dl.log("learner-1") or None, 60, "learner-1's second incarnation")

        both = dl("logs", "learner-*", "--tail", "5").stdout.splitlines()
        assert both and all(re.match(r"learner-[01] \| ", line) for line in both), both
        assert {line[:9] for line in both} == {"learner-0", "learner-1"}
        assert any("[#2] learner-1: " in line for line in dl("logs", "learner-1", "--tail", "50").stdout.splitlines())

        supervisor = dl("logs", "supervisor", "--tail", "200").stdout
        assert re.search(
            r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d learner-1 died: process gone after [\d.]+ s \(killed by", supervisor
        )
        assert re.search(r"learner-1 restarted: pid \d+ on here \(restart 1\)", supervisor), supervisor

        def checkpointed() -> str | None:
            out = dl("logs", "syncer", "--tail", "200").stdout
            return out if "checkpoint at outer step" in out else None

        syncer = dl.wait_for(checkpointed, 60, "a checkpoint line in the syncer's log")
        assert re.search(r"syncer: serving run \S+ on tcp://\S+ .* fragments, ", syncer), syncer
        assert "fresh start: no checkpoint" in syncer

        wrong = dl("logs", "worker-*", check=False)
        assert wrong.returncode == 2 and "known: syncer, learner-0, learner-1, supervisor, watchdog" in wrong.stderr

        follow = dl.popen("logs", "learner-*", "syncer", "-f", "--tail", "1", stdout=subprocess.PIPE, text=True)
        try:
            out, _ = follow.communicate(timeout=4)
        except subprocess.TimeoutExpired:
            follow.send_signal(signal.SIGINT)
            out, _ = follow.communicate(timeout=10)
        assert follow.returncode == 0, out
        assert {line.split(" ", 1)[0] for line in out.splitlines()} >= {"learner-0", "learner-1", "syncer"}, out
        dl.down()
