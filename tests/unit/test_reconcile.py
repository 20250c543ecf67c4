"""The supervisor's pure decisions: start pending processes, notice deaths, restart after the
delay with crash-loop backoff (chaos kills exempt, holds honoured), finished and refused
learners left alone, unreachable hosts marked, expired faults undone."""

from __future__ import annotations

from dataclasses import replace

from dldctl.runstate import Fault, PidRecord, Proc, ProcStatus, RunState
from dldctl.supervise import reconcile
from dldctl.supervise.reconcile import Observation, backoff_delay, decide, new_proc, started


def state(**procs: Proc) -> RunState:
    return RunState(status="up", procs=procs)


def start(e: Proc, pid: int, now: float) -> Proc:
    return started(e, PidRecord(pid, pid), now)[0]


def test_pending_processes_are_started() -> None:
    st = state(syncer=new_proc("syncer", "local"), **{"learner-0": new_proc("learner", "a")})
    st, actions, events = decide(st, {}, 100.0, 2.0, 60.0)
    assert sorted(a.target for a in actions if a.kind == "start") == ["learner-0", "syncer"]
    assert st.procs["syncer"].status is ProcStatus.STARTING and events == []


def test_death_then_restart_after_the_delay() -> None:
    e, kind = started(new_proc("learner", "a"), PidRecord(1, 2), 0.0)
    assert kind == "start"
    st = state(**{"learner-0": e})
    st, _, events = decide(st, {"learner-0": Observation(False)}, 100.0, 2.0, 60.0)
    e = st.procs["learner-0"]
    assert e.status is ProcStatus.DEAD and e.next_start == 102.0 and e.proc is None
    assert events[0][0] == "death"
    st, actions, _ = decide(st, {}, 101.0, 2.0, 60.0)
    assert actions == []
    st, actions, _ = decide(st, {}, 102.5, 2.0, 60.0)
    assert [a.kind for a in actions] == ["start"] and st.procs["learner-0"].status is ProcStatus.STARTING
    e, kind = started(st.procs["learner-0"], PidRecord(3, 4), 103.0)
    assert kind == "restart" and e.restarts == 1


def test_crash_loop_backs_off_but_chaos_kills_do_not_count() -> None:
    st = state(**{"learner-0": new_proc("learner", "a")})
    for i, now in enumerate((10.0, 20.0, 30.0)):
        st = st.with_proc("learner-0", start(st.procs["learner-0"], i, now - 5.0))  # each lived 5 s: a fast death
        st, _, _ = decide(st, {"learner-0": Observation(False)}, now, 2.0, 60.0)
    e = st.procs["learner-0"]
    assert e.fast_deaths == 3 and e.next_start == 30.0 + backoff_delay(3, 2.0, 60.0) == 46.0
    e = replace(start(e, 9, 50.0), chaos_kill=True, hold_until=80.0)
    st, _, _ = decide(st.with_proc("learner-0", e), {"learner-0": Observation(False)}, 52.0, 2.0, 60.0)
    e = st.procs["learner-0"]
    assert e.fast_deaths == 3 and e.next_start == 80.0 and not e.chaos_kill  # the hold wins, no extra backoff
    assert backoff_delay(10, 2.0, 60.0) == 60.0


def test_a_crash_says_its_last_log_line_a_chaos_kill_does_not() -> None:
    st = state(**{"learner-0": start(new_proc("learner", "a"), 1, 0.0)})
    error = "ValueError: Expected a torch.device with a specified index or an integer, but got:cuda"
    st, _, events = decide(st, {"learner-0": Observation(False, None, error)}, 3.0, 2.0, 60.0)
    assert events[0][0] == "death" and events[0][2].endswith(f"its log ends: {error}")
    e = replace(start(st.procs["learner-0"], 2, 10.0), chaos_kill=True)
    seen = {"learner-0": Observation(False, None, "learner-0: step 40 loss 3.1")}
    _, _, events = decide(st.with_proc("learner-0", e), seen, 20.0, 2.0, 60.0)
    assert "its log ends" not in events[0][2]


