"""The log lines an operator reads: the supervisor's decisions, the syncer's operator log (rate
limits on a fake clock), the learner's incarnation prefix; and a log write that fails never raises."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from dldctl.observe import logmerge
from dldctl.runstate import PidRecord, Proc, ProcStatus, RunState
from dldctl.supervise import decisionlog
from dldctl.supervise.reconcile import Observation, decide
from learner import logline
from syncer import oplog
from syncer.common import jsonl, jsonlread

T0 = time.mktime(time.strptime("2026-12-02 12:01:02", "%Y-%m-%d %H:%M:%S"))


def test_a_decision_reads_as_one_stamped_line() -> None:
    record = {
        "t": T0,
        "kind": "death",
        "target": "learner-2",
        "detail": "process gone after 4.0 s;\n restart 1 in 5.0 s",
    }
    line = decisionlog.decision_line(record)
    assert line == "2026-12-02 12:01:02 learner-2 died: process gone after 4.0 s; restart 1 in 5.0 s"
    assert logmerge.line_time(line, T0 + 5) == T0  # `dldctl logs` merges it by its stamp
    assert decisionlog.decision_line({"t": T0, "kind": "host_back", "target": "learner-3", "detail": ""}).endswith(
        "learner-3 reachable again"
    )
    assert "spare handed over" in decisionlog.decision_line({"t": T0, "kind": "spare_handed_over", "target": "x"})


def test_the_death_decision_says_why_and_which_restart_and_when() -> None:
    proc = Proc(kind="learner", host="a", status=ProcStatus.RUNNING, proc=PidRecord(1, 1), started_at=T0, restarts=2)
    state = RunState(status="up", procs={"learner-1": proc})
    chaos = RunState(status="up", procs={"learner-1": replace(proc, chaos_kill=True)})
    _, _, events = decide(chaos, {"learner-1": Observation(False)}, T0 + 100, 5.0, 60.0)
    assert events == [
        ("death", "learner-1", "process gone after 100.0 s (killed by `dldctl chaos`); restart 3 in 5.0 s")
    ]
    _, _, events = decide(state, {"learner-1": Observation(False, None, "OOM")}, T0 + 3, 5.0, 60.0)
    _, _, detail = events[0]
    assert "died within 30 s of its start 1 time(s) in a row: backing off; restart 3 in 10.0 s" in detail
    assert detail.endswith("its log ends: OOM")


def test_logging_run_dir_writes_the_event_and_the_line(tmp_path: Path) -> None:
    run = decisionlog.LoggingRunDir(tmp_path)
    run.event("restart", "learner-1", "pid 7 on local (restart 1)", spare=False)
    record = list(jsonlread.read(run.events))[-1]
    assert (record["kind"], record["spare"]) == ("restart", False)  # the supervisor's structured fields kept
    text = run.supervisor_log.read_text()
    assert text.endswith("learner-1 restarted: pid 7 on local (restart 1)\n")


def test_a_log_that_cannot_be_written_is_dropped_not_raised(tmp_path: Path) -> None:
    run = decisionlog.LoggingRunDir(tmp_path)
    run.supervisor_log.mkdir()  # opening it for writing fails (EISDIR), as a full disk's write does
    run.event("death", "learner-0", "process gone after 1.0 s")  # no exception
    assert not run.log_line("another")
    assert jsonl.dropped().get("supervisor.log", 0) >= 2
    kinds = [r["kind"] for r in jsonlread.read(run.events)]
    assert kinds[0] == "death" and "write_dropped" in kinds


def test_rejections_say_the_first_then_a_count_per_interval() -> None:
    log = oplog.OpLog(every_s=10.0)
    first = log.event("reject", "learner-1", "stale: fragment 2 at version 3", T0)
    assert len(first) == 1 and "reject learner-1: stale: fragment 2" in first[0]
    assert all(log.event("reject", "learner-1", "stale: fragment 2 again", T0 + i) == [] for i in range(1, 500))
    assert log.event("reject", "unknown", "schema: bad frame", T0 + 2) != []  # another class: its own first line
    assert log.due(T0 + 5) == []  # the interval is not over
    counts = log.due(T0 + 10)
    assert len(counts) == 1 and "reject stale: 499 more in the last 10 s (500 in all" in counts[0]
    assert log.due(T0 + 30) == []  # nothing new: nothing said
    assert log.event("backlog", "learner-0", "fragment 1: 23 steps", T0) != []
    assert log.event("backlog", "learner-0", "fragment 2: 26 steps", T0 + 1) == []
    assert log.event("backlog", "learner-1", "fragment 1: 12 steps", T0 + 1) != []  # per learner


def test_checkpoints_are_said_at_most_once_per_interval_and_the_final_always() -> None:
    log = oplog.OpLog(every_s=10.0)
    assert (
        "checkpoint at outer step 20: c1.pt, 1.5 MB in 0.02 s"
        in log.checkpoint(20, "c1.pt", 1_500_000, 0.02, T0, False)[0]
    )
    assert log.checkpoint(40, "c2.pt", 1, 0.01, T0 + 1, False) == []
    later = log.checkpoint(60, "c3.pt", 2048, 0.01, T0 + 11, False)
    assert "2.0 kB" in later[0] and "(2 checkpoints since the last line)" in later[0]
    assert log.checkpoint(61, "c4.pt", 10, 0.0, T0 + 12, True)[0].startswith("2026-12-02 12:01:14 final checkpoint")


def test_operator_events_read_plainly_and_start_lines_are_not_repeated() -> None:
    log = oplog.OpLog()
    assert log.event("quorum_lost", "syncer", "2 live learners, minimum quorum 3", T0) == [
        "2026-12-02 12:01:02 quorum lost: 2 live learners, minimum quorum 3"
    ]
    assert log.event("join", "learner-2", "pid 9 on h (cpu)", T0) == [
        "2026-12-02 12:01:02 join learner-2: pid 9 on h (cpu)"
    ]
    assert log.event("syncer_start", "syncer", "epoch 1", T0) == [] and log.event("checkpoint", "syncer", "x", T0) == []
    line = oplog.resumed(Path("/r/checkpoints/ckpt-0003-000000500-1.pt"), 500, [1, 2], 4, T0)
    assert "resume from checkpoint /r/checkpoints/ckpt-0003-000000500-1.pt (written in epoch 3, outer step 500" in line


def test_learner_lines_name_the_incarnation() -> None:
    assert logline.prefix("learner-2", {"DLDCTL_RESTARTS": "2"}) == "[#3] learner-2: "
    assert logline.prefix("learner-0", {}) == "[#1] learner-0: "
    assert (
        logline.prefix("learner-1", {"DLDCTL_RESTARTS": "1", "WORLD_SIZE": "2", "RANK": "1"}) == "[#2 r1] learner-1: "
    )
    assert logline.incarnation({"DLDCTL_RESTARTS": "junk"}) == 1


def test_a_send_to_a_killed_learner_is_not_a_host_unreachable() -> None:
    """ZeroMQ says "Host unreachable" for a peer whose connection closed, a learner killed on this
    very machine included: the event says the connection is gone, not that a host is."""
    import errno

    gone = oplog.send_dropped(errno.EHOSTUNREACH, "Host unreachable")
    assert "unreachable" not in gone.lower() and "connection is gone" in gone
    assert "queue is full" in oplog.send_dropped(errno.EAGAIN, "Resource temporarily unavailable")
    assert oplog.send_dropped(None, "Operation cannot be accomplished") == "Operation cannot be accomplished"
