"""Which global updates a learner applies: the replies to its own pushes, not every round.

An update of a round that did not merge this learner's push (quorum K < M, or another learner's
round closing first) stays in the replica but is no reply: applying it would take the pushed
work, still in flight, out of the model for a whole H. The client object is driven directly
(no socket, no thread); the update blobs are real codec blobs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from learner.client import SyncerClient
from learner.config import LearnerConfig, LearnerSpec
from syncer.common.settings import RunSettings
from syncer.wire import codec
from syncer.wire.protocol import Message

N = 256


def _client(tmp_path: Path) -> SyncerClient:
    cfg = LearnerConfig("run", RunSettings(), LearnerSpec("learner-1"), "tcp://127.0.0.1:1", None, None, tmp_path)
    client = SyncerClient(cfg, [], [N, N], list, "inc")
    client.replica.epoch = 3
    for p in range(2):
        client.replica.latest[p], client.replica.versions[p] = torch.zeros(N), 0
    return client


def _update(p: int, version: int, contributors: list[str]) -> Message:
    change = codec.encode(torch.full((N,), 0.5 * version), "int8")
    meta = {"fragment": p, "version": version, "from_version": version - 1, "epoch": 3, "contributors": contributors}
    return Message("update", meta, [change])


def test_only_a_round_that_merged_our_push_is_a_reply(tmp_path: Path) -> None:
    client = _client(tmp_path)
    client._on_update(_update(0, 1, ["learner-2", "learner-3"]))
    assert client.take_updates() == (set(), set())
    assert client.versions()[0] == 1, "the replica still follows every version"
    client._on_update(_update(0, 2, ["learner-2", "learner-1"]))
    client._on_update(_update(1, 1, ["learner-1"]))
    assert client.take_updates() == ({0, 1}, set())
    assert client.take_updates() == (set(), set()), "taken once"


def test_a_resync_is_applied_whoever_merged(tmp_path: Path) -> None:
    client = _client(tmp_path)
    client._on_resync(Message("resync", {"fragment": 1, "reason": "test"}))
    assert client.take_updates() == (set(), {1})
