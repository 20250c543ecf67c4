"""Checkpoints written off the syncer's loop: a snapshot (`checkpoint.state_dict(copy=True)`)
keeps the values of the moment it was taken while merges go on (copy on write, for parameters,
momentum and residual alike), and `CheckpointWriter` writes it on its own thread, returning a
failure (a full disk) as a result, never as an exception. A real SyncerCore, real files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from syncer import checkpoint
from syncer.ckptwriter import CheckpointWriter
from syncer.common import faultpoints
from tests.unit.coreharness import Harness, make_settings

pytestmark = [pytest.mark.timeout(60)]


def _merge_every_fragment(h: Harness, now: float, salt: int) -> float:
    for p in range(h.s.fragments):
        for i, lid in enumerate(("a", "b", "c")):
            h.push(lid, p, h.delta(p, 10 * salt + i), now=now)
        h.tick(now)
        now += 1.0
    return now


@pytest.fixture
def merged() -> tuple[Harness, float]:
    h = Harness(make_settings(quorum=3, outer_momentum=0.9))
    h.join_all()
    return h, _merge_every_fragment(h, 10.0, 0)


def test_a_snapshot_keeps_its_values_while_merges_go_on(merged: tuple[Harness, float]) -> None:
    h, now = merged
    m = h.core.model
    assert m is not None
    before = [(t.clone(), u.clone(), r.clone()) for t, u, r in zip(m.theta, m.momentum, m.residual, strict=True)]
    snap = checkpoint.state_dict(h.core, now, copy=True)
    versions = list(m.versions)
    _merge_every_fragment(h, now, 1)
    for p, (theta, momentum, residual) in enumerate(before):
        assert torch.equal(snap["theta"][p], theta) and not torch.equal(m.theta[p], theta)
        assert torch.equal(snap["momentum"][p], momentum) and not torch.equal(m.momentum[p], momentum)
        assert torch.equal(snap["residual"][p], residual)
    assert snap["versions"] == versions and m.versions != versions
    assert snap["fleet"]["merged_tokens"] != h.core.fleet.merged_tokens  # counters copied, not shared
    assert snap["outer_steps"] < h.core.outer_steps


def test_a_snapshot_costs_no_copy_until_a_fragment_is_written(merged: tuple[Harness, float]) -> None:
    h, now = merged
    m = h.core.model
    assert m is not None
    snap = checkpoint.state_dict(h.core, now, copy=True)
    assert all(a is b for a, b in zip(snap["theta"], m.theta, strict=True))
    h.push("a", 0, h.delta(0, 99), now=now)
    h.push("b", 0, h.delta(0, 98), now=now)
    h.push("c", 0, h.delta(0, 97), now=now)
    h.tick(now)
    assert snap["theta"][0] is not m.theta[0] and snap["momentum"][0] is not m.momentum[0]
    assert snap["theta"][1] is m.theta[1]  # fragment 1 was not written: still shared


def test_the_writer_writes_a_snapshot_on_its_thread(merged: tuple[Harness, float], tmp_path: Path) -> None:
    h, now = merged
    writer = CheckpointWriter(tmp_path, keep=3)
    snap = checkpoint.state_dict(h.core, now, copy=True)
    writer.start(snap)
    assert writer.busy
    _merge_every_fragment(h, now, 2)  # the loop goes on while it writes
    done = writer.wait(30)
    assert done is not None and done.error is None and done.path is not None
    assert done.size == done.path.stat().st_size > 0 and not writer.busy
    back = checkpoint.read(done.path)
    assert all(torch.equal(a, b) for a, b in zip(back["theta"], snap["theta"], strict=True))
    assert back["versions"] == snap["versions"]
    assert writer.result() is None  # a result is taken once


def test_a_failed_write_is_a_result_not_an_exception(merged: tuple[Harness, float], tmp_path: Path) -> None:
    h, now = merged
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    writer = CheckpointWriter(blocker / "checkpoints", keep=3)
    writer.start(checkpoint.state_dict(h.core, now, copy=True))
    done = writer.wait(30)
    assert done is not None and done.path is None
    assert done.error is not None and "cannot write checkpoint" in done.error and str(blocker) in done.error
    again = writer.write(checkpoint.state_dict(h.core, now, copy=True))  # and the writer stays usable
    assert again.path is None and again.error is not None


def test_a_paused_write_leaves_the_previous_checkpoint_whole(
    merged: tuple[Harness, float], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h, now = merged
    writer = CheckpointWriter(tmp_path, keep=3)
    first = writer.write(checkpoint.state_dict(h.core, now, copy=True))
    assert first.path is not None
    monkeypatch.setitem(faultpoints._ACTIVE, "checkpoint", (1, 1.0))
    writer.start(checkpoint.state_dict(h.core, now + 1, copy=True))
    assert writer.result() is None and writer.busy  # still writing: paused half way
    assert checkpoint.list_checkpoints(tmp_path) == [first.path]
    done = writer.wait(30)
    assert done is not None and done.path is not None
    assert set(checkpoint.list_checkpoints(tmp_path)) == {first.path, done.path}
