"""The typed run state: a round trip through state.json, a file of another schema version or with
a malformed record is one RunError naming the file, a file older dldctl wrote (no version) still
reads, and no module outside the one load/save pair digs into the state by string keys."""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest

from dldctl.errors import RunError
from dldctl.hostruntime import HostRuntime
from dldctl.hosts.slurmjobs import JOB_TICKS, JobInfo
from dldctl.rundir import RunDir
from dldctl.runstate import (
    SCHEMA_VERSION,
    VERSION_KEY,
    Daemon,
    Fault,
    HostRecord,
    PidRecord,
    Proc,
    ProcStatus,
    RunState,
)

ROOT = Path(__file__).resolve().parents[2]
LOAD_SAVE = {"dldctl/runstate.py", "dldctl/rundir.py"}


def full_state() -> RunState:
    """A state with every kind of record in it."""
    return RunState(
        status="up",
        run="exp",
        run_id="exp-1234",
        dir="/runs/exp",
        created=1000.0,
        procs={
            "syncer": Proc("syncer", "local", ProcStatus.RUNNING, PidRecord(10, 20), started_at=1001.0),
            "learner-0": Proc("learner", "a", ProcStatus.DEAD, restarts=2, fast_deaths=1, next_start=1010.0),
            "learner-1": Proc("learner", "b", ProcStatus.STOPPED, reason="host b: unreachable"),
        },
        hosts={"local": HostRecord(HostRuntime("local", "python3", "", "/runs/exp", "/runs/exp/config.json"))},
        faults=(Fault("f1", "pause", "learner-0", 1020.0, 1000.0, 3.0),),
        supervisor=Daemon(30, 40, 1000.5, 1),
        watchdog=Daemon(31, 41, 1000.6),
        spares={"a": PidRecord(50, 60)},
        mirror={"events.jsonl": 123},
    )


def write_raw(tmp_path: Path, data: object) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.state_file.write_text(json.dumps(data))
    return run


def test_round_trip_through_the_file(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    state = full_state()
    with run.locked():
        run.write_state(state)
    back = run.read_state()
    assert back.updated is not None
    assert back == RunState(**{**state.__dict__, "updated": back.updated})
    raw = json.loads(run.state_file.read_text())
    assert raw[VERSION_KEY] == SCHEMA_VERSION and raw["procs"]["learner-0"]["status"] == "dead"


def test_every_status_round_trips_as_its_own_string() -> None:
    for status in ProcStatus:
        proc = Proc("learner", "a", status)
        data = json.loads(json.dumps(proc.to_json()))
        assert data["status"] == status.value and Proc.from_json(data, "p") == proc
    assert {s.value for s in ProcStatus} == {
        "pending",
        "starting",
        "running",
        "dead",
        "unreachable",
        "finished",
        "stopped",
    }


def test_another_version_is_one_line_naming_the_file(tmp_path: Path) -> None:
    run = write_raw(tmp_path, {**full_state().to_json(), VERSION_KEY: SCHEMA_VERSION + 1})
    with pytest.raises(RunError) as err:
        run.read_state()
    line = err.value.line()
    assert "\n" not in line and str(run.state_file) in line and f"version {SCHEMA_VERSION + 1}" in line


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d["procs"]["learner-0"].update(status="zombie"),
        lambda d: d["procs"]["learner-0"].update(restarts="two"),
        lambda d: d["procs"]["learner-0"].pop("kind"),
        lambda d: d["procs"].update({"learner-9": "running"}),
        lambda d: d["procs"]["syncer"].update(proc={"pid": 1}),
        lambda d: d.update(faults={"f1": {}}),
        lambda d: d.update(surprise=1),
        lambda d: d["hosts"]["local"]["runtime"].pop("run_dir"),
        lambda d: d["hosts"]["local"]["runtime"].update(python=3),
        lambda d: d["procs"]["learner-0"].update(killed_by=3),
        lambda d: d["mirror"].update(x="many"),
    ],
)
def test_a_malformed_record_is_one_line_naming_the_file(tmp_path: Path, damage: object) -> None:
    data = full_state().to_json()
    damage(data)  # type: ignore[operator]
    run = write_raw(tmp_path, data)
    with pytest.raises(RunError) as err:
        run.read_state()
    line = err.value.line()
    assert "\n" not in line and str(run.state_file) in line and "malformed state" in line


@pytest.mark.parametrize(
    ("damage", "names"),
    [
        (
            lambda d: d["procs"]["learner-0"].update(status="zombie"),
            "procs['learner-0'].status: 'zombie' is not one of",
        ),
        (lambda d: d["procs"]["learner-0"].update(restarts="two"), "procs['learner-0'].restarts: must be int"),
        (lambda d: d["procs"]["syncer"].update(proc={"pid": 1}), "procs['syncer'].proc.start_ticks: is required"),
        (lambda d: d["faults"][0].update(until="soon"), "faults[0].until: must be float"),
        (lambda d: d.update(surprise=1), "(surprise: unknown key)"),
    ],
)
def test_the_line_names_the_field_at_fault(tmp_path: Path, damage: object, names: str) -> None:
    data = full_state().to_json()
    damage(data)  # type: ignore[operator]
    with pytest.raises(RunError) as err:
        write_raw(tmp_path, data).read_state()
    assert names in err.value.line()


