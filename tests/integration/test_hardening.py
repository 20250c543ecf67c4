"""Hostile input and crashes at the worst moment, against real processes.

- a fuzz run against a live syncer: raw TCP garbage, unauthenticated and authenticated-but-
  malformed messages (hypothesis), an oversized message, wrong shapes, replayed pushes and
  versions from the future: the syncer lives, its model is untouched, every rejection counted;
- SIGKILL mid checkpoint write, mid merge and while serving state (syncer), mid state fetch and
  mid push (learner), each at a named fault point: nothing corrupt, the run carries on;
- an unwritable checkpoint directory: an event, training goes on, it recovers when fixed;
- bounded memory when pushes pile up, no fd or process leak across many learner restarts.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from syncer import checkpoint
from syncer.wire.protocol import Message, encode
from tests.integration.test_syncer_server import beat, clients, close_all, start
from tests.localrun import LocalRun, write_config
from tests.protoclient import ProtoClient

pytestmark = [pytest.mark.timeout(240)]


def test_fuzz_a_live_syncer(tmp_path: Path) -> None:
    with start(tmp_path, 3, quorum=2, max_message_mb=2.0, state_chunk_mb=0.5) as lr:
        a, b, c = cs = clients(lr, 3)
        try:
            before = b.fetch()
            port = lr.cfg.syncer.port
            for size in (0, 1, 64, 4096):  # raw TCP garbage, no ZMTP at all
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(os.urandom(size))
            fuzz(c)
            n = a.plan.numel(0)
            c.push(0, torch.zeros(n + 1), 1, 1)  # wrong shape
            c.push(0, torch.ones(n), 1, 1, base_version=99)  # a version from the future
            c.push(1, torch.full((a.plan.numel(1),), 1e-3), 1, 1)  # valid (alone it cannot close a round)
            c.seq -= 1
            c.push(1, torch.full((a.plan.numel(1),), 1e-3), 1, 1)  # the same sequence number again: a replay
            big = ProtoClient(f"tcp://127.0.0.1:{port}", "learner-2", lr.cfg.run_id, lr.dir / "keys")
            big.send_raw([encode(Message("heartbeat", {"step": 1, "tokens": 1, "state": "running"}))[0]])
            dropped = lr.status()["syncer"]["disconnects"]
            big.send_raw([os.urandom(3 << 20)])  # over max_message_mb: libzmq drops the connection
            lr.wait_for(
                lambda s: s["syncer"]["disconnects"] > dropped, 20, "the oversized message's connection dropped"
            )
            big.close()
            time.sleep(1.0)
            assert [torch.equal(x, y) for x, y in zip(b.fetch(), before)] == [True] * len(before), (
                "garbage moved the model"
            )
            snap = lr.status()
            rejected = snap["syncer"]["rejected"]
            for reason in ("codec", "future_version", "replay", "handshake_failed"):
                assert rejected.get(reason, 0) >= 1, (reason, rejected)
            assert sum(rejected.values()) >= 100
            beat(cs, 0.3)
            a.push(2, torch.full((a.plan.numel(2),), 0.01), 8, 64)
            b.push(2, torch.full((a.plan.numel(2),), 0.01), 8, 64)
            assert a.recv("update", timeout=10)["fragment"] == 2, "merges stopped after the fuzzing"
            assert lr.procs["syncer"].poll() is None
        finally:
            close_all(cs)


def fuzz(client: ProtoClient) -> None:
    """Hypothesis-generated frame lists, sent by an authenticated learner."""
    valid = encode(Message("heartbeat", {"step": 1, "tokens": 1, "state": "running"}))

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(
        st.one_of(
            st.lists(st.binary(max_size=200), min_size=1, max_size=4),
            st.binary(max_size=len(valid[0])).map(lambda junk: [valid[0][: len(junk)] + junk]),
            st.integers(0, len(valid[0]) - 1).map(
                lambda i: [valid[0][:i] + bytes([valid[0][i] ^ 0xFF]) + valid[0][i + 1 :]]
            ),
        )
    )
    def send(frames: list[bytes]) -> None:
        client.send_raw(frames)

    send()


def test_unwritable_checkpoints_are_an_event_and_training_goes_on(tmp_path: Path) -> None:
    config = write_config(tmp_path, [{}, {}], run={"H": 8, "checkpoint_every": 3})
    (tmp_path / "checkpoints").write_text("not a directory")  # every checkpoint write fails
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        lr.start_learner(0)
        lr.start_learner(1)
        lr.wait_for(lambda s: any(e["kind"] == "checkpoint_failed" for e in lr.events()), 120, "a failed checkpoint")
        steps = lr.status()["syncer"]["outer_steps"]
        lr.wait_for(lambda s: s["syncer"]["outer_steps"] > steps + 5, 60, "merging despite the failure")
        (tmp_path / "checkpoints").unlink()
        lr.wait_for(lambda s: s["syncer"]["checkpoint_outer_step"] > 0, 60, "checkpoints once writable again")


def test_disk_full_while_checkpointing_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC mid write (simulated at the write seam; the real seam is exercised above)."""
    from tests.unit.coreharness import Harness, make_settings

    h = Harness(make_settings())
    h.join_all()
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fh) -> None:
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

    # the one atomic write (syncer/common/atomic.py) opens its temp file with os.open + os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, m="r", *a, **k: Full(real_fdopen(fd, m, *a, **k)))
    with pytest.raises(checkpoint.CheckpointError, match="No space left"):
        checkpoint.save(tmp_path, checkpoint.state_dict(h.core, 1.0))
    monkeypatch.undo()
    assert not list(tmp_path.glob(".*.tmp")), "the partial file must be removed"


