"""Runs as things you manage, the pure parts: the state word `dldctl runs` shows, which processes
`up --resume` starts again (what `down` stopped; never a removed or finished learner, nor one on a
host that cannot be set up), the reason `up --wait` gives up with, and `runs` over real run
directories (state files and metrics logs written here, no processes)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from dldctl import rundir
from dldctl.commands.run import last_syncer_death, why_not_merging
from dldctl.errors import OperationError
from dldctl.hostruntime import HostRuntime
from dldctl.lifecycle import down, resume
from dldctl.observe import runs
from dldctl.runstate import DOWN_REASON, PidRecord, Proc, ProcStatus, RunState
from syncer.common import strictjson


def test_state_word_tells_crashed_from_up() -> None:
    assert runs.state_word("up", live=True) == "up"
    assert runs.state_word("starting", live=True) == "starting"
    assert runs.state_word("up", live=False) == "crashed"
    assert runs.state_word("starting", live=False) == "crashed"
    assert runs.state_word("down", live=False) == "down"
    assert runs.state_word("stopping", live=False) == "stopping"


def _after_down() -> RunState:
    running = Proc("learner", "a", ProcStatus.RUNNING, PidRecord(11, 1), restarts=3)
    procs = {
        "syncer": Proc("syncer", "local", ProcStatus.RUNNING, PidRecord(10, 1)),
        "learner-0": running,
        "learner-1": Proc("learner", "b", ProcStatus.DEAD, next_start=5.0),  # crash-looping at down
        "learner-2": Proc("learner", "a", ProcStatus.STOPPED),  # `learner remove`
        "learner-3": Proc("learner", "a", ProcStatus.FINISHED),  # spent its budget
        "learner-4": Proc("learner", "c", ProcStatus.RUNNING, PidRecord(12, 1)),  # its host is gone now
    }
    stopped = {name: down._stopped(proc) for name, proc in procs.items()}
    return RunState(status="down", created=1.0, stopped_at=9.0, procs=stopped, run="exp")


def test_down_marks_what_it_stopped_and_resume_starts_only_that() -> None:
    state = _after_down()
    assert {p.status for p in state.procs.values()} == {ProcStatus.STOPPED}
    marked = sorted(n for n, p in state.procs.items() if p.reason == DOWN_REASON)
    assert marked == ["learner-0", "learner-1", "learner-4", "syncer"]
    gone = OperationError("ssh c: connection refused")
    runtime = HostRuntime("a", "/usr/bin/python3", "", "/runs/exp", "/runs/exp/config.json")
    out = resume.resumed_state(state, {"a": runtime}, {"c": gone})
    assert out.status == "starting" and out.stopped_at is None and out.created == 1.0
    statuses = {n: p.status for n, p in out.procs.items()}
    assert statuses == {
        "syncer": ProcStatus.PENDING,
        "learner-0": ProcStatus.PENDING,
        "learner-1": ProcStatus.PENDING,
        "learner-2": ProcStatus.STOPPED,
        "learner-3": ProcStatus.STOPPED,
        "learner-4": ProcStatus.STOPPED,
    }
    assert out.procs["learner-0"].restarts == 0 and out.procs["learner-0"].proc is None
    assert out.procs["learner-4"].reason == gone.line()
    assert out.hosts["a"].runtime.python == "/usr/bin/python3"


def test_a_run_downed_by_an_older_dldctl_resumes_every_process() -> None:
    state = RunState(status="down", procs={"syncer": Proc("syncer", "local", ProcStatus.STOPPED)})
    state = RunState(
        status="down",
        procs={**state.procs, "learner-0": Proc("learner", "local", ProcStatus.STOPPED)},
    )
    out = resume.resumed_state(state, {}, {})
    assert {p.status for p in out.procs.values()} == {ProcStatus.PENDING}


def test_why_up_wait_gave_up() -> None:
    snap: dict[str, Any] = {"syncer": {"alive": False}, "quorum": {"live": 0, "min": 2}, "learners": []}
    assert why_not_merging(snap, None) == "the syncer is not answering"
    died = "syncer: error: cannot bind tcp://127.0.0.1:5555: Address already in use\n"
    assert why_not_merging(snap, None, died) == (
        "the syncer is not answering (it died: syncer: error: cannot bind tcp://127.0.0.1:5555: Address already in use)"
    )
    snap = {
        "syncer": {"alive": True, "outer_steps": 3},
        "quorum": {"live": 1, "min": 2},
        "learners": [{"id": "learner-0", "state": "running"}, {"id": "learner-1", "state": "dead"}],
    }
    assert why_not_merging(snap, 3) == "only 1 of the 2 learners the quorum needs are live (not live: learner-1 dead)"
    snap["quorum"]["live"] = 2
    assert why_not_merging(snap, 3) == "no merge yet (outer step 3), though 2 learners are live"


def _write_run(home: Path, name: str, status: str, samples: list[dict[str, object]]) -> rundir.RunDir:
    run = rundir.create(name)
    state = RunState(
        status=status,
        run=name,
        created=time.time() - 120,
        procs={"syncer": Proc("syncer", "local"), "learner-0": Proc("learner", "gpu-a")},
    )
    with run.locked():
        run.write_state(state)
    run.metrics.write_text("".join(strictjson.dumps(s) + "\n" for s in samples))
    return run


def test_runs_lists_every_run_with_its_last_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    sample = {"kind": "sample", "outer_steps": 42, "tokens_merged": 1000, "loss_eval": 2.5, "loss_global": 2.4}
    _write_run(tmp_path, "old", "down", [{"kind": "sample", "outer_steps": 1}, sample, {"kind": "other"}])
    crashed = _write_run(tmp_path, "new", "up", [])  # meant to be up, no supervisor
    (tmp_path / "runs" / "broken-20260101-000000").mkdir()
    (tmp_path / "runs" / "broken-20260101-000000" / "state.json").write_text("{not json")
    listing = runs.collect()
    assert listing["schema"] == runs.SCHEMA
    by_name = {r["name"].split("-")[0]: r for r in listing["runs"]}
    assert by_name["old"]["state"] == "down" and by_name["old"]["outer_steps"] == 42
    assert by_name["old"]["loss_eval"] == 2.4 and by_name["old"]["tokens_merged"] == 1000
    assert by_name["old"]["hosts"] == ["gpu-a", "local"] and 119 < by_name["old"]["age_s"] < 180
    assert by_name["new"]["state"] == "crashed" and by_name["new"]["outer_steps"] is None
    assert by_name["broken"]["state"] == "unreadable" and "corrupt state" in by_name["broken"]["problem"]
    json.loads(strictjson.dumps(listing))  # JSON-clean
    assert crashed.name in {r["name"] for r in listing["runs"]}


def test_runs_finds_the_last_sample_behind_hundreds_of_round_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small model's fleet logs a round per merge, hundreds between two samples (2 s apart)."""
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    rounds = [{"kind": "round", "outer_step": i, "contributors": ["learner-0"]} for i in range(600)]
    _write_run(tmp_path, "busy", "down", [{"kind": "sample", "outer_steps": 7, "goodput": 0.9}, *rounds])
    (row,) = runs.collect()["runs"]
    assert row["outer_steps"] == 7 and row["goodput"] == 0.9


def test_the_syncers_last_death_is_quoted_from_the_run_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    run = _write_run(tmp_path, "r", "up", [])
    assert last_syncer_death(run) is None
    run.event("syncer_death", "syncer", "process gone after 2.0 s; restart 1 in 2.0 s; its log ends: first")
    run.event("syncer_death", "syncer", "process gone after 2.0 s; restart 2 in 4.0 s; its log ends: error: second")
    run.event("restart", "syncer", "pid 7 on local (restart 2)")
    assert last_syncer_death(run) == "error: second"
    run.event("syncer_death", "syncer", "process gone")  # no log quoted: the event's own words
    assert last_syncer_death(run) == "process gone"
