"""`dldctl status` of a sharded syncer: a row per shard from what it answers and what its files
and process say (merges per second, checkpoint age, CPU and memory), a shard that does not
answer as a row with `up` false (never an error), and the view's line per shard."""

from __future__ import annotations

import copy
import io
import json
import os
import socket
from pathlib import Path

import pytest
from rich.console import Console

from dldctl import rundir
from dldctl.observe import shardrows, snapshot
from dldctl.observe.shardrows import Seen, merge_rate, newest_checkpoint, parse_usage, shard_row
from dldctl.observe.snapshot_model import Snapshot
from dldctl.observe.view import History, render_live, render_plain
from dldctl.observe.view_shards import shard_text, sharded
from dldctl.runstate import PidRecord, Proc, ProcStatus, RunState
from syncer.common import jsonl

SNAPSHOTS = Path(__file__).resolve().parents[1] / "data" / "snapshots"


# -- pure ------------------------------------------------------------------------------------------
def test_merges_per_second_over_the_newest_samples() -> None:
    samples = [(0.0, 0), (2.0, 10), (4.0, 30), (6.0, 50), (8.0, 70), (10.0, 90), (12.0, 110), (14.0, 130)]
    assert merge_rate(samples) == pytest.approx((130 - 30) / 10.0)  # the newest 10 s
    assert merge_rate(samples, window_s=4.0) == pytest.approx(10.0)
    assert merge_rate(samples[:1]) is None and merge_rate([]) is None


def test_merges_per_second_count_from_a_restart() -> None:
    restarted = [(0.0, 100), (2.0, 120), (4.0, 110), (6.0, 116)]  # back at its checkpoint's 110
    assert merge_rate(restarted) == pytest.approx(3.0)


def test_the_newest_checkpoint_from_file_names_else_from_events() -> None:
    names = ["ckpt-0001-000000060-1000.pt", "ckpt-0002-000000012-5000.pt", "history.json", "ckpt-0001-x.pt"]
    assert newest_checkpoint(names) == (12, 5.0)  # epoch 2 is newer whatever its step
    events = [
        {"t": 7.0, "kind": "checkpoint", "detail": "outer step 40: ckpt-...", "outer_step": 40},
        {"t": 9.0, "kind": "checkpoint", "detail": "outer step 44: ckpt-...", "outer_step": 44},
        {"t": 9.5, "kind": "join", "detail": "outer step 99", "outer_step": 99},
        {"t": 9.8, "kind": "checkpoint", "detail": "outer step 50: ckpt-..."},  # an older syncer's: no field
    ]
    assert newest_checkpoint([], events) == (44, 9.0)  # the field, never the message
    assert newest_checkpoint([], []) is None


def test_cpu_and_memory_from_a_proc_stat_line() -> None:
    fields = ["S"] + ["0"] * 10 + ["250", "150"] + ["0"] * 8 + ["1000"] + ["0"] * 20
    line = "123 (python -m syncer) with) spaces) " + " ".join(fields)
    assert parse_usage(line, 100, 4096) == (4.0, 4096000)
    assert parse_usage("garbage", 100, 4096) is None
    here = shardrows._usage(os.getpid())
    assert here is not None and here[0] > 0 and here[1] > 1 << 20  # this very test process


ANSWER = {"alive": True, "owned": [1, 3], "pid": 42, "epoch": 3, "outer_steps": 500, "checkpoint_outer_step": 490}


def test_a_row_of_a_shard_that_answers() -> None:
    proc = Proc("syncer", "local", ProcStatus.RUNNING, PidRecord(42, 7), restarts=2, started_at=0.0)
    seen = Seen(((90.0, 480), (100.0, 500)), (490, 95.0), (12.5, 300 << 20), True, now=101.0)
    row = shard_row(1, ANSWER, proc, seen)
    assert row == {
        "shard": 1,
        "name": "syncer-1",
        "fragments": [1, 3],
        "up": True,
        "state": "running",
        "pid": 42,
        "epoch": 3,
        "outer_steps": 500,
        "checkpoint_outer_step": 490,
        "merges_per_s": 2.0,
        "checkpoint_age_s": 6.0,
        "cpu_s": 12.5,
        "rss_bytes": 300 << 20,
        "restarts": 2,
    }


@pytest.mark.parametrize(
    ("proc", "pid_alive", "state", "pid"),
    [
        (Proc("syncer", "local", ProcStatus.DEAD, next_start=5.0, restarts=1), None, "restarting", None),
        (Proc("syncer", "local", ProcStatus.DEAD), None, "dead", None),
        (Proc("syncer", "local", ProcStatus.RUNNING, PidRecord(9, 1), started_at=95.0), True, "starting", 9),
        (Proc("syncer", "local", ProcStatus.RUNNING, PidRecord(9, 1), started_at=0.0), True, "unreachable", 9),
        (Proc("syncer", "local", ProcStatus.RUNNING, PidRecord(9, 1), started_at=0.0), False, "dead", None),
        (Proc("syncer", "local", ProcStatus.STOPPED), None, "stopped", None),
        (None, None, "stopped", None),
    ],
)
def test_a_shard_that_does_not_answer_is_a_row_that_says_so(
    proc: Proc | None, pid_alive: bool | None, state: str, pid: int | None
) -> None:
    seen = Seen(((50.0, 300), (60.0, 320)), (310, 55.0), (1.0, 1), pid_alive, now=100.0)
    row = shard_row(2, None, proc, seen)
    assert (row["up"], row["state"], row["pid"], row["epoch"], row["fragments"]) == (False, state, pid, None, None)
    assert (row["outer_steps"], row["checkpoint_outer_step"], row["checkpoint_age_s"]) == (320, 310, 45.0)
    assert row["merges_per_s"] == 0.0 and row["cpu_s"] is None and row["rss_bytes"] is None


