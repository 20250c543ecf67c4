"""Shell completion: run names from the runs directory, learner ids and targets from the run that
`--run` names (or the newest), nothing (and no error) from a broken run; and the real path a shell
takes, `_DLDCTL_COMPLETE=complete_bash` in a fresh `python -m dldctl`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dldctl import rundir
from dldctl.commands import complete
from dldctl.runstate import RunState, new_proc


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    return tmp_path


def make_run(name: str, learners: int, mtime: float) -> rundir.RunDir:
    """A run directory of `learners` learners and one syncer, its state written `mtime`."""
    run = rundir.create(name)
    procs = {"syncer": new_proc("syncer", "a")} | {f"learner-{i}": new_proc("learner", "a") for i in range(learners)}
    with run.locked():
        run.write_state(RunState(status="up", run=name, procs=procs))
    os.utime(run.state_file, (mtime, mtime))
    return run


def ctx(run: str | None = None) -> SimpleNamespace:
    """What completion reads of the parser's context: the values parsed so far."""
    return SimpleNamespace(params={"run": run})


def test_run_names_are_the_runs_then_their_directories_newest_first(home: Path) -> None:
    old = make_run("exp", 2, mtime=1000)
    new = make_run("big", 4, mtime=2000)
    assert complete.run_names("") == ["big", "exp", new.name, old.name]
    assert complete.run_names("e") == ["exp", old.name]
    assert complete.run_names("nothing") == []


def test_learner_ids_come_from_the_named_run_or_the_newest(home: Path) -> None:
    make_run("exp", 2, mtime=1000)
    make_run("big", 3, mtime=2000)
    assert complete.learner_ids(ctx(), "") == ["learner-0", "learner-1", "learner-2"]
    assert complete.learner_ids(ctx("exp"), "learner-") == ["learner-0", "learner-1"]
    assert complete.learner_ids(None, "learner-2") == ["learner-2"]
    assert complete.proc_targets(ctx("exp"), "s") == ["syncer"]
    assert complete.log_targets(ctx("exp"), "") == ["learner-0", "learner-1", "syncer", "supervisor", "watchdog"]


@pytest.mark.parametrize("state", ['{"status":', "[]", '{"status": "up", "procs": 5}', None])
def test_a_broken_run_completes_to_nothing_and_never_fails(home: Path, state: str | None) -> None:
    broken = make_run("broken", 2, mtime=1000)
    if state is None:
        broken.state_file.unlink()
    else:
        broken.state_file.write_text(state)
    (rundir.runs_root() / "not-a-run").mkdir()
    assert complete.learner_ids(ctx(), "") == []
    assert complete.learner_ids(ctx("broken"), "") == []
    assert complete.log_targets(ctx("nosuchrun"), "") == ["supervisor", "watchdog"]
    assert complete.run_names("") == ([] if state is None else ["broken", broken.name])


def test_no_runs_directory_completes_to_nothing(home: Path) -> None:
    assert complete.run_names("") == []
    assert complete.learner_ids(ctx(), "") == []


def bash_complete(home: Path, line: str) -> list[str]:
    """What bash's completion script gets back for `line` (completing its last, maybe empty, word)."""
    words = line.split(" ")
    env = {
        **os.environ,
        "DLDCTL_HOME": str(home),
        "_DLDCTL_COMPLETE": "complete_bash",
        "COMP_WORDS": line,
        "COMP_CWORD": str(len(words) - 1),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "dldctl"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout.split()


def test_the_shell_completes_run_names_and_learner_ids(home: Path) -> None:
    run = make_run("exp", 2, mtime=1000)
    for command in ("status --run", "logs --run", "report --run", "export", "down --run"):
        assert bash_complete(home, f"dldctl {command} e") == ["exp", run.name], command
    assert bash_complete(home, "dldctl chaos kill ") == ["learner-0", "learner-1", "syncer"]
    assert bash_complete(home, "dldctl chaos pause --run exp learner-") == ["learner-0", "learner-1"]
    assert bash_complete(home, "dldctl learner remove l") == ["learner-0", "learner-1"]
    assert bash_complete(home, "dldctl logs --run exp su") == ["supervisor"]
    run.state_file.write_text("{")  # broken: nothing to offer, and nothing printed on the prompt
    assert bash_complete(home, "dldctl chaos kill ") == []
