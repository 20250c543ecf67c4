"""`dldctl status` with the syncer down: what the operator side still knows (the last sample,
the newest checkpoint, each learner's last step) and how a run that is down reads."""

from __future__ import annotations

import json
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from dldctl import rundir
from dldctl.observe import snapshot
from dldctl.runstate import Proc, ProcStatus, RunState
from syncer.common import jsonl


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> rundir.RunDir:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    run = rundir.create("snap")
    run.config.write_text(
        json.dumps(
            {
                "version": 1,
                "run_id": "snap-1",
                "run": {"fragments": 4, "quorum": 2, "insecure": True},
                "syncer": {"advertise": "127.0.0.1", "port": 1, "control_port": _closed_port()},
                "learners": [{"id": "learner-0", "device": "cpu"}, {"id": "learner-1", "device": "cuda:0"}],
            }
        )
    )
    with run.locked():
        run.write_state(
            RunState(
                status="up",
                created=1000.0,
                procs={
                    "learner-0": Proc("learner", "a", ProcStatus.RUNNING, started_at=0),
                    "learner-1": Proc("learner", "b", ProcStatus.RUNNING, started_at=0),
                },
            )
        )
    jsonl.append(
        run.metrics,
        {
            "t": 1090.0,
            "kind": "sample",
            "outer_steps": 77,
            "tokens_trained": 5000,
            "learners": {
                "learner-0": {"step": 120, "tokens": 3000, "loss": 2.5},
                "learner-1": {"step": 80, "tokens": 2000, "loss": None},
            },
        },
    )
    for name in ("ckpt-0001-000000060-1.pt", "ckpt-0001-000000072-2.pt", "notes.txt"):
        (run.checkpoints / name).write_bytes(b"x")
    return run


def test_syncer_down_keeps_what_it_last_said(run: rundir.RunDir) -> None:
    snap = snapshot.collect(run, now=1100.0)
    assert snap["syncer"]["alive"] is False and snap["syncer"]["outer_steps"] == 77
    assert snap["syncer"]["checkpoint_outer_step"] == 72  # the newest checkpoint file
    rows = {r["id"]: r for r in snap["learners"]}
    assert (rows["learner-0"]["step"], rows["learner-0"]["tokens"], rows["learner-0"]["loss"]) == (120, 3000, 2.5)
    assert rows["learner-1"]["step"] == 80 and rows["learner-1"]["device"] == "cuda:0"
    assert snap["uptime_s"] == 100.0 and "stale_learners" not in snap


def test_checkpoint_step_from_the_events_when_checkpoints_live_elsewhere(run: rundir.RunDir) -> None:
    for path in run.checkpoints.iterdir():
        path.unlink()
    for step, final in ((64, ""), (70, " (final)")):
        name = f"ckpt-0001-{step:09d}-{step}.pt"
        record = {
            "t": 1000.0 + step,
            "kind": "checkpoint",
            "target": "syncer",
            "detail": f"outer step {step}{final}: {name}",
        }
        jsonl.append(run.events, {**record, "outer_step": step, "epoch": 1, "checkpoint": name})
    assert snapshot.collect(run, now=1100.0)["syncer"]["checkpoint_outer_step"] == 70


def test_a_checkpoint_event_without_its_fields_is_not_read_from_its_message(run: rundir.RunDir) -> None:
    """An older syncer's event says the step only in words: the snapshot does not parse them."""
    for path in run.checkpoints.iterdir():
        path.unlink()
    run.event("checkpoint", "syncer", "outer step 64: ckpt-0001-000000064-3.pt")
    assert snapshot.collect(run, now=1100.0)["syncer"]["checkpoint_outer_step"] == 0


def test_a_run_that_is_down_stops_ageing(run: rundir.RunDir) -> None:
    with run.update() as edit:
        edit.state = replace(edit.state, status="down", stopped_at=1060.0)
    snap = snapshot.collect(run, now=5000.0)
    assert snap["status"] == "down" and snap["uptime_s"] == 60.0


def test_the_snapshot_is_versioned_and_typed(run: rundir.RunDir) -> None:
    """`status --json` carries `version` beside `schema`; the typed snapshot reads the same run."""
    snap = snapshot.collect(run, now=1100.0)
    assert snap["version"] == 1 and snap["schema"] == "dldctl.status/1"
    typed = snapshot.take(run, now=1100.0)
    assert typed.syncer.outer_steps == snap["syncer"]["outer_steps"] == 77 and not typed.syncer.alive
    assert [r.id for r in typed.learners] == [r["id"] for r in snap["learners"]]
