"""`dldctl chaos corrupt` on a live run, through the real command and the real learner.

No fleet of `dldctl up` (minutes): the run directory is laid out as `up` lays it out (config.json,
keys/, state.json, inventory.json, learners/<id>/) around a real syncer and a real learner on
this machine, started as dldctl starts them (`--workdir` in the run directory); the supervisor in
state.json is a stand-in process (a `sleep`), so the run is live and nothing restarts or undoes
on its own. The command writes the learner's control.json on its host, the learner corrupts its
pushes and says so, `chaos heal` ends it; bad input is one line naming what to do; an island's
weights are not for corrupting; an experiment file carries a corrupt fault to a verdict.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

# stdlib since 3.11; mypy checks as 3.10 (pyproject's python_version), which has none
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from dldctl import inventory
from dldctl.hostruntime import HostRuntime
from dldctl.hosts.local import read_stat
from dldctl.rundir import RunDir
from dldctl.runstate import Daemon, HostRecord, PidRecord, Proc, ProcStatus, RunState
from dldctl.testing import DLDCTL, inventory_text, local_host
from tests.localrun import LocalRun, write_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

NAME = "corrupt-20270101-000000"


def _ref(proc: subprocess.Popen) -> PidRecord:
    stat = read_stat(proc.pid)
    assert stat is not None, f"pid {proc.pid} is gone"
    return PidRecord(proc.pid, stat.start_ticks)


class LiveRun:
    """A run directory that dldctl takes for live, around a real syncer and learners."""

    def __init__(self, home: Path, learners: list[dict[str, object]]) -> None:
        self.home = home
        self.path = home / "runs" / NAME
        # the syncer's judge off: this tests the fault's path, not the defence (tests/unit/test_judge.py)
        run = {"eval_every": 5, "global_eval_every": 0, "judge_size": 0.0, "judge_agree": 0.0}
        self.config = write_config(self.path, learners, run=run, run_id=NAME)
        self.lr = LocalRun(self.path, self.config)
        self.runtime = HostRuntime("here", sys.executable, "", str(self.path), str(self.config))
        self.env = dict(os.environ, DLDCTL_HOME=str(home), COLUMNS="200")

    def start(self, running: int) -> None:
        """The syncer, the first `running` learners, the stand-in supervisor, and the state."""
        for sub in ("logs", "learners", "checkpoints"):
            (self.path / sub).mkdir(exist_ok=True)
        inv = inventory_text({"name": "corrupt"}, [local_host("here", 1)])
        (self.path / "inventory.toml").write_text(inv)
        parsed = inventory.parse(tomllib.loads(inv), str(self.path / "inventory.toml"))
        (self.path / "inventory.json").write_text(json.dumps(inventory.to_dict(parsed)))
        self.lr.start_syncer()
        procs = {}
        for i in range(running):
            lid = f"learner-{i}"
            workdir = self.path / "learners" / lid
            tail = ["-m", "learner", "--config", str(self.config), "--id", lid, "--workdir", str(workdir)]
            ref = _ref(self.lr.spawn(lid, tail))
            procs[lid] = Proc("learner", "here", ProcStatus.RUNNING, ref, started_at=time.time())
        sup = self.lr.procs.spawn(
            "supervisor", ["sleep", "600"], log=self.path / "sup.log", env=self.env, cwd=self.path
        )
        state = RunState(
            status="up",
            procs=procs,
            run=NAME,
            dir=str(self.path),
            hosts={"here": HostRecord(self.runtime)},
            supervisor=Daemon(sup.pid, _ref(sup).start_ticks),
        )
        run = RunDir(self.path)
        with run.locked():
            run.write_state(state)
        assert run.live()

    def dl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [DLDCTL, *args, "--run", str(self.path)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert not check or proc.returncode == 0, proc.stderr
        return proc

    def log(self, lid: str) -> str:
        return self.lr.log(lid)

    def state(self) -> RunState:
        return RunDir(self.path).read_state()


@pytest.fixture()
def live(tmp_path: Path) -> Iterator[LiveRun]:
    run = LiveRun(tmp_path / "home", [{}, {"nproc": 2}])  # learner-1: an island, never started
    try:
        run.start(running=1)
        run.lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= 2, 120, "merges")
        yield run
    finally:
        run.lr.close()


def test_corrupt_writes_the_control_the_learner_obeys_and_heal_ends_it(live: LiveRun) -> None:
    # first a scale for 1 s, and the learner trains on: x1.05, not x1000, for with the judge off
    # and one learner what it pushes becomes the global model, compounded push after push (x2
    # reached a loss of 3e6); then every step is non-finite (reloading cannot help)
    text = live.dl("chaos", "corrupt", "learner-0", "--mode", "scale", "--factor", "1.05", "--duration", "1s").stdout
    assert "corrupt learner-0: scale corruption: its weights x1.05 before each push for 1 s" in " ".join(text.split())
    live.lr.wait_log("learner-0", "chaos: corrupting weights (scale x1.05)", 30)
    live.lr.wait_log("learner-0", "chaos: corruption (scale) over", 30)
    steps = live.lr.status()["learners"][0]["step"]
    trains = lambda s: s["learners"][0]["step"] > steps + 20 and s["learners"][0]["loss"] is not None
    live.lr.wait_for(trains, 60, "training on, its loss finite")
    live.dl("chaos", "heal", "learner-0")  # the spent fault's record (no supervisor here undoes it)
    assert not live.state().faults
    # then a bitflip, healed: the path of the fault and of its undo. Last, because nothing here
    # defends the model: an exponent bit flipped is a value near 1e38, merged as it is with the
    # judge off, and the global model it lands in is lost for good (a real fleet's judge rejects it)
    out = live.dl("chaos", "corrupt", "learner-0", "--mode", "bitflip", "--duration", "60", "--json")
    done = json.loads(out.stdout)
    assert (done["schema"], done["action"], done["target"], done["mode"], done["factor"]) == (
        "dldctl.chaos/1",
        "corrupt",
        "learner-0",
        "bitflip",
        4.0,
    )
    assert done["until"] == pytest.approx(done["t"] + 60) and done["detail"].startswith("bitflip corruption: 4 values")
    control = json.loads((live.path / "learners" / "learner-0" / "control.json").read_text())
    assert (control["corrupt_mode"], control["corrupt_factor"]) == ("bitflip", 4.0)
    assert control["corrupt_until"] == pytest.approx(done["until"])
    faults = live.state().faults
    assert [(f.kind, f.target, f.id) for f in faults] == [("corrupt", "learner-0", done["fault_id"])]
    live.lr.wait_log("learner-0", "chaos: corrupting pushes (bitflip of 4 values) until", 30)
    healed = json.loads(live.dl("chaos", "heal", "learner-0", "--json").stdout)
    assert healed["healed"] == [{"kind": "corrupt", "target": "learner-0"}]
    live.lr.wait_log("learner-0", "chaos: corruption (bitflip) over", 30)
    assert json.loads((live.path / "learners" / "learner-0" / "control.json").read_text())["corrupt_until"] == 0
    assert not live.state().faults
    events = [(e["kind"], e["target"]) for e in live.lr.events() if e["kind"].startswith("fault_")]
    assert ("fault_inject", "learner-0") in events and ("fault_undo", "learner-0") in events
    assert "Traceback" not in live.log("learner-0")


def test_bad_input_is_one_line_naming_the_fix(live: LiveRun) -> None:
    for args, said in [
        (["--mode", "zero"], "--mode: unknown corruption mode 'zero'; use one of nan, scale, signflip, noise, bitflip"),
        (["--mode", "scale", "--factor", "-3"], "--factor: must be a positive, finite number, got -3"),
        (["--mode", "scale", "--factor", "nan"], "--factor: must be a positive, finite number, got nan"),
        (["--mode", "bitflip", "--factor", "1.5"], "--factor: bitflip flips a whole number of values"),
        (["--mode", "signflip", "--factor", "2"], "--factor: signflip takes no factor"),
    ]:
        bad = live.dl("chaos", "corrupt", "learner-0", *args, "--duration", "10", check=False)
        assert bad.returncode == 2 and said in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and bad.stdout == ""
    island = live.dl("chaos", "corrupt", "learner-1", "--mode", "nan", "--duration", "10", check=False)
    assert island.returncode == 2 and "learner-1 is an island of 2 ranks" in island.stderr, island.stderr
    assert "--mode signflip, noise or bitflip" in island.stderr
    unknown = live.dl("chaos", "corrupt", "learner-9", "--mode", "noise", "--duration", "10", check=False)
    assert unknown.returncode == 2 and "cannot corrupt 'learner-9'" in unknown.stderr, unknown.stderr
    assert not live.state().faults, "nothing was registered"


def test_an_experiment_corrupts_a_learner_to_a_verdict(live: LiveRun, tmp_path: Path) -> None:
    exp = tmp_path / "corrupt.toml"
    exp.write_text(
        '[experiment]\nname = "corrupt"\nduration = 6\nsample_every = 1\n\n'
        '[[steady_state]]\ncheck = "syncer.alive == true"\n\n'
        '[[fault]]\nat = 1\naction = "corrupt"\ntarget = "learner-0"\nmode = "signflip"\nduration = 3\n'
    )
    plan = live.dl("chaos", "run", str(exp), "--dry-run").stdout
    assert "corrupt   learner-0  signflip for 3 s" in plan, plan
    lines = [json.loads(line) for line in live.dl("chaos", "run", str(exp), "--json").stdout.splitlines()]
    fault, summary = lines[0], lines[-1]
    assert (fault["record"], fault["injected"], fault["mode"]) == ("fault", True, "signflip"), fault
    assert summary["passed"] is True, summary
    assert summary["faults"][0]["action"] == "corrupt"
    live.lr.wait_log("learner-0", "chaos: corrupting pushes (signflip) until", 30)
    live.lr.wait_log("learner-0", "chaos: corruption (signflip) over", 30)