def test_finished_and_refused_learners_are_not_restarted() -> None:
    a, b = start(new_proc("learner", "x"), 1, 0.0), start(new_proc("learner", "x"), 2, 0.0)
    st = state(**{"learner-0": a, "learner-1": b})
    st, actions, events = decide(
        st,
        {"learner-0": Observation(False, "finished"), "learner-1": Observation(False, "refused: model mismatch")},
        50.0,
        2.0,
        60.0,
    )
    assert (st.procs["learner-0"].status, st.procs["learner-1"].status) == ("finished", "stopped")
    assert st.procs["learner-1"].reason == "refused: model mismatch"  # `status` shows it as `refused`
    assert actions == [] and [k for k, _, _ in events] == ["finished", "refused"]
    assert decide(st, {}, 1000.0, 2.0, 60.0)[1] == []


def test_unreachable_host_is_marked_once_and_recovers() -> None:
    st = state(**{"learner-0": start(new_proc("learner", "a"), 1, 0.0)})
    st, _, events = decide(st, {"learner-0": Observation(None)}, 10.0, 2.0, 60.0)
    assert st.procs["learner-0"].status is ProcStatus.UNREACHABLE and events[0][0] == "host_unreachable"
    st, _, events = decide(st, {"learner-0": Observation(None)}, 11.0, 2.0, 60.0)
    assert events == []
    st, _, events = decide(st, {"learner-0": Observation(True)}, 12.0, 2.0, 60.0)
    assert st.procs["learner-0"].status is ProcStatus.RUNNING and events[0][0] == "host_back"


def test_expired_faults_are_undone_and_kills_are_not() -> None:
    st = replace(
        state(),
        faults=(
            Fault("1", "pause", "learner-0", 5.0),
            Fault("2", "slow", "learner-1", 50.0),
            Fault("3", "kill", "learner-2", 1.0),
        ),
    )
    _, actions, _ = decide(st, {}, 10.0, 2.0, 60.0)
    assert [(a.kind, a.fault.id if a.fault else None) for a in actions] == [("undo", "1")]


def test_start_failure_backs_off() -> None:
    e, delay = reconcile.start_failed(new_proc("learner", "a"), 100.0, 2.0, 60.0)
    assert delay == 4.0
    assert e.status is ProcStatus.DEAD and e.next_start == 104.0


def test_a_death_while_the_oom_killer_fired_on_its_host_says_out_of_memory() -> None:
    st = state(
        **{"learner-0": start(new_proc("learner", "a"), 1, 0.0), "syncer": start(new_proc("syncer", "s"), 2, 0.0)}
    )
    seen = {"learner-0": Observation(False, ooms=2), "syncer": Observation(False, ooms=1)}
    _, _, events = decide(st, seen, 100.0, 2.0, 60.0)
    said = {target: detail for _, target, detail in events}
    assert "(out of memory? the kernel's OOM killer killed 2 processes on host a meanwhile: " in said["learner-0"]
    assert "fewer learners or a smaller batch_size there" in said["learner-0"]
    assert "killed 1 process on host s meanwhile: its shards on other hosts" in said["syncer"]


def test_no_oom_kill_or_a_chaos_kill_says_nothing_of_memory() -> None:
    st = state(**{"learner-0": start(new_proc("learner", "a"), 1, 0.0)})
    _, _, events = decide(st, {"learner-0": Observation(False)}, 100.0, 2.0, 60.0)
    assert "memory" not in events[0][2]
    killed = st.with_proc("learner-0", replace(st.procs["learner-0"], chaos_kill=True))
    _, _, events = decide(killed, {"learner-0": Observation(False, ooms=1)}, 100.0, 2.0, 60.0)
    assert "killed by `dldctl chaos`" in events[0][2] and "memory" not in events[0][2]


def test_a_kill_from_the_live_view_is_attributed_to_the_view() -> None:
    """The view's kill records who asked; the death says so (not `dldctl chaos`), and the next
    ordinary death attributes nothing."""
    st = state(**{"learner-0": start(new_proc("learner", "a"), 1, 0.0)})
    view = "the live view"
    killed = st.with_proc("learner-0", replace(st.procs["learner-0"], chaos_kill=True, killed_by=view))
    st, _, events = decide(killed, {"learner-0": Observation(False)}, 100.0, 2.0, 60.0)
    assert f"killed by {view}" in events[0][2] and "dldctl chaos" not in events[0][2]
    assert st.procs["learner-0"].killed_by is None and not st.procs["learner-0"].chaos_kill
