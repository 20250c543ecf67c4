"""The harness itself (dldctl/testing/): its teardown leaves nothing running, whatever happened.

A real fleet whose `with` block fails: after the block, every process the run recorded is gone, a
background `dldctl` command too, and dldctl says the run is down. Then what `dldctl down` could not
stop (a down that hung, simulated) is killed by pid, while a live process whose start time differs
from the record (a reused pid) is left alone; and the waits and errors say what they are.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dldctl.hosts.local import read_stat
from dldctl.testing import CommandFailed, DldctlHome, WaitTimeout, alive, local_host, wait_until

pytestmark = [pytest.mark.timeout(300)]

RUN = {  # one small, fast learner (gpt-tiny, plain averaging at H = 8, no warm spares)
    "model": "gpt-tiny",
    "seq_len": 32,
    "batch_size": 8,
    "H": 8,
    "outer_lr": 1.0,
    "outer_momentum": 0.0,
    "eval_every": 20,
    "eval_batches": 2,
    "quorum": 1,
    "warm_spares": False,
}


class HungDown(DldctlHome):
    """A home whose `dldctl down` never gets to stop anything (as if it hung or failed)."""

    def _down_if_up(self) -> None:
        pass


def test_a_failing_block_still_leaves_nothing_running(tmp_path: Path) -> None:
    home = DldctlHome(tmp_path / "home", name="harness")
    with pytest.raises(RuntimeError, match="the test failed here"), home:
        home.up(RUN, [local_host("here", 1)])
        home.wait(lambda s: all(r["state"] == "running" for r in s["learners"]), 150, "the learner running")
        follower = home.popen("logs", "syncer", "-f", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started = home.leftovers()
        assert {"supervisor", "syncer", "learner-0"} <= {r["target"] for r in started}, started
        assert home.config().run_id and home.state().status == "up" and home.events(), "what the run wrote reads"
        raise RuntimeError("the test failed here")
    assert not [r for r in started if alive(int(r["pid"]), int(r["start_ticks"]))]
    assert follower.poll() is not None, "a background dldctl command outlived the home"
    assert home.leftovers() == [] and home.live_runs() == []
    snap = home.status()
    assert snap["status"] == "down" and snap["syncer"]["alive"] is False
    assert (tmp_path / "home").is_dir(), "a home the caller gave is never deleted"


def test_what_down_left_is_killed_by_pid_and_a_reused_pid_is_spared() -> None:
    victim = subprocess.Popen(["sleep", "300"], start_new_session=True)
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        home = HungDown(name="fallback")
        run = home.home / "runs" / "fake"
        run.mkdir(parents=True)
        ticks = {p.pid: _start_ticks(p.pid) for p in (victim, bystander)}
        records = [
            {"target": "learner-0", "host": "local", "pid": victim.pid, "start_ticks": ticks[victim.pid]},
            {"target": "learner-1", "host": "local", "pid": bystander.pid, "start_ticks": ticks[bystander.pid] + 1},
        ]
        (run / "procs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        with home:
            assert [r["target"] for r in home.leftovers()] == ["learner-0"]
        assert victim.wait(timeout=10) == -signal.SIGKILL
        assert bystander.poll() is None, "a process that is not the recorded one (pid reused) was killed"
        assert not home.home.exists(), "the harness's own temp home outlived it"
        assert home.close() == [], "closing again is a no-op"
    finally:
        for proc in (victim, bystander):
            proc.kill()
            proc.wait()


def test_waits_and_failures_say_what_they_were() -> None:
    with pytest.raises(WaitTimeout, match=r"waiting for the moon(.|\n)*last: 3") as info:
        wait_until(lambda: None, 0.05, "the moon", every=0.01, describe=lambda: "last: 3")
    assert isinstance(info.value, AssertionError) and isinstance(info.value, TimeoutError)
    assert wait_until(lambda: 7, 1, "seven") == 7
    with DldctlHome(name="errors") as home:
        with pytest.raises(CommandFailed, match="dldctl logs learner-0 exited") as failed:
            home.dl("logs", "learner-0")
        assert isinstance(failed.value, RuntimeError) and failed.value.proc.returncode != 0
        assert home.run_dir is None and home.events() == []


def test_the_harness_imports_no_torch_and_no_learner() -> None:
    code = (
        "import sys, dldctl.testing; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'learner')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _start_ticks(pid: int) -> int:
    stat = read_stat(pid)
    assert stat is not None
    return stat.start_ticks
