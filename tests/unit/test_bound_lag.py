"""max_lag (bounded staleness): a learner waits for a reply that is max_lag steps late, but never
on a syncer it cannot reach and never longer than liveness_s, and only once per push.

A real Trainer and a real SyncerClient object (no socket, no thread): the reply arrives through
the client's own update handler, from another thread, as the link thread would deliver it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from learner.client import SyncerClient
from learner.config import LearnerConfig, LearnerSpec
from learner.outer import OuterState
from learner.trainer import Trainer
from syncer.common.settings import RunSettings
from syncer.wire import codec, fragments
from syncer.wire.protocol import Message

N = 64


def _setup(tmp_path: Path, **run: object) -> tuple[Trainer, SyncerClient]:
    settings = RunSettings(liveness_s=1.0, **{"round_clock": "learner", **run})
    cfg = LearnerConfig("run", settings, LearnerSpec("learner-1"), "tcp://127.0.0.1:1", None, None, tmp_path)
    client = SyncerClient(cfg, [], [N], list, "inc")
    client.replica.epoch = 1
    client.replica.latest[0], client.replica.versions[0] = torch.zeros(N), 0
    client._welcomed = True
    return Trainer(cfg, "inc"), client


def _pushed(steps_since: int) -> OuterState:
    """A real outer state with fragment 0 pushed `steps_since` steps ago and not answered yet."""
    plan = fragments.plan([fragments.TensorSpec("w", (N,))], 1)
    params = {"w": torch.zeros(N)}
    outer = OuterState.start(plan, 8, 0.0, [(0, torch.zeros(N))], params)
    outer.count_step(8, 0.01)
    outer.take_outer_gradient(0, params)
    for _ in range(steps_since):
        outer.count_step(8, 0.01)
    return outer


def _reply_after(client: SyncerClient, seconds: float) -> threading.Timer:
    meta = {"fragment": 0, "version": 1, "from_version": 0, "epoch": 1, "contributors": ["learner-1"]}
    timer = threading.Timer(seconds, client._on_update, [Message("update", meta, [codec.encode(torch.ones(N))])])
    timer.start()
    return timer


def _timed(trainer: Trainer, client: SyncerClient, outer: OuterState) -> float:
    t0 = time.monotonic()
    trainer._bound_lag(client, outer)
    return time.monotonic() - t0


def test_a_late_reply_is_waited_for_once(tmp_path: Path) -> None:
    trainer, client = _setup(tmp_path, max_lag=2)
    assert _timed(trainer, client, _pushed(1)) < 0.05, "1 step late: no wait yet"
    outer = _pushed(2)
    timer = _reply_after(client, 0.3)
    took = _timed(trainer, client, outer)
    timer.join()
    assert 0.25 <= took < 0.9, f"waited {took:.2f} s for a reply sent after 0.3 s"
    assert client.has_reply(0), "the reply is left for _collect to apply"
    assert trainer.waited == {0}
    client.take_updates()
    assert _timed(trainer, client, outer) < 0.05, "a push is waited for once"


def test_no_wait_when_off_or_the_syncer_is_unreachable(tmp_path: Path) -> None:
    trainer, client = _setup(tmp_path, max_lag=0)
    assert _timed(trainer, client, _pushed(50)) < 0.05, "max_lag = 0: never waits"
    trainer, client = _setup(tmp_path, max_lag=2)
    client.set_partitioned(True)
    assert _timed(trainer, client, _pushed(50)) < 0.05, "cut off from the syncer: no wait"


def test_a_reply_that_never_comes_costs_at_most_liveness(tmp_path: Path) -> None:
    trainer, client = _setup(tmp_path, max_lag=2)
    took = _timed(trainer, client, _pushed(50))
    assert 0.9 <= took < 2.0, f"waited {took:.2f} s with liveness_s = 1"


def test_a_rejoiner_follows_the_fleets_fragment_order_when_learners_wait(tmp_path: Path) -> None:
    # H = 8, P = 4, fragments 0 and 1 merged once more than 2 and 3: fragment 2 merges next
    plan = fragments.plan([fragments.TensorSpec(f"t{i}", (3,)) for i in range(4)], 4)
    outer = OuterState(plan, 8, 0.0, base_version=[5, 5, 4, 4])
    cases = {(True, 2): 4, (False, 0): 4, (True, 0): 0}  # (overlap, max_lag) -> phase
    for (overlap, max_lag), phase in cases.items():
        trainer, _ = _setup(tmp_path, overlap=overlap, max_lag=max_lag)
        assert trainer.schedule_phase(outer) == phase, (overlap, max_lag)
    # with max_lag, the rejoiner's first push (after H/P = 2 steps) is fragment 2, the open round
    trainer, _ = _setup(tmp_path, max_lag=2)
    phase = trainer.schedule_phase(outer)
    assert next((step, outer.due(step + phase)) for step in range(1, 9) if outer.due(step + phase)) == (2, [2])
