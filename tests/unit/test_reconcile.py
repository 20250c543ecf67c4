"""The supervisor's pure decisions: start pending processes, notice deaths, restart after the
delay with crash-loop backoff (chaos kills exempt, holds honoured), finished and refused
learners left alone, unreachable hosts marked, expired faults undone."""

from __future__ import annotations

from dldctl.supervise import reconcile
from dldctl.supervise.reconcile import Observation, backoff_delay, decide, new_proc, started


def state(**procs: dict) -> dict:
    return {"procs": procs, "faults": []}


def test_pending_processes_are_started() -> None:
    st = state(syncer=new_proc("syncer", "local"), **{"learner-0": new_proc("learner", "a")})
    actions, events = decide(st, {}, 100.0, 2.0, 60.0)
    assert sorted(a.target for a in actions if a.kind == "start") == ["learner-0", "syncer"]
    assert st["procs"]["syncer"]["status"] == "starting" and events == []


def test_death_then_restart_after_the_delay() -> None:
    e = new_proc("learner", "a")
    assert started(e, {"pid": 1, "start_ticks": 2}, 0.0) == "start"
    st = state(**{"learner-0": e})
    _, events = decide(st, {"learner-0": Observation(False)}, 100.0, 2.0, 60.0)
    assert e["status"] == "dead" and e["next_start"] == 102.0 and e["proc"] is None
    assert events[0][0] == "death"
    actions, _ = decide(st, {}, 101.0, 2.0, 60.0)
    assert actions == []
    actions, _ = decide(st, {}, 102.5, 2.0, 60.0)
    assert [a.kind for a in actions] == ["start"] and e["status"] == "starting"
    assert started(e, {"pid": 3, "start_ticks": 4}, 103.0) == "restart" and e["restarts"] == 1


def test_crash_loop_backs_off_but_chaos_kills_do_not_count() -> None:
    e = new_proc("learner", "a")
    st = state(**{"learner-0": e})
    for i, now in enumerate((10.0, 20.0, 30.0)):
        started(e, {"pid": i, "start_ticks": i}, now - 5.0)  # each lived 5 s: a fast death
        decide(st, {"learner-0": Observation(False)}, now, 2.0, 60.0)
    assert e["fast_deaths"] == 3 and e["next_start"] == 30.0 + backoff_delay(3, 2.0, 60.0) == 46.0
    started(e, {"pid": 9, "start_ticks": 9}, 50.0)
    e["chaos_kill"], e["hold_until"] = True, 80.0
    decide(st, {"learner-0": Observation(False)}, 52.0, 2.0, 60.0)
    assert e["fast_deaths"] == 3 and e["next_start"] == 80.0  # the hold wins, no extra backoff
    assert backoff_delay(10, 2.0, 60.0) == 60.0


def test_a_crash_says_its_last_log_line_a_chaos_kill_does_not() -> None:
    e = new_proc("learner", "a")
    st = state(**{"learner-0": e})
    started(e, {"pid": 1, "start_ticks": 1}, 0.0)
    error = "ValueError: Expected a torch.device with a specified index or an integer, but got:cuda"
    _, events = decide(st, {"learner-0": Observation(False, None, error)}, 3.0, 2.0, 60.0)
    assert events[0][0] == "death" and events[0][2].endswith(f"its log ends: {error}")
    started(e, {"pid": 2, "start_ticks": 2}, 10.0)
    e["chaos_kill"] = True
    _, events = decide(st, {"learner-0": Observation(False, None, "learner-0: step 40 loss 3.1")}, 20.0, 2.0, 60.0)
    assert "its log ends" not in events[0][2]


def test_finished_and_refused_learners_are_not_restarted() -> None:
    a, b = new_proc("learner", "x"), new_proc("learner", "x")
    started(a, {"pid": 1, "start_ticks": 1}, 0.0)
    started(b, {"pid": 2, "start_ticks": 2}, 0.0)
    st = state(**{"learner-0": a, "learner-1": b})
    actions, events = decide(
        st,
        {"learner-0": Observation(False, "finished"), "learner-1": Observation(False, "refused: model mismatch")},
        50.0,
        2.0,
        60.0,
    )
    assert (a["status"], b["status"]) == ("finished", "stopped") and actions == []
    assert [k for k, _, _ in events] == ["finished", "refused"]
    assert decide(st, {}, 1000.0, 2.0, 60.0)[0] == []


def test_unreachable_host_is_marked_once_and_recovers() -> None:
    e = new_proc("learner", "a")
    started(e, {"pid": 1, "start_ticks": 1}, 0.0)
    st = state(**{"learner-0": e})
    _, events = decide(st, {"learner-0": Observation(None)}, 10.0, 2.0, 60.0)
    assert e["status"] == "unreachable" and events[0][0] == "host_unreachable"
    assert decide(st, {"learner-0": Observation(None)}, 11.0, 2.0, 60.0)[1] == []
    _, events = decide(st, {"learner-0": Observation(True)}, 12.0, 2.0, 60.0)
    assert e["status"] == "running" and events[0][0] == "host_back"


def test_expired_faults_are_undone_and_kills_are_not() -> None:
    st = state()
    st["faults"] = [
        {"id": "1", "kind": "pause", "target": "learner-0", "until": 5.0},
        {"id": "2", "kind": "slow", "target": "learner-1", "until": 50.0},
        {"id": "3", "kind": "kill", "target": "learner-2", "until": 1.0},
    ]
    actions, _ = decide(st, {}, 10.0, 2.0, 60.0)
    assert [(a.kind, a.fault["id"]) for a in actions] == [("undo", "1")]


def test_start_failure_backs_off() -> None:
    e = new_proc("learner", "a")
    assert reconcile.start_failed(e, 100.0, 2.0, 60.0) == 4.0
    assert e["status"] == "dead" and e["next_start"] == 104.0