def test_a_file_older_dldctl_wrote_reads_as_version_1(tmp_path: Path) -> None:
    old = {
        "run": "exp",
        "run_id": "exp-1",
        "dir": "/runs/exp",
        "status": "up",
        "created": 1000,
        "updated": 1001.5,
        "procs": {
            "syncer": {
                "kind": "syncer",
                "host": "local",
                "status": "running",
                "proc": {"pid": 7, "start_ticks": 8},
                "restarts": 0,
                "fast_deaths": 0,
                "started_at": 1000.2,
                "next_start": None,
                "hold_until": None,
                "chaos_kill": False,
            }
        },
        "hosts": {  # as HostRuntime.to_dict wrote it before `code` was added
            "local": {
                "runtime": {"host": "local", "python": "py", "pythonpath": "", "run_dir": "/r", "config": "/r/c"},
                "status": "ok",
            }
        },
        "faults": [],
        "supervisor": {"pid": 3, "start_ticks": 4, "started": 1000.1, "restarts": 0},
    }
    state = write_raw(tmp_path, old).read_state()
    assert state.status == "up" and state.created == 1000.0 and state.watchdog is None
    assert state.procs["syncer"].status is ProcStatus.RUNNING and state.procs["syncer"].proc == PidRecord(7, 8)
    assert state.supervisor == Daemon(3, 4, 1000.1, 0) and state.spares == {} and state.mirror == {}
    assert state.runtime_of("local") == HostRuntime("local", "py", "", "/r", "/r/c", code="")


# The keys the previous dldctl reads (and refuses any other): a file written now must load there.
OLDER_STATE_KEYS = {VERSION_KEY, "run", "run_id", "dir", "status", "created", "stopped_at", "updated", "procs"}
OLDER_STATE_KEYS |= {"hosts", "faults", "supervisor", "watchdog", "spares", "mirror"}
OLDER_PROC_KEYS = {"kind", "host", "status", "proc", "restarts", "fast_deaths", "started_at", "next_start"}
OLDER_PROC_KEYS |= {"hold_until", "chaos_kill", "reason", "job"}


def test_a_file_written_now_has_the_keys_and_shapes_older_dldctl_reads() -> None:
    job = JobInfo(77, "PENDING", "Resources", name="dldctl-exp-learner-2")  # squeue's name: never stored
    state = full_state().with_proc("learner-2", Proc("learner", "c", proc=PidRecord(77, JOB_TICKS), job=job))
    data = json.loads(json.dumps(state.to_json()))
    assert set(data) == OLDER_STATE_KEYS and all(set(p) == OLDER_PROC_KEYS for p in data["procs"].values())
    assert data["procs"]["learner-2"]["job"] == {"id": 77, "state": "PENDING", "reason": "Resources", "nodes": ""}
    assert data["procs"]["syncer"]["proc"] == {"pid": 10, "start_ticks": 20} and data["spares"]["a"]["pid"] == 50
    assert data["supervisor"] == {"pid": 30, "start_ticks": 40, "started": 1000.5, "restarts": 1}
    assert data["faults"] == [  # a fault's optional fields only while set
        {"id": "f1", "kind": "pause", "target": "learner-0", "until": 1020.0, "injected_at": 1000.0, "factor": 3.0}
    ]
    assert data["hosts"]["local"]["runtime"]["code"] == "" and data["mirror"] == {"events.jsonl": 123}
    unnamed = replace(job, name="")
    assert RunState.from_json(data, "p") == state.with_proc("learner-2", replace(state.procs["learner-2"], job=unnamed))


def test_killed_by_is_stored_only_when_set() -> None:
    killed = Proc("learner", "a", ProcStatus.DEAD, chaos_kill=True, killed_by="chaos")
    data = json.loads(json.dumps(killed.to_json()))
    assert data["killed_by"] == "chaos" and Proc.from_json(data, "p") == killed
    assert "killed_by" not in Proc("learner", "a").to_json()
    undone = Fault("f2", "link", "a", 5.0, rate="1mbit", undone=True)
    assert Fault.from_json(json.loads(json.dumps(undone.to_json())), "f") == undone


def test_helpers_return_new_states() -> None:
    state = full_state()
    moved = state.with_proc("learner-2", Proc("learner", "c")).with_spare("a", None).without_fault("f1")
    assert "learner-2" in moved.procs and moved.spares == {} and moved.faults == ()
    assert "learner-2" not in state.procs and state.spares and state.faults  # the old one is untouched
    assert moved.learners(live=True) == ["learner-0", "learner-2"]


def _string_key_digs(tree: ast.AST) -> list[int]:
    """Lines that index a name called `state`/`st` by a string, or take ["procs"] / .get("procs")."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
            named = isinstance(node.value, ast.Name) and node.value.id in ("state", "st")
            if isinstance(key, str) and (named or key == "procs"):
                lines.append(node.lineno)
        if _is_get_procs(node):
            lines.append(node.lineno)
    return lines


def _is_get_procs(node: ast.AST) -> bool:
    """`<anything>.get("procs")`."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "procs"
    )


def test_no_module_digs_into_the_run_state_by_string_keys() -> None:
    found = []
    for path in sorted((ROOT / "dldctl").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in LOAD_SAVE:
            found += [f"{rel}:{line}" for line in _string_key_digs(ast.parse(path.read_text()))]
    assert found == [], f"string-key access to the run state (use dldctl/runstate.py's attributes): {found}"


def test_the_scan_sees_a_dig() -> None:
    assert _string_key_digs(ast.parse('x = state["procs"]\ny = snap.get("procs")\nz = other["procs"]')) == [1, 2, 3]