# -- the snapshot ------------------------------------------------------------------------------------
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> rundir.RunDir:
    """A run of two shards, neither of which answers; shard 1 restarting, with its own files."""
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    made = rundir.create("shards")
    ports = [_closed_port() for _ in range(4)]
    syncer = {"advertise": "127.0.0.1", "port": ports[0], "control_port": ports[1], "shards": 2}
    config = {"version": 1, "run_id": "s-1", "run": {"fragments": 4, "insecure": True}, "learners": []}
    made.config.write_text(json.dumps({**config, "syncer": {**syncer, "shard_ports": ports[2:]}}))
    procs = {
        "syncer": Proc("syncer", "local", ProcStatus.STOPPED),
        "syncer-1": Proc("syncer", "local", ProcStatus.DEAD, next_start=2000.0, restarts=1),
    }
    with made.locked():
        made.write_state(RunState(status="up", created=1000.0, procs=procs))
    shard = made.path / "shard-1"
    (shard / "checkpoints").mkdir(parents=True)
    (shard / "checkpoints" / "ckpt-0001-000000070-1080000.pt").write_bytes(b"x")
    for t, steps in ((1086.0, 72), (1088.0, 75)):
        jsonl.append(shard / "metrics.jsonl", {"t": t, "kind": "sample", "outer_steps": steps})
    return made


def test_status_has_a_row_per_shard_and_a_silent_shard_is_no_error(run: rundir.RunDir) -> None:
    snap = snapshot.collect(run, now=1100.0)
    assert snap["syncer"]["alive"] is False  # shard 0 speaks for the fleet, as an unsharded syncer
    zero, one = snap["shards"]
    assert (zero["shard"], zero["up"], zero["state"]) == (0, False, "stopped")
    assert (one["name"], one["up"], one["state"], one["restarts"]) == ("syncer-1", False, "restarting", 1)
    assert (one["outer_steps"], one["checkpoint_outer_step"], one["checkpoint_age_s"]) == (75, 70, 20.0)


def test_an_unsharded_run_has_one_row_and_every_key_it_had(run: rundir.RunDir) -> None:
    data = json.loads(run.config.read_text())
    data["syncer"] = {k: v for k, v in data["syncer"].items() if k not in ("shards", "shard_ports")}
    run.config.write_text(json.dumps(data))
    snap = snapshot.collect(run, now=1100.0)
    assert [r["shard"] for r in snap["shards"]] == [0]
    assert {"syncer", "quorum", "goodput", "tokens", "bytes", "loss", "learners", "events"} <= set(snap)


# -- the view ----------------------------------------------------------------------------------------
def _with_shards(up: bool) -> dict:
    snap = copy.deepcopy(json.loads((SNAPSHOTS / "healthy.json").read_text()))
    zero = shard_row(0, dict(ANSWER, owned=[0, 2], pid=41), None, Seen(now=snap["now"]))
    one = shard_row(1, ANSWER if up else None, Proc("syncer", "local", ProcStatus.DEAD, next_start=1.0), Seen())
    snap["shards"] = [zero, one]
    return snap


def test_plain_status_has_a_line_per_shard_and_none_unsharded() -> None:
    out = io.StringIO()
    snap = _with_shards(up=False)
    Console(file=out, width=140).print(render_plain(snap, snap["now"]))
    text = out.getvalue()
    assert "● syncer    fragments 0,2 pid 41 epoch 3 outer 500" in text
    assert "✖ RESTARTING syncer-1  fragments -" in text
    typed = Snapshot.from_json(snap)
    assert sharded(Snapshot.from_json({"shards": snap["shards"][:1]})) == []
    assert typed.shards is not None and "fragments 0,2" not in shard_text(typed.shards[1])


def test_the_live_view_has_a_shards_panel_when_sharded() -> None:
    snap = _with_shards(up=True)
    console = Console(record=True, width=120, height=40, file=io.StringIO())
    console.print(render_live(snap, History(), snap["now"]))
    text = console.export_text()
    assert "syncer shards 2/2 up" in text and "syncer-1" in text and "fragments 1,3" in text
    unsharded = dict(snap, shards=snap["shards"][:1])
    console = Console(record=True, width=120, height=40, file=io.StringIO())
    console.print(render_live(unsharded, History(), snap["now"]))
    assert "syncer shards" not in console.export_text()
