"""The global model's scores and the quality guard: the judge's rule, the rollback on the core
(theta restored, momentum cleared, versions moved on, rounds dropped, every learner told to
refetch), the guard's history surviving a checkpoint, and the evaluator scoring a snapshot
exactly as a learner scores its own model on the same held-out batches."""

from __future__ import annotations

import math

import torch

from syncer import checkpoint, quality
from syncer.common.settings import RunSettings
from syncer.core import Outbox
from syncer.evaluator import GlobalEvaluator
from syncer.guard import QualityGuard, Snapshot
from syncer.wire import fragments
from tests.unit.coreharness import Harness, events_of, make_settings, sent_of
from workload import WorkloadContext, build_workload


def test_the_judge_flags_a_rise_above_the_recent_best_and_non_finite_scores() -> None:
    g = QualityGuard(0.1)
    assert g.judge(5.0).good and g.judge(5.0).reference is None  # nothing to compare with yet
    g.history.extend([3.0, 2.8, 2.9])
    assert g.judge(3.0).good and g.judge(2.8 * 1.1 - 1e-9).good
    bad = g.judge(3.2)
    assert not bad.good and bad.reference == 2.8 and math.isclose(bad.rise, 3.2 / 2.8 - 1)
    assert not g.judge(float("nan")).good and not g.judge(float("inf")).good
    assert QualityGuard(0.0).judge(100.0).good  # 0: off (finite scores pass)


def test_a_stale_result_is_ignored_and_good_scores_become_the_reference() -> None:
    g = QualityGuard(0.1)
    g.offer(Snapshot(1, 10, [1], [torch.zeros(2)], 0.0))
    assert g.record(2, 1.0, 1.0) is None and g.pending is not None  # not the pending one
    verdict, snap = g.record(1, 2.5, 1.0)
    assert verdict.good and g.last_good is snap and list(g.history) == [2.5] and g.last["loss"] == 2.5


def _trained(h: Harness, rounds: int, start: float) -> float:
    for i in range(rounds):
        now = start + i
        h.beat_all(now)
        for lid in ("a", "b", "c"):
            h.push(lid, 0, h.delta(0, i + 1) * 0.01, now=now, c_steps=8, c_tokens=128)
        h.tick(now)
    return start + rounds


def test_a_flagged_score_rolls_the_global_model_back_and_every_learner_refetches() -> None:
    h = Harness(make_settings(quorum=2, global_eval_every=1, quality_guard=0.1, checkpoint_every=1000))
    h.join_all()
    core = h.core
    good = quality.take_snapshot(core, 1.0)
    assert good is not None and quality.take_snapshot(core, 1.0) is None  # one at a time
    assert quality.apply_score(core, good.tag, 2.0, 1.5, Outbox()).good
    now = _trained(h, 3, 2.0)  # the model moves on
    assert not torch.equal(core.model.theta[0], good.theta[0])
    versions = list(core.model.versions)
    h.push("a", 1, h.delta(1, 9), now=now, c_steps=8, c_tokens=128)  # an open round, not merged
    bad = quality.take_snapshot(core, now)
    out = Outbox()
    verdict = quality.apply_score(core, bad.tag, 2.5, now, out)
    assert not verdict.good
    for p in range(core.model.plan.count):
        torch.testing.assert_close(core.model.theta[p], good.theta[p], rtol=0, atol=0)
        assert not core.model.momentum[p].any() and not core.model.residual[p].any()
    assert core.model.versions == [v + 1 for v in versions]
    assert not core.rounds and core.counters["rollbacks"] == 1 and core.checkpoint_due()
    ((to, resync),) = sent_of(out, "resync")
    assert sorted(to) == ["a", "b", "c"] and resync["fragment"] == -1
    (event,) = events_of(out, "quality_guard")
    assert "2.5" in event["detail"] and "+25%" in event["detail"] and "rolled back" in event["detail"]
    assert [m["good"] for m in out.metrics if m["kind"] == "global_eval"] == [False]
    assert quality.take_snapshot(core, now) is not None  # the restored state is scored at once


def test_without_a_good_state_a_flag_is_an_event_and_nothing_is_rolled_back() -> None:
    h = Harness(make_settings(quorum=2, global_eval_every=1))
    h.join_all()
    snap = quality.take_snapshot(h.core, 1.0)
    out = Outbox()
    assert not quality.apply_score(h.core, snap.tag, float("nan"), 1.0, out).good
    assert "no good state" in events_of(out, "quality_guard")[0]["detail"] and h.core.counters["rollbacks"] == 0


def test_the_guard_history_and_the_clip_norms_survive_a_checkpoint() -> None:
    h = Harness(make_settings(quorum=2, global_eval_every=1))
    h.join_all()
    _trained(h, 2, 1.0)
    h.core.guard.history.extend([2.0, 1.9])
    state = checkpoint.state_dict(h.core, 10.0)
    fresh = Harness(make_settings(quorum=2, global_eval_every=1))
    checkpoint.restore(fresh.core, state, 11.0)
    assert list(fresh.core.guard.history) == [2.0, 1.9]
    assert {p: list(d) for p, d in fresh.core._norm_history.items()} == {
        p: list(d) for p, d in h.core._norm_history.items()
    }
    assert not fresh.core.guard.judge(2.2).good  # judged against the history it had


