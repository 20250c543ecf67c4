"""The end of a run (`dldctl down`, docs/algorithm.md "The end of a run"): once the fleet is
ending, a stopping learner's last partial windows (pushes marked `last`) stay out of the final
model; its regular pushes, and `last` pushes while the run goes on (a learner killed or removed),
are merged as always. The learner marks only the windows it sends because a signal stopped it."""

from __future__ import annotations

import torch

from learner.sends import PushItem, Send, coalesce, push_meta
from syncer.core import Outbox
from tests.unit.coreharness import Harness, events_of, make_settings, rounds_of


def _fleet() -> Harness:
    h = Harness(make_settings(round_clock="learner", quorum=1, H=8, fragments=2, compression="none", merge="mean"))
    h.join_all()
    return h


def test_at_down_a_stopping_learners_last_windows_stay_out_of_the_model() -> None:
    h = _fleet()
    theta = [t.clone() for t in h.core.model.theta]
    h.core.fleet.ending = True  # `dldctl down` began
    events = []
    for lid in ("a", "b"):
        for p in (0, 1):
            out = h.push(lid, p, h.delta(p, 1), now=2.0, c_steps=3, c_tokens=48, last=True)
            events += events_of(out, "last_windows_kept_out")
    drained = Outbox()
    assert h.core.flush(3.0, drained) == 0 and not rounds_of(drained)
    assert all(torch.equal(a, b) for a, b in zip(theta, h.core.model.theta)), "a last window moved the model"
    assert [e["target"] for e in events] == ["a", "b"]  # one event per learner, not per fragment
    assert h.core.counters["last_tokens_kept_out"] == 4 * 48


def test_regular_pushes_at_down_and_last_windows_during_the_run_are_merged() -> None:
    h = _fleet()
    theta0 = h.core.model.theta[0].clone()
    d = h.delta(0, 1)
    h.push("a", 0, d, now=2.0, last=True)  # killed or removed mid-run: its last window counts
    h.core.fleet.ending = True
    h.push("b", 0, d, now=2.0)  # an ordinary push while the run ends
    drained = Outbox()
    h.core.flush(3.0, drained)
    (record,) = rounds_of(drained)
    assert sorted(record["contributors"]) == ["a", "b"] and not torch.equal(h.core.model.theta[0], theta0)
    assert h.core.counters["last_tokens_kept_out"] == 0


def test_the_learner_marks_its_last_window_and_a_sum_with_earlier_work_is_never_last() -> None:
    def item(last: bool, version: int = 3) -> PushItem:
        return PushItem(0, torch.ones(4), version, 2, 32, 0.1, 0.05, 1, last=last)

    assert push_meta(Send(push=item(True), seq=7))["last"] is True
    assert "last" not in push_meta(Send(push=item(False), seq=7))  # the wire of an ordinary push is unchanged
    assert coalesce(item(False), item(True)).last is False  # it carries the earlier, regular window too
    assert coalesce(item(False, version=2), item(True)).last is True  # another base: the older one is dropped
