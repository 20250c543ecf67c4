"""The learner link's shell (learner/client.py, driven through the trainer's facade,
learner/syncerlink.py): its thread, socket, waits and exit, against a scripted syncer at the
socket seam (tests/scriptedsyncer.py, a bare ROUTER on 127.0.0.1).

- It joins: hello, welcome, the chunked state fetch, `ready`.
- The trainer's waits are woken by the message that answers them, not by polling: a max_lag
  wait ends when the reply lands (never on a syncer cut off, never past liveness_s, once per
  push), and a synchronous round ends when its update lands.
- At exit it waits for the receipt of its goodbye: the socket closes with LINGER 0, which drops
  what libzmq has not written yet, so without the wait a learner stopped behind a large push
  could leave without a goodbye (and without that push). A syncer that never confirms costs at
  most the wait. (The real syncer's echo is covered by the SIGTERM test in test_learners.py.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dldctl.testing import wait_until
from learner.config import LearnerConfig
from learner.outer import OuterState
from learner.sends import PushItem
from learner.syncerlink import SyncerLink
from learner.trainer import Trainer
from syncer.common.resolved import LearnerEntry
from syncer.common.settings import RunSettings
from syncer.wire import codec, fragments
from syncer.wire.protocol import Message
from tests.scriptedsyncer import EPOCH, ScriptedSyncer

pytestmark = pytest.mark.timeout(60)
N = 64


@contextmanager
def linked(
    tmp_path: Path, sizes: list[int], echo: bool = True, **run: object
) -> Iterator[tuple[SyncerLink, ScriptedSyncer]]:
    """A real link thread joined to a scripted syncer; stopped (and the syncer closed) at the end."""
    settings = RunSettings(liveness_s=1.0, **{"round_clock": "learner", "compression": "none", **run})
    with ScriptedSyncer(sizes, echo_bye=echo) as syncer:
        cfg = LearnerConfig("run", settings, LearnerEntry("learner-1"), syncer.address, None, None, tmp_path)
        client = SyncerLink(cfg, [], sizes, lambda: [torch.zeros(s) for s in sizes], "inc")
        client.start()
        try:
            assert client.wait_ready(20.0), "the link did not join the scripted syncer"
            assert client.take_updates() == (set(range(len(sizes))), set()), "the fetched state counts as a reply"
            yield client, syncer
        finally:
            client.stop(flush_s=0.0)


def _reply_after(syncer: ScriptedSyncer, seconds: float, contributors: list[str]) -> threading.Timer:
    meta = {"fragment": 0, "version": 1, "from_version": 0, "epoch": EPOCH, "contributors": contributors}
    msg = Message("update", meta, [codec.encode(torch.ones(N), "none")])
    timer = threading.Timer(seconds, syncer.send, [msg])
    timer.start()
    return timer


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


def _timed(call: object, *args: object) -> float:
    assert callable(call)
    t0 = time.monotonic()
    call(*args)
    return time.monotonic() - t0


def test_the_link_joins_and_fetches_the_state_in_chunks(tmp_path: Path) -> None:
    with linked(tmp_path, [(1 << 20) + 5, 3]) as (client, syncer):
        assert client.versions() == [0, 0] and torch.equal(client.latest(0)[1], torch.zeros((1 << 20) + 5))
        assert syncer.kinds[0] == "hello" and syncer.kinds.count("state_req") == 3
        assert client.linked() and client.take_updates() == (set(), set())


def test_a_late_reply_is_waited_for_once_and_wakes_the_wait(tmp_path: Path) -> None:
    with linked(tmp_path, [N], max_lag=2) as (client, syncer):
        trainer = Trainer(client.cfg, "inc")
        assert _timed(trainer._bound_lag, client, _pushed(1)) < 0.05, "1 step late: no wait yet"
        outer = _pushed(2)
        timer = _reply_after(syncer, 0.3, ["learner-1"])
        took = _timed(trainer._bound_lag, client, outer)
        timer.join()
        assert 0.25 <= took < 0.6, f"waited {took:.2f} s for a reply sent after 0.3 s"
        assert client.has_reply(0), "the reply is left for _collect to apply"
        assert trainer.waited == {0}
        client.take_updates()
        assert _timed(trainer._bound_lag, client, outer) < 0.05, "a push is waited for once"


def test_no_wait_when_off_or_the_syncer_is_cut_off_and_at_most_liveness(tmp_path: Path) -> None:
    with linked(tmp_path, [N], max_lag=0) as (client, _):
        assert _timed(Trainer(client.cfg, "inc")._bound_lag, client, _pushed(50)) < 0.05, "max_lag = 0"
    with linked(tmp_path, [N], max_lag=2) as (client, syncer):
        took = _timed(Trainer(client.cfg, "inc")._bound_lag, client, _pushed(50))
        assert 0.9 <= took < 1.5, f"waited {took:.2f} s for a reply that never came, liveness_s = 1"
        timer = _reply_after(syncer, 0.1, ["learner-2"])  # a round without our push: no reply
        client.set_partitioned(True)
        wait_until(lambda: not client.linked(), 5.0, "the partition to cut the link", every=0.01)
        assert _timed(Trainer(client.cfg, "inc")._bound_lag, client, _pushed(50)) < 0.05, "cut off: no wait"
        timer.join()


def test_a_synchronous_round_ends_when_its_update_lands(tmp_path: Path) -> None:
    with linked(tmp_path, [N], overlap=False) as (client, syncer):
        timer = _reply_after(syncer, 0.2, ["learner-2"])
        took = _timed(Trainer(client.cfg, "inc")._wait_for_merge, client, 0, 0)
        timer.join()
        assert 0.15 <= took < 0.5, f"the round's update came after 0.2 s, the wait took {took:.2f} s"
        assert client.versions() == [1]


def _stop_behind_a_large_push(tmp_path: Path, echo: bool) -> tuple[SyncerLink, list[str], float]:
    with linked(tmp_path, [N], echo=echo) as (client, syncer):
        client.push(PushItem(0, torch.zeros(16 << 20), 0, 8, 2048, 0.1, 0.01, EPOCH))  # 64 MB in flight
        wait_until(lambda: client.pending() == 0, 20.0, "the push to be handed to the socket", every=0.01)
        took = _timed(client.stop, 3.0)
        assert not client.is_alive()
        time.sleep(0.2)  # what arrived has been recorded
        return client, list(syncer.kinds), took


def test_the_goodbye_leaves_behind_a_large_push_and_is_confirmed(tmp_path: Path) -> None:
    client, kinds, _ = _stop_behind_a_large_push(tmp_path, echo=True)
    assert kinds[-2:] == ["push", "bye"], kinds
    assert client.goodbye_confirmed


def test_a_syncer_that_never_confirms_costs_at_most_the_wait(tmp_path: Path) -> None:
    client, kinds, took = _stop_behind_a_large_push(tmp_path, echo=False)
    assert not client.goodbye_confirmed and kinds[-1] == "bye"
    assert took < 4.0, f"the exit waited {took:.1f} s for a receipt that never came"