@pytest.mark.parametrize("point", ["checkpoint", "merge", "serve_state"])
def test_syncer_sigkill_at_the_worst_moment(tmp_path: Path, point: str) -> None:
    config = write_config(tmp_path, [{}, {}], run={"H": 8, "checkpoint_every": 4})
    with LocalRun(tmp_path, config) as lr:
        lr.expect_dead = {"syncer"}
        if point == "serve_state":
            lr.start_syncer()
            lr.start_learner(0)
            lr.wait_for(
                lambda s: s["syncer"]["outer_steps"] >= 4 and s["syncer"]["checkpoint_outer_step"] > 0, 120, "merges"
            )
            lr.kill("syncer", signal.SIGKILL)
            lr.start_syncer(env={"DLDCTL_FAULT_POINTS": "serve_state=30"})
            lr.start_learner(1)  # joins: the syncer pauses while serving it
        else:
            # the 3rd checkpoint write (two are whole: one write at a time), or the 61st merge (the
            # checkpoints are written off the loop, the first ones long done by then)
            lr.start_syncer(env={"DLDCTL_FAULT_POINTS": "checkpoint@3=30" if point == "checkpoint" else "merge@61=30"})
            lr.start_learner(0)
            lr.start_learner(1)
        lr.wait_log("syncer", f"fault point {point}", 150)
        lr.kill("syncer", signal.SIGKILL)
        good = [checkpoint.read(p) for p in checkpoint.list_checkpoints(tmp_path / "checkpoints")]
        assert good and all(s["run_id"] == "testrun" for s in good), "the checkpoints on disk must be valid"
        newest = max(s["outer_steps"] for s in good)
        assert newest > 0
        if point == "checkpoint":
            assert list((tmp_path / "checkpoints").glob(".*.tmp")), "the write was cut off half way"
        lr.start_syncer()
        lr.expect_dead = set()
        snap = lr.wait_for(lambda s: s["syncer"]["initialized"], 60, "restarted syncer")
        resumed = [e for e in lr.events() if e["kind"] == "syncer_resume"]
        assert resumed and resumed[-1]["detail"].startswith(f"from outer step {newest},"), resumed
        steps = snap["syncer"]["outer_steps"]
        assert steps >= newest
        lr.wait_for(lambda s: s["syncer"]["outer_steps"] > steps + 4 and s["quorum"]["live"] == 2, 120, "merging again")


@pytest.mark.parametrize("point", ["fetch", "push"])
def test_learner_sigkill_at_the_worst_moment(tmp_path: Path, point: str) -> None:
    config = write_config(tmp_path, [{}, {}], run={"H": 8})
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        lr.start_learner(0)
        lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= 3, 120, "merges")
        lr.start_learner(1, env={"DLDCTL_FAULT_POINTS": f"{point}=30"})
        lr.wait_log("learner-1", f"fault point {point}", 120)
        lr.kill("learner-1", signal.SIGKILL)
        lr.start_learner(1)
        lr.wait_for(
            lambda s: (
                s["quorum"]["live"] == 2
                and all(r["replica"]["identical"] == r["replica"]["current"] for r in s["learners"])
            ),
            90,
            "learner-1 back, replicas exact",
        )
        assert lr.procs["syncer"].poll() is None


def test_memory_stays_bounded_when_pushes_pile_up(tmp_path: Path) -> None:
    with start(tmp_path, 3, quorum=3, max_queue=4) as lr:
        a, b, _c = cs = clients(lr, 3)
        try:
            beat([a, b], 0.3)  # c never reports running: 2 live < quorum 3, no round ever closes
            pid = lr.procs["syncer"].pid
            for i in range(200):
                a.push(i % 4, torch.randn(a.plan.numel(i % 4)), 8, 64)
                b.push(i % 4, torch.randn(a.plan.numel(i % 4)), 8, 64)
            beat([a, b], 0.5)
            snap = lr.status()
            assert snap["syncer"]["dropped_pushes"] >= 4, "8 open contributions must be cut to max_queue=4"
            assert snap["quorum"]["open_rounds"] <= 4
            assert any(e["kind"] == "drop" for e in lr.events())
            rss = rss_kb(pid)
            for i in range(400):
                a.push(i % 4, torch.randn(a.plan.numel(i % 4)), 8, 64)
            beat([a, b], 0.5)
            assert rss_kb(pid) < rss + 30_000, "the syncer's memory grew with the queue"
        finally:
            close_all(cs)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_no_fd_or_process_leak_across_many_learner_restarts(tmp_path: Path) -> None:
    config = write_config(tmp_path, [{}, {}], run={"H": 8})
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        lr.start_learner(0)
        lr.wait_for(lambda s: s["syncer"]["initialized"], 60, "syncer initialized")
        pid = lr.procs["syncer"].pid
        fds = []
        for _i in range(12):
            lr.start_learner(1)
            lr.wait_for(
                lambda s: any(r["id"] == "learner-1" and r["state"] == "running" for r in s["learners"]), 60, "join"
            )
            lr.kill("learner-1", signal.SIGKILL)
            fds.append(len(os.listdir(f"/proc/{pid}/fd")))
        assert fds[-1] <= fds[2] + 4, f"syncer fds grew across restarts: {fds}"
        children = [p for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == pid]
        assert children == [], "the syncer started processes"
        assert lr.procs["syncer"].poll() is None


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1
