"""A run whose every process died at once (a power cut: kill -9 of the supervisor, the watchdog,
the syncer and the learners) is `crashed` in every command, each naming the one way to continue
it, and `up --resume` continues it: a real local fleet."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from dldctl.testing import DldctlHome, inventory_text, local_host, signal_pid
from tests.e2e.fleetutil import run_table

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_a_run_that_lost_every_process_is_crashed_everywhere_and_resumes(tmp_path: Path) -> None:
    inv = tmp_path / "inv.toml"
    inv.write_text(run_table("cut", quorum=1) + inventory_text({}, [local_host("here", 2)]).split("\n", 1)[1])
    with DldctlHome(tmp_path / "home") as dl:
        dl("up", str(inv), "-d", "--wait")
        name = dl.live_runs()[0]
        for rec in dl.leftovers():  # the power cut
            signal_pid(int(rec["pid"]), signal.SIGKILL)
        dl.wait_for(lambda: not dl.leftovers() or None, 30, "every process gone")
        resume = f"dldctl up --resume {name}"

        snap = dl.status()
        assert snap["status"] == "crashed", snap["status"]
        assert snap["spares"] == [] and {r["state"] for r in snap["learners"]} == {"dead"}, snap
        rows = json.loads(dl("runs", "--json").stdout)["runs"]
        assert [r["state"] for r in rows if r["name"] == name] == ["crashed"]
        assert resume in dl("status", "--once").stdout
        for cmd in (("chaos", "kill", "learner-0"), ("learner", "add", "--host", "here")):
            refused = dl(*cmd, check=False)
            assert refused.returncode != 0 and f"{name} crashed" in refused.stderr and resume in refused.stderr, (
                cmd,
                refused.stderr,
            )

        dl("up", "--resume", name, "-d", "--wait")
        assert dl.status()["status"] == "up"


@pytest.mark.parametrize("point", ["up_created", "up_started"])
def test_ctrl_c_during_up_leaves_nothing_or_a_run_that_goes_on(tmp_path: Path, point: str) -> None:
    """^C with the run directory made and nothing started: nothing is left; ^C once the supervisor
    runs: the run goes on, and the message says how to follow or stop it."""
    inv = tmp_path / "inv.toml"
    inv.write_text(run_table("cc", quorum=1) + inventory_text({}, [local_host("here", 1)]).split("\n", 1)[1])
    with DldctlHome(tmp_path / "home") as dl:
        dl.env["DLDCTL_FAULT_POINTS"] = f"{point}=60"  # `up` pauses there, and says so
        up = dl.popen("up", str(inv), "-d", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert up.stdout is not None
        while f"fault point {point}" not in (line := up.stdout.readline()):
            assert line, f"up ended before {point}: {up.communicate(timeout=30)}"
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=60)
        assert up.returncode == 130, err
        if point == "up_created":
            assert "nothing runs, and its directory is removed" in err, err
            assert not any((dl.home / "runs").iterdir()) and not dl.leftovers()
        else:
            name = dl.live_runs()[0]
            assert f"run {name} is up to its supervisor" in err and f"dldctl down --run {name}" in err, err
            dl.wait(lambda s: s["status"] == "up" and s["syncer"]["alive"], 90, "the run started on its own")
