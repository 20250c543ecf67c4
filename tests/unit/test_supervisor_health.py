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
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from dldctl import rundir
from dldctl.hosts.local import read_stat
from dldctl.observe import snapshot
from dldctl.observe.snapshot import learner_state
from dldctl.observe.view import render_plain
from dldctl.runstate import Daemon, Fault, PidRecord, Proc, ProcStatus, RunState
from dldctl.supervise import watchdog
from dldctl.supervise.reconcile import HUNG_S, STALE_S, new_proc, resume, started, supervisor_health

pytestmark = [pytest.mark.timeout(60)]


def me() -> PidRecord:
    return PidRecord(os.getpid(), read_stat(os.getpid()).start_ticks)


def dead_pid() -> PidRecord:
    """The pid and start time of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        record = PidRecord(proc.pid, read_stat(proc.pid).start_ticks)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    return record


def daemon(ref: PidRecord, started: float | None = None, restarts: int = 0) -> Daemon:
    return Daemon(ref.pid, ref.start_ticks, started, restarts)


# ---------------------------------------------------------------- the pure rules


def test_supervisor_health_missing_stale_hung_ok_stopped() -> None:
    rec = Daemon(1, 2, 1000.0)
    assert supervisor_health(rec, True, 1010.0, 1011.0, "up") == "ok"
    assert supervisor_health(rec, True, 1010.0, 1010.0 + STALE_S + 1, "up") == "stale"
    assert supervisor_health(rec, True, 1010.0, 1010.0 + HUNG_S + 1, "up") == "hung"
    assert supervisor_health(rec, False, 1010.0, 1011.0, "up") == "missing"
    assert supervisor_health(None, False, None, 1011.0, "starting") == "missing"
    assert supervisor_health(rec, False, 1010.0, 1011.0, "stopping") == "stopped"
    assert supervisor_health(rec, False, None, 5000.0, "down") == "stopped"
    # a new one that has not beaten yet: its start counts as a beat (an old beat file does not)
    assert supervisor_health(replace(rec, started=4990.0), True, 1010.0, 5000.0, "up") == "ok"


def test_a_dead_pid_is_dead_never_running_or_partitioned() -> None:
    proc = Proc("learner", "a", ProcStatus.RUNNING, PidRecord(5, 6), started_at=0.0)
    assert learner_state(proc, {"state": "unreachable"}, []) == "partitioned"  # the stale record's word
    assert learner_state(proc, {"state": "unreachable"}, [], pid_alive=False) == "dead"
    assert learner_state(proc, {"state": "running"}, [], pid_alive=False) == "dead"
    assert learner_state(proc, None, [Fault("f", "partition", "a")], pid_alive=False) == "dead"
    assert learner_state(replace(proc, status=ProcStatus.UNREACHABLE), None, [], pid_alive=False) == "dead"
    assert learner_state(proc, {"state": "running"}, [], pid_alive=True) == "running"
    dead = Proc("learner", "a", ProcStatus.DEAD, next_start=9.0)
    assert learner_state(dead, None, [], pid_alive=False) == "restarting"


def test_a_learner_the_syncer_refused_says_so_and_a_stopped_one_does_not() -> None:
    refused = Proc("learner", "a", ProcStatus.STOPPED, reason="refused: the syncer cannot hold this model: ...")
    assert learner_state(refused, None, []) == "refused"
    assert learner_state(replace(refused, reason="stopped by down"), None, []) == "stopped"
    assert learner_state(replace(refused, reason=None), None, []) == "stopped"


def test_resume_adopts_a_recorded_start_and_starts_an_unrecorded_one_again() -> None:
    starting = replace(new_proc("learner", "a"), status=ProcStatus.STARTING)
    old, _ = started(new_proc("learner", "a"), PidRecord(1, 1), 50.0)
    old = replace(old, status=ProcStatus.STARTING, proc=None)  # died at 60, was being restarted: no new record
    running, _ = started(new_proc("learner", "a"), PidRecord(3, 3), 10.0)
    state = RunState(
        status="up", procs={"learner-0": starting, "learner-1": starting, "learner-2": old, "learner-3": running}
    )
    records = [
        {"t": 49.0, "target": "learner-2", "pid": 1, "start_ticks": 1},
        {"t": 70.0, "target": "learner-0", "pid": 7, "start_ticks": 8},
    ]
    state, events = resume(state, records, 71.0)
    p = state.procs
    assert p["learner-0"].status is ProcStatus.RUNNING and p["learner-0"].proc == PidRecord(7, 8)
    assert p["learner-1"].status is ProcStatus.PENDING  # learner-2's record is its old start:
    assert p["learner-2"].status is ProcStatus.PENDING
    assert p["learner-3"].status is ProcStatus.RUNNING and p["learner-3"].proc == PidRecord(3, 3)
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
                "version": 1,
                "run_id": "sup-1",
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
            RunState(
                status="up",
                created=1000.0,
                procs={
                    "learner-0": Proc("learner", "here", ProcStatus.RUNNING, dead_pid(), started_at=0.0),
                    "learner-1": Proc("learner", "here", ProcStatus.RUNNING, me(), started_at=0.0),
                    "learner-2": Proc("learner", "far", ProcStatus.RUNNING, PidRecord(1, 1), started_at=0.0),
                },
            )
        )
    return run


def test_status_checks_local_pids_and_says_the_supervisor_is_missing(run: rundir.RunDir) -> None:
    with run.update() as edit:
        edit.state = replace(edit.state, supervisor=daemon(dead_pid(), 1000.0, 2), watchdog=daemon(me(), 1000.0))
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
    with run.update() as edit:
        edit.state = replace(edit.state, supervisor=daemon(me(), 1000.0))
    watchdog.beat(run)
    snap = snapshot.collect(run)
    assert snap["supervisor"]["state"] == "ok" and snap["supervisor"]["heartbeat_age_s"] < 5
    assert snap["supervisor"]["watchdog"]["alive"] is False
    text = io.StringIO()
    Console(file=text, width=160).print(render_plain(snap, snap["now"]))
    assert "no watchdog: the supervisor restarts it" in text.getvalue()
    assert f"alive  pid {os.getpid()}" in text.getvalue()


def test_respawn_starts_nothing_once_the_run_is_stopping_or_while_one_lives(run: rundir.RunDir) -> None:
    with run.update() as edit:
        edit.state = replace(edit.state, supervisor=daemon(me()))
    assert watchdog.respawn(run, "supervisor") is None  # the recorded one is alive
    with run.update() as edit:
        edit.state = replace(edit.state, status="stopping", supervisor=daemon(dead_pid()))
    assert watchdog.respawn(run, "supervisor") is None  # `down` has begun
    assert run.started_procs() == []


def test_the_watchdog_restarts_a_dead_supervisor_once_and_says_why(
    run: rundir.RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def fake_respawn(r: rundir.RunDir, role: str) -> object:
        calls.append(role)
        with r.update() as edit:
            edit.state = edit.state.with_daemon(role, daemon(me(), time.time()))
        return watchdog.ProcRef(os.getpid(), me().start_ticks), Daemon(4, 0, 0.0)

    monkeypatch.setattr(watchdog, "respawn", fake_respawn)
    with run.update() as edit:
        edit.state = replace(edit.state, supervisor=daemon(dead_pid(), 1000.0))
    dog = watchdog.Watchdog(run)
    assert dog.step() and calls == ["supervisor"]
    assert dog.step() and calls == ["supervisor"]  # alive now: nothing more to do
    kinds = [(e["kind"], e["detail"]) for e in map(json.loads, run.events.read_text().splitlines())]
    assert [k for k, _ in kinds] == ["supervisor_lost", "supervisor_restarted"]
    assert "is dead" in kinds[1][1] and f"new pid {os.getpid()}" in kinds[1][1]
    with run.update() as edit:
        edit.state = edit.state.with_status("stopping")
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
