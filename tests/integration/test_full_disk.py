"""A full disk under a live run: the real syncer and 2 real learners keep merging, and write again.

The whole run directory (config, keys, logs, metrics, events, checkpoints, the learners' work
dirs) is on a small tmpfs. Once merging, a filler file takes every free byte (and the slack of the
learners' log pages, which they would take minutes to use up); the syncer and the
learners must stay alive and outer_steps must keep rising (status travels over the socket, not
the disk). When the filler is deleted, new metrics lines appear and the drops are told: a
`write_resumed` event from the syncer and the learners' "writing ... again" log lines.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tinyfs
from tests.localrun import LocalRun, write_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture()
def fs(tmp_path: Path) -> Iterator[Path]:
    with tinyfs.mounted(tmp_path / "fs", "48m") as path:
        yield path


def alive(lr: LocalRun) -> dict[str, int | None]:
    return {name: proc.poll() for name, proc in lr.procs.items()}


def keep_full(fs: Path) -> Path:
    """Take every free byte (again), and the slack of the learners' log pages (they log little)."""
    filler = tinyfs.fill(fs)
    for i in range(2):
        tinyfs.top_up(fs / f"learner-{i}.log")
    return filler


def test_syncer_and_learners_survive_a_full_disk_and_write_again(fs: Path) -> None:
    config = write_config(fs, [{}, {}], run={"eval_every": 10, "checkpoint_every": 5})
    with LocalRun(fs, config) as lr:
        lr.start_syncer()
        for i in range(2):
            lr.start_learner(i)
        lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= 4, 120, "first merges")
        filler = keep_full(fs)
        full_at = time.time()
        steps = lr.status()["syncer"]["outer_steps"]
        # kept full all along: a failed checkpoint's temp file, deleted, frees space again
        lr.wait_for(
            lambda s: bool(keep_full(fs)) and s["syncer"]["outer_steps"] >= steps + 12 and time.time() - full_at > 6,
            90,
            "merging on a full disk",
        )
        assert tinyfs.free_bytes(fs) < 64 << 10, "the disk did not stay full"
        assert alive(lr) == {"syncer": None, "learner-0": None, "learner-1": None}, alive(lr)
        lost = [r for r in lr.metrics("sample") if r["t"] > full_at + 4]
        assert not lost, "metrics were written while the disk was full?"
        filler.unlink()
        freed_at = time.time()
        lr.wait_for(lambda s: any(r["t"] > freed_at for r in lr.metrics("sample")), 30, "metrics again")
        lr.wait_for(
            lambda s: any(e["kind"] == "write_resumed" and e["target"] == "syncer" for e in lr.events()),
            30,
            "the syncer's write_resumed event",
        )
        resumed = [e for e in lr.events() if e["kind"] == "write_resumed"]
        assert any(
            "metrics.jsonl again" in e["detail"] and "records were dropped (disk full)" in e["detail"] for e in resumed
        ), resumed
        sample = [r for r in lr.metrics("sample") if r["t"] > freed_at][-1]
        assert sample["dropped_writes"].get("metrics.jsonl", 0) > 0, sample
        lr.wait_for(
            lambda s: all(f"learner-{i}.log again" in lr.log(f"learner-{i}") for i in range(2)),
            60,
            "the learners' logs say what they dropped",
        )
        lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= steps + 16, 60, "still merging")
        assert alive(lr) == {"syncer": None, "learner-0": None, "learner-1": None}, alive(lr)
