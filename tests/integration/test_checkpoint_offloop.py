"""A checkpoint write never stops the syncer: with the write paused half way for 20 s (the
`checkpoint` fault point, as a slow disk or a 1.5 GB model would), a real syncer keeps answering
status, keeps merging its learners' pushes and keeps the learners linked; the checkpoint then
lands with the state of the moment it was taken, and a restart resumes from it."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from syncer import checkpoint
from tests.localrun import LocalRun, write_config

pytestmark = [pytest.mark.timeout(240)]

PAUSE_S = 20.0


def _written(run: Path) -> list[int]:
    """The outer steps of the whole checkpoints on disk (one pruned while listed is skipped)."""
    steps = []
    for path in checkpoint.list_checkpoints(run / "checkpoints"):
        try:
            steps.append(int(checkpoint.read(path)["outer_steps"]))
        except (FileNotFoundError, checkpoint.CheckpointError):
            continue
    return steps


def test_the_syncer_merges_on_while_a_checkpoint_is_written(tmp_path: Path) -> None:
    config = write_config(tmp_path, [{}, {}], run={"H": 8, "checkpoint_every": 4})
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer(env={"DLDCTL_FAULT_POINTS": f"checkpoint@2={PAUSE_S:g}"})
        lr.start_learner(0)
        lr.start_learner(1)
        lr.wait_log("syncer", "fault point checkpoint", 150)
        paused_at = time.monotonic()
        first = lr.status()["syncer"]
        held = first["checkpoint_outer_step"]
        (half,) = [p.name for p in (tmp_path / "checkpoints").glob(".ckpt-*.tmp")]  # the paused write
        match = checkpoint.NAME.search(half)
        assert match is not None, half
        taken_at = int(match.group(2))  # the outer step of its snapshot
        assert held < taken_at <= first["outer_steps"]
        # while the write sleeps: status answers, rounds close, nobody is dropped
        snap = lr.wait_for(
            lambda s: s["syncer"]["outer_steps"] >= first["outer_steps"] + 4,
            PAUSE_S - 6,
            "merges during the checkpoint write",
        )
        assert time.monotonic() - paused_at < PAUSE_S
        assert snap["syncer"]["checkpoint_outer_step"] == held, "the paused checkpoint is not on disk yet"
        assert snap["quorum"]["live"] == 2
        # the write finishes and is accounted: a whole checkpoint of the outer step its snapshot had
        lr.wait_for(lambda s: s["syncer"]["checkpoint_outer_step"] >= taken_at, PAUSE_S + 60, "the checkpoint")
        assert max(_written(tmp_path)) >= taken_at
        lr.expect_dead = {"syncer"}
        lr.kill("syncer", signal.SIGKILL)
        newest = max(_written(tmp_path))
        lr.start_syncer()
        lr.expect_dead = set()
        lr.wait_for(lambda s: s["syncer"]["initialized"], 60, "restarted syncer")
        resumed = [e for e in lr.events() if e["kind"] == "syncer_resume"]
        assert resumed and resumed[-1]["detail"].startswith(f"from outer step {newest},"), resumed


@pytest.mark.parametrize("every_s", [1.0, 0.0])
def test_checkpoint_s_checkpoints_by_time_or_not_at_all(tmp_path: Path, every_s: float) -> None:
    """`checkpoint_every` out of reach: a checkpoint comes from `checkpoint_s` alone, or none."""
    config = write_config(tmp_path, [{}], run={"H": 8, "checkpoint_every": 10**6, "checkpoint_s": every_s})
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        lr.start_learner(0)
        snap = lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= 8, 120, "merges")
        if every_s > 0:
            lr.wait_for(lambda s: s["syncer"]["checkpoint_outer_step"] > 0, 30, "a checkpoint by time")
        else:
            time.sleep(4.0)  # four times what checkpoint_s = 1 needed
            later = lr.status()["syncer"]
            assert later["outer_steps"] > snap["syncer"]["outer_steps"]
            assert later["checkpoint_outer_step"] == 0
            assert not checkpoint.list_checkpoints(tmp_path / "checkpoints")
