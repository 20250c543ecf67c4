"""When the syncer checkpoints (syncer/checkpointing.py, pure schedule) and the structured fields
every event about a checkpoint carries: `outer_step`, `epoch`, `checkpoint` beside its message.
A real core, real files, the real events log."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from syncer import checkpoint
from syncer.checkpointing import RETRY_S, Checkpoints, CheckpointSchedule
from syncer.common import jsonlread
from syncer.config import SyncerConfig
from syncer.core import SyncerCore
from syncer.records import Records
from tests.unit.coreharness import RUN, Harness, make_settings


def test_the_schedule_says_due_by_steps_or_when_idle_and_waits_after_a_failure() -> None:
    sched = CheckpointSchedule(every_s=60.0, now=0.0)
    assert sched.due(True, 5, busy=False, now=1.0) and not sched.due(True, 5, busy=True, now=1.0)
    assert not sched.due(False, 5, busy=False, now=30.0), "not idle long enough"
    assert sched.due(False, 5, busy=False, now=61.0) and not sched.due(False, 0, busy=False, now=61.0)
    sched.failed(now=61.0)
    assert not sched.due(True, 5, busy=False, now=61.0 + RETRY_S - 1) and sched.due(True, 5, False, 61.0 + RETRY_S)
    sched.written(now=100.0)
    assert not sched.due(False, 5, busy=False, now=150.0)


def test_a_scored_state_waits_for_the_writer() -> None:
    sched = CheckpointSchedule(every_s=0.0, now=0.0)
    sched.offer({"outer_steps": 3})
    sched.offer(None)  # nothing new: the older one still waits
    assert sched.take_scored(busy=True) is None
    assert sched.take_scored(busy=False) == {"outer_steps": 3} and sched.take_scored(busy=False) is None


def _checkpoints(core: SyncerCore, run_dir: Path) -> Checkpoints:
    s = dataclasses.replace(core.s, insecure=True)
    cfg = SyncerConfig(RUN, s, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", run_dir, ("a", "b", "c"), None)
    return Checkpoints(core, cfg, Records(run_dir, "syncer", 0, lambda: 50.0))


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in jsonlread.read(run_dir / "events.jsonl") if e["kind"] == kind]


def test_every_checkpoint_event_carries_outer_step_epoch_and_file_name(tmp_path: Path) -> None:
    h = Harness(make_settings())
    h.join_all()
    for i, lid in enumerate(("a", "b", "c")):
        h.push(lid, 0, h.delta(0, seed=i), now=2.0)
    h.tick(2.5)
    assert h.core.outer_steps == 1
    ckpts = _checkpoints(h.core, tmp_path)
    routine, final = ckpts.save(), ckpts.save(final=True)
    assert routine is not None and final is not None
    written = _events(tmp_path, "checkpoint")
    assert [(e["outer_step"], e["epoch"], e["checkpoint"]) for e in written] == [
        (1, 1, routine.name),
        (1, 1, final.name),
    ]
    assert written[1]["detail"] == f"outer step 1 (final): {final.name}", "the message stays as it was"

    final.write_bytes(b"not a checkpoint")  # the newest is damaged: a restart skips it, resumes the other
    fresh = SyncerCore(h.s, RUN, ["a", "b", "c"], now=60.0, epoch=2)
    _checkpoints(fresh, tmp_path).resume()
    [skipped] = _events(tmp_path, "checkpoint_corrupt")
    assert (skipped["outer_step"], skipped["epoch"], skipped["checkpoint"]) == (1, 1, final.name)
    [resumed] = _events(tmp_path, "syncer_resume")
    assert (resumed["outer_step"], resumed["epoch"], resumed["checkpoint"]) == (1, 1, routine.name)
    assert fresh.outer_steps == 1 and checkpoint.NAME.fullmatch(routine.name)


def test_a_failed_checkpoint_event_carries_its_outer_step_and_epoch(tmp_path: Path) -> None:
    h = Harness(make_settings())
    h.join_all()
    blocked = tmp_path / "run"
    blocked.mkdir()
    ckpts = _checkpoints(h.core, blocked)
    (blocked / "checkpoints").write_text("a file where the directory should be")
    assert ckpts.save() is None
    [failed] = _events(blocked, "checkpoint_failed")
    assert (failed["outer_step"], failed["epoch"], failed["checkpoint"]) == (0, 1, "")
    assert "retrying in 10 s" in failed["detail"]
