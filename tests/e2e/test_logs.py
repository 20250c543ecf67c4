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
from tests.e2e.fleetutil import learner, run_table

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def test_logs_of_a_fleet_that_healed_a_kill(tmp_path: Path) -> None:
    inv = tmp_path / "inv.toml"
    inv.write_text(run_table("logs", quorum=1) + inventory_text({}, [local_host("here", 2)]).split("\n", 1)[1])
    with DldctlHome(tmp_path / "home") as dl:
        # two `up` of one inventory at once: one starts the run, the other is refused in one line
        both = [dl.popen("up", str(inv), "-d", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"]
        said = [p.communicate(timeout=150) for p in both]
        assert sorted(p.returncode for p in both)[0] == 0 and sorted(p.returncode for p in both)[1] != 0, said
        refused = next(err for p, (_, err) in zip(both, said) if p.returncode != 0)
        assert "another `dldctl up` of run logs is under way (pid " in refused, refused
        assert len(list((dl.home / "runs").iterdir())) == 1
        dl("up", str(inv), "-d", "--wait")  # converges: the run already matches, and merges
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

        dl("learner", "remove", "learner-1")  # learner-0 alone still makes the quorum of 1
        dl.wait(lambda s: learner(s, "learner-1")["state"] == "stopped", 60, "learner-1 removed")
        refused = dl("learner", "remove", "learner-0", check=False)
        assert refused.returncode != 0 and "would leave 0 live learners, below the minimum quorum 1" in refused.stderr
        assert "--force" in refused.stderr and learner(dl.status(), "learner-0")["state"] == "running"
        dl.down()
