"""Nobody supervises alone: the rule by which the watchdog restarts the supervisor and status
reports it, what a restarted supervisor makes of half-started processes, the watchdog's restart
decisions, and the status rule that a dead pid is `dead` whatever a stale record says."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from dldctl import rundir
from dldctl.hosts.local import read_stat
from dldctl.observe import snapshot
from dldctl.observe.snapshot import learner_state
from dldctl.observe.view import render_plain
from dldctl.supervise import watchdog
from dldctl.supervise.reconcile import HUNG_S, STALE_S, new_proc, resume, started, supervisor_health

pytestmark = [pytest.mark.timeout(60)]


def me() -> dict[str, int]:
    return {"pid": os.getpid(), "start_ticks": read_stat(os.getpid()).start_ticks}


def dead_pid() -> dict[str, int]:
    """The pid and start time of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        record = {"pid": proc.pid, "start_ticks": read_stat(proc.pid).start_ticks}
    finally:
        proc.kill()
        proc.wait(timeout=10)
    return record


# ---------------------------------------------------------------- the pure rules


def test_supervisor_health_missing_stale_hung_ok_stopped() -> None:
    rec = {"pid": 1, "start_ticks": 2, "started": 1000.0}
    assert supervisor_health(rec, True, 1010.0, 1011.0, "up") == "ok"
    assert supervisor_health(rec, True, 1010.0, 1010.0 + STALE_S + 1, "up") == "stale"
    assert supervisor_health(rec, True, 1010.0, 1010.0 + HUNG_S + 1, "up") == "hung"
    assert supervisor_health(rec, False, 1010.0, 1011.0, "up") == "missing"
    assert supervisor_health(None, False, None, 1011.0, "starting") == "missing"
    assert supervisor_health(rec, False, 1010.0, 1011.0, "stopping") == "stopped"
    assert supervisor_health(rec, False, None, 5000.0, "down") == "stopped"
    # a new one that has not beaten yet: its start counts as a beat (an old beat file does not)
    assert supervisor_health({**rec, "started": 4990.0}, True, 1010.0, 5000.0, "up") == "ok"


def test_a_dead_pid_is_dead_never_running_or_partitioned() -> None:
    proc = {"status": "running", "started_at": 0.0, "proc": {"pid": 5, "start_ticks": 6}}
    assert learner_state(proc, {"state": "unreachable"}, []) == "partitioned"  # the stale record's word
    assert learner_state(proc, {"state": "unreachable"}, [], pid_alive=False) == "dead"
    assert learner_state(proc, {"state": "running"}, [], pid_alive=False) == "dead"
    assert learner_state(proc, None, [{"kind": "partition"}], pid_alive=False) == "dead"
    assert learner_state({**proc, "status": "unreachable"}, None, [], pid_alive=False) == "dead"
    assert learner_state(proc, {"state": "running"}, [], pid_alive=True) == "running"
    assert learner_state({"status": "dead", "next_start": 9.0}, None, [], pid_alive=False) == "restarting"


def test_resume_adopts_a_recorded_start_and_starts_an_unrecorded_one_again() -> None:
    adopted, lost, old = new_proc("learner", "a"), new_proc("learner", "a"), new_proc("learner", "a")
    started(old, {"pid": 1, "start_ticks": 1}, 50.0)
    old.update(status="starting", proc=None)  # died at 60, was being restarted: no new record
    adopted["status"] = lost["status"] = "starting"
    running = new_proc("learner", "a")
    started(running, {"pid": 3, "start_ticks": 3}, 10.0)
    state = {"procs": {"learner-0": adopted, "learner-1": lost, "learner-2": old, "learner-3": running}}
    records = [
        {"t": 49.0, "target": "learner-2", "pid": 1, "start_ticks": 1},
        {"t": 70.0, "target": "learner-0", "pid": 7, "start_ticks": 8},
    ]
    events = resume(state, records, 71.0)
    assert adopted["status"] == "running" and adopted["proc"] == {"pid": 7, "start_ticks": 8}
    assert lost["status"] == "pending" and old["status"] == "pending"  # learner-2's record is its old start
    assert running["status"] == "running" and running["proc"]["pid"] == 3
    assert [(k, t) for k, t, _ in events] == [("start", "learner-0")] and "adopted" in events[0][2]


def test_backoff_is_immediate_then_doubles_while_restarts_die_fast() -> None:
    b = watchdog.Backoff(base=1.0, cap=10.0)
    assert b.ready(0.0) and b.restarted(3600.0, 0.0) == 0.0 and b.ready(0.0)  # lived long: again at once
    assert b.restarted(2.0, 1.0) == 2.0 and not b.ready(2.9) and b.ready(3.0)
    assert b.restarted(2.0, 3.0) == 4.0
    assert [b.restarted(1.0, 9.0) for _ in range(3)] == [8.0, 10.0, 10.0]  # capped
    assert b.restarted(watchdog.FAST_S + 1, 20.0) == 0.0  # a healthy run resets it


# ---------------------------------------------------------------- a run directory


