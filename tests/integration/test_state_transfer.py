"""A learner's state transfer from a real syncer process, in many chunks, while another learner's
pushes keep closing rounds: the real `learner.client.SyncerClient` ends up bit-identical to the
syncer (chunks pinned to one version, served without copies from values a merge never writes,
crc-checked, updates applied on top), and the syncer kept merging while it served."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest
import torch

from learner.client import SyncerClient
from learner.config import load
from syncer.wire import fragments
from tests.integration.test_syncer_server import start
from tests.protoclient import ProtoClient, initial_values

pytestmark = pytest.mark.timeout(120)

# 4 fragments of about 16k values each: with 1,048-value chunks, 16 chunks per fragment
BIG = [
    fragments.TensorSpec("wte", (256, 64), "embedding"),
    fragments.TensorSpec("a", (128, 128)),
    fragments.TensorSpec("b", (64, 256)),
    fragments.TensorSpec("c", (96, 160)),
]


def test_a_learner_joining_under_concurrent_pushes_gets_a_bit_identical_replica(tmp_path: Path) -> None:
    """Twice during the transfer (at the 2nd and the 30th chunk received) the learner's link
    waits while a round of every fragment closes: the chunks after it come from the versions the
    transfer is pinned to (kept and lent by the syncer; some were served before the merge and
    were still queued), the updates are replayed on top, and more rounds close all along."""
    with start(tmp_path, 2, quorum=1, state_chunk_mb=0.004, checksum_every=1) as lr:
        address = f"tcp://127.0.0.1:{lr.cfg.syncer.port}"
        pusher = ProtoClient(address, "learner-0", lr.cfg.run_id, lr.dir / "keys", manifest=BIG)
        plan = pusher.plan
        assert pusher.hello()["init_owner"]
        pusher.upload_init(initial_values(plan))
        pusher.recv("ack")
        cfg = load(lr.config, "learner-1", workdir=tmp_path / "joiner")
        client = SyncerClient(cfg, fragments.manifest_to_json(BIG), plan.sizes(), list, "joiner-1")
        hits, mid, go = itertools.count(1), threading.Event(), threading.Event()

        def fault(name: str) -> None:  # the link's fault point, once per state chunk received
            if name == "fetch" and next(hits) in (2, 30):
                mid.set()
                assert go.wait(20), "the test thread did not merge"
                go.clear()

        client._core.fault = fault
        g = torch.Generator().manual_seed(1)

        def push_all() -> None:
            for p in range(plan.count):
                pusher.push(p, torch.randn(plan.numel(p), generator=g) * 1e-3, 8, 128, step_time=0.001)
            pusher.heartbeat()

        try:
            client.start()
            merged_mid = 0
            deadline = time.monotonic() + 60
            while not client.ready.wait(0.01):
                assert time.monotonic() < deadline, "the state transfer did not complete"
                if mid.is_set():
                    mid.clear()
                    before = lr.status()["syncer"]["versions"]
                    push_all()
                    lr.wait_for(lambda s, b=before: all(v > w for v, w in zip(s["syncer"]["versions"], b)), 20, "merge")
                    merged_mid += 1
                    go.set()
            assert merged_mid == 2
            before = lr.status()["syncer"]["versions"]
            push_all()  # and one more round after it is ready
            # every fragment's round merged, not just "no round open": a status written before the
            # last push arrived also has no open round
            versions = lr.wait_for(
                lambda s, b=before: (
                    all(v > w for v, w in zip(s["syncer"]["versions"], b)) and s["quorum"]["open_rounds"] == 0
                ),
                20,
                "every round closed",
            )["syncer"]["versions"]
            assert min(versions) >= 3
            deadline = time.monotonic() + 20
            while client.versions() != versions:  # the updates of the last rounds reach the replica
                assert time.monotonic() < deadline, f"replica at {client.versions()}, syncer at {versions}"
                time.sleep(0.05)
            served, values = pusher.fetch_chunked()
            assert served == versions
            for p in range(plan.count):
                version, replica = client.latest(p)
                assert version == versions[p]
                torch.testing.assert_close(replica, values[p], rtol=0, atol=0)
            assert client.counters()["bad_messages"] == 0 and client._core.replica.mismatches == 0
            assert not any(lr.status()["syncer"]["rejected"].values())
        finally:
            client.stop(flush_s=0.0)
            pusher.close()
