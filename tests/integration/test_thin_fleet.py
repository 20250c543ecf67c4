"""The thin-link codecs (2bit, topk; docs/tuning.md "Thin links") in real processes.

- a fleet whose updates are topk, one of its learners pushing 2bit (a host's own codec): it
  trains, survives a learner SIGKILL and a syncer SIGKILL, and at the end every learner's
  replica is the syncer's model bit for bit;
- a live syncer in topk: malformed compressed pushes (an index outside its chunk, indices out of
  order, a truncated payload) are dropped and counted, the model untouched, merges go on.
"""

from __future__ import annotations

import signal
import struct
import time
from pathlib import Path

import pytest
import torch

from syncer.wire import codec, thin
from tests.integration.test_learners import assert_replicas_identical, eval_losses, run_of
from tests.integration.test_syncer_server import beat, clients, close_all, start

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _contributing_after(lr, learner: str, t: float) -> bool:  # type: ignore[no-untyped-def]
    return any(r["t"] > t and learner in r["contributors"] for r in lr.metrics("round"))


def test_a_topk_fleet_trains_survives_kills_and_keeps_replicas_identical(tmp_path: Path) -> None:
    learners = [{}, {"compression": "2bit"}, {}]
    with run_of(tmp_path, learners, H=8, eval_every=20, compression="topk", checkpoint_every=5) as lr:
        lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= 12 and s["loss"]["eval"] is not None, 150, "merges")
        lr.kill("learner-1", signal.SIGKILL)
        killed = time.time()
        lr.start_learner(1)
        lr.wait_for(lambda s: _contributing_after(lr, "learner-1", killed), 120, "learner-1 (2bit) back in rounds")
        lr.expect_dead = {"syncer"}
        lr.kill("syncer", signal.SIGKILL)
        time.sleep(1.0)
        lr.start_syncer()
        lr.expect_dead = set()
        snap = lr.wait_for(lambda s: s["syncer"]["epoch"] == 2, 30, "restarted syncer")
        resumed = snap["syncer"]["outer_steps"]
        lr.wait_for(
            lambda s: s["syncer"]["outer_steps"] >= resumed + 12 and s["quorum"]["live"] == 3, 150, "merging again"
        )
        lr.wait_for(
            lambda s: len(eval_losses(lr)) >= 4 and eval_losses(lr)[-1] < eval_losses(lr)[0] - 0.3, 150, "loss falls"
        )
        rounds = lr.metrics("round")
        assert {c for r in rounds for c in r["contributors"]} == {"learner-0", "learner-1", "learner-2"}
        export = tmp_path / "final_model.pt"
        lr.control("shutdown", export="final_model.pt")
        lr.procs["syncer"].wait(timeout=30)
        time.sleep(0.5)
        for i in range(3):
            lr.kill(f"learner-{i}", signal.SIGTERM)
        assert_replicas_identical(tmp_path, export, 3)


def _broken(blob: bytes, numel: int, how: str) -> bytes:
    """A stored (zstd off) topk blob broken `how`."""
    chunk, _ = thin.topk_shape(thin.topk_block(64))
    at = codec.HEADER_SIZE + 4 * -(-numel // chunk)  # the first index
    raw = bytearray(blob)
    if how == "outside":
        raw[at : at + 2] = struct.pack("<h", chunk)
    elif how == "twice":
        raw[at + 2 : at + 4] = raw[at : at + 2]
    else:
        return bytes(raw[:-3])
    return bytes(raw)


def test_malformed_topk_pushes_are_dropped_and_counted_and_merges_go_on(tmp_path: Path) -> None:
    with start(tmp_path, 2, quorum=2, compression="topk") as lr:
        a, b = cs = clients(lr, 2)
        try:
            before = b.fetch()
            n = a.plan.numel(0)
            block = thin.topk_block(64)
            good = codec.encode(torch.randn(n) * 1e-2, "topk", block, zstd=False)
            for how in ("outside", "twice", "truncated"):
                a.push(0, torch.zeros(0), 8, 64, blob=_broken(good, n, how))
            time.sleep(1.0)
            assert [torch.equal(x, y) for x, y in zip(b.fetch(), before)] == [True] * len(before)
            assert lr.status()["syncer"]["rejected"].get("codec", 0) >= 3
            beat(cs, 0.3)
            a.push(1, torch.randn(a.plan.numel(1)) * 1e-2, 8, 64, compression="topk", block=block)
            b.push(1, torch.randn(a.plan.numel(1)) * 1e-2, 8, 64, compression="2bit")
            update = a.recv("update", timeout=10)
            assert update["fragment"] == 1 and codec.blob_info(update.blob())[0] == "topk"
            assert lr.procs["syncer"].poll() is None
        finally:
            close_all(cs)