@pytest.fixture()
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> rundir.RunDir:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    run = rundir.create("sup")
    run.config.write_text(
        json.dumps(
            {
                "run": {"fragments": 2, "quorum": 1, "insecure": True},
                "syncer": {"advertise": "127.0.0.1", "port": 1, "control_port": 1},
                "learners": [{"id": f"learner-{i}", "device": "cpu"} for i in range(3)],
            }
        )
    )
    (run.path / "inventory.json").write_text(
        json.dumps({"hosts": [{"name": "here", "address": "local"}, {"name": "far", "address": "10.0.0.9"}]})
    )
    with run.locked():
        run.write_state(
            {
                "status": "up",
                "created": 1000.0,
                "faults": [],
                "procs": {
                    "learner-0": {
                        "kind": "learner",
                        "host": "here",
                        "status": "running",
                        "started_at": 0.0,
                        "proc": dead_pid(),
                    },
                    "learner-1": {
                        "kind": "learner",
                        "host": "here",
                        "status": "running",
                        "started_at": 0.0,
                        "proc": me(),
                    },
                    "learner-2": {
                        "kind": "learner",
                        "host": "far",
                        "status": "running",
                        "started_at": 0.0,
                        "proc": {"pid": 1, "start_ticks": 1},
                    },
                },
            }
        )
    return run


def test_status_checks_local_pids_and_says_the_supervisor_is_missing(run: rundir.RunDir) -> None:
    with run.update() as state:
        state["supervisor"] = {**dead_pid(), "started": 1000.0, "restarts": 2}
        state["watchdog"] = {**me(), "started": 1000.0}
    snap = snapshot.collect(run)
    rows = {r["id"]: r for r in snap["learners"]}
    assert rows["learner-0"]["state"] == "dead" and rows["learner-0"]["pid"] is None  # dead pid, stale "running"
    assert rows["learner-1"]["state"] == "running" and rows["learner-1"]["pid"] == os.getpid()
    assert rows["learner-2"]["state"] == "running"  # remote: pid 1 here says nothing about it
    sup = snap["supervisor"]
    assert sup["state"] == "missing" and sup["alive"] is False and sup["restarts"] == 2
    assert sup["watchdog"]["alive"] is True and sup["watchdog"]["pid"] == os.getpid()
    out = io.StringIO()
    Console(file=out, width=160, force_terminal=True, color_system="standard").print(render_plain(snap, snap["now"]))
    text = out.getvalue()
    assert "SUPERVISOR MISSING" in text and "the watchdog restarts it" in text
    line = next(ln for ln in text.splitlines() if "SUPERVISOR MISSING" in ln)
    assert "\x1b[1;31m" in line or "\x1b[31m" in line, line  # in red


def test_status_says_a_beating_supervisor_is_alive(run: rundir.RunDir) -> None:
    with run.update() as state:
        state["supervisor"] = {**me(), "started": 1000.0}
    watchdog.beat(run)
    snap = snapshot.collect(run)
    assert snap["supervisor"]["state"] == "ok" and snap["supervisor"]["heartbeat_age_s"] < 5
    assert snap["supervisor"]["watchdog"]["alive"] is False
    text = io.StringIO()
    Console(file=text, width=160).print(render_plain(snap, snap["now"]))
    assert "no watchdog: the supervisor restarts it" in text.getvalue()
    assert f"alive  pid {os.getpid()}" in text.getvalue()


def test_respawn_starts_nothing_once_the_run_is_stopping_or_while_one_lives(run: rundir.RunDir) -> None:
    with run.update() as state:
        state["supervisor"] = me()
    assert watchdog.respawn(run, "supervisor") is None  # the recorded one is alive
    with run.update() as state:
        state.update(status="stopping", supervisor=dead_pid())
    assert watchdog.respawn(run, "supervisor") is None  # `down` has begun
    assert run.started_procs() == []


def test_the_watchdog_restarts_a_dead_supervisor_once_and_says_why(
    run: rundir.RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def fake_respawn(r: rundir.RunDir, role: str) -> object:
        calls.append(role)
        with r.update() as state:
            state[role] = {**me(), "started": time.time()}
        return watchdog.ProcRef(os.getpid(), me()["start_ticks"]), {"pid": 4, "started": 0.0}

    monkeypatch.setattr(watchdog, "respawn", fake_respawn)
    with run.update() as state:
        state["supervisor"] = {**dead_pid(), "started": 1000.0}
    dog = watchdog.Watchdog(run)
    assert dog.step() and calls == ["supervisor"]
    assert dog.step() and calls == ["supervisor"]  # alive now: nothing more to do
    kinds = [(e["kind"], e["detail"]) for e in map(json.loads, run.events.read_text().splitlines())]
    assert [k for k, _ in kinds] == ["supervisor_lost", "supervisor_restarted"]
    assert "is dead" in kinds[1][1] and f"new pid {os.getpid()}" in kinds[1][1]
    with run.update() as state:
        state["status"] = "stopping"
    assert dog.step() is False  # the watchdog leaves with the run


def test_the_live_view_header_turns_red_for_a_missing_supervisor() -> None:
    from dldctl.observe.view import History, render_live

    snap = json.loads((Path(__file__).resolve().parents[1] / "data" / "snapshots" / "healthy.json").read_text())
    snap["supervisor"] = {
        "alive": False,
        "state": "missing",
        "pid": 7,
        "restarts": 0,
        "heartbeat_age_s": 3.2,
        "watchdog": {"alive": True, "pid": 8, "restarts": 0},
    }
    console = Console(record=True, width=160, height=30, file=io.StringIO())
    console.print(render_live(snap, History(), snap["now"] + 1.0))
    assert "SUPERVISOR MISSING for 4.2s: the watchdog restarts it" in console.export_text()
    snap["supervisor"].update(alive=True, state="ok")
    console = Console(record=True, width=160, height=30, file=io.StringIO())
    console.print(render_live(snap, History(), snap["now"]))
    assert "SUPERVISOR" not in console.export_text()