def test_the_evaluator_scores_a_snapshot_as_a_learner_scores_the_same_weights() -> None:
    s = RunSettings(model="gpt-tiny", seq_len=32, batch_size=4, eval_batches=2, fragments=4)
    s.validate()
    settings = s.to_dict()
    wl = build_workload(WorkloadContext(settings, 0, 1, 4, torch.device("cpu"), 1))
    ev = GlobalEvaluator(settings)
    ev.start()
    try:
        params = {n: p.data for n, p in wl.model.named_parameters()}
        plan = fragments.plan([fragments.TensorSpec(n, tuple(t.shape)) for n, t in params.items()], 4)
        theta = [plan.gather(p, params) for p in range(plan.count)]
        loss = ev.score_now(Snapshot(7, 0, [0] * plan.count, theta, 0.0), timeout=120)
    finally:
        ev.stop()
    with torch.no_grad():
        wl.model.eval()
        expected = sum(float(wl.loss(wl.model, b)) for b in wl.eval_batches) / len(wl.eval_batches)
    assert ev.problem is None and loss is not None and math.isclose(loss, expected, rel_tol=1e-5)


def test_an_evaluator_that_cannot_build_the_model_says_why() -> None:
    s = RunSettings(model="no_such_module_xyz:factory")
    ev = GlobalEvaluator(s.to_dict())
    ev.start()
    ev.join(timeout=30)
    assert ev.problem is not None and "no_such_module_xyz" in ev.problem
    assert not ev.submit(Snapshot(1, 0, [], [], 0.0))


class _Scorer:
    """The evaluator's seam (submit / results / busy / problem), scoring with a given loss at once;
    the real GlobalEvaluator is tested above and in tests/integration/test_global_eval.py."""

    def __init__(self, losses: list[float]) -> None:
        self.losses, self.done, self.busy, self.problem = losses, [], False, None

    def submit(self, snap: Snapshot) -> bool:
        self.done.append((snap.tag, self.losses.pop(0), 0.0))
        return True

    def results(self) -> list:
        out, self.done = self.done, []
        return out


def test_a_checkpoint_holds_the_scored_state_and_is_written_only_when_its_score_is_good() -> None:
    from syncer.evaluator import Scoring

    h = Harness(make_settings(quorum=2, global_eval_every=1000, quality_guard=0.1))
    h.join_all()
    scoring = Scoring(_Scorer([2.0, 3.0, 2.0]))  # type: ignore[arg-type]
    assert scoring.tick(h.core, 1.0, Outbox(), checkpoint=True) is None  # taken, not yet scored
    versions = list(h.core.model.versions)
    theta = h.core.model.theta[0].clone()
    now = _trained(h, 2, 2.0)  # merges go on meanwhile
    state = scoring.tick(h.core, now, Outbox())
    assert state is not None and state["versions"] == versions  # the state that was scored
    torch.testing.assert_close(state["theta"][0], theta, rtol=0, atol=0)
    assert not torch.equal(state["theta"][0], h.core.model.theta[0])
    # a flagged score: nothing to write, the model rolled back (and due to be checkpointed again)
    assert scoring.tick(h.core, now, Outbox(), checkpoint=True) is None
    out = Outbox()
    assert scoring.tick(h.core, now + 1, out) is None and h.core.counters["rollbacks"] == 1
    assert events_of(out, "quality_guard") and h.core.checkpoint_due()


def test_a_checkpoint_waits_for_its_score_only_so_long() -> None:
    from syncer.evaluator import Scoring

    class Stuck(_Scorer):
        def submit(self, snap: Snapshot) -> bool:
            self.busy = True
            return True

    h = Harness(make_settings(quorum=2))
    h.join_all()
    scoring = Scoring(Stuck([]))  # type: ignore[arg-type]
    scoring.tick(h.core, 1.0, Outbox(), checkpoint=True)
    assert not scoring.overdue(30.0) and scoring.overdue(62.0) and not scoring.overdue(63.0)


def test_a_state_scored_good_is_not_held_again_in_the_tick_that_hands_it_over() -> None:
    """The checkpoint is still due in the tick its good state comes back (it is written after):
    holding a second state then, with nothing merged in between, wrote one outer step twice."""
    from syncer.evaluator import Scoring

    h = Harness(make_settings(quorum=2, global_eval_every=1000, quality_guard=0.1))
    h.join_all()
    scorer = _Scorer([2.0, 2.0])
    scoring = Scoring(scorer)  # type: ignore[arg-type]
    assert scoring.tick(h.core, 1.0, Outbox(), checkpoint=True) is None
    state = scoring.tick(h.core, 2.0, Outbox(), checkpoint=True)  # still due: not written yet
    assert state is not None
    assert scoring.tick(h.core, 3.0, Outbox()) is None, "a second state of the same outer step"
    assert scorer.losses == [2.0], "a snapshot was scored for a second hold"
