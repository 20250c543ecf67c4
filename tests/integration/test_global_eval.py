"""The syncer scores the global model itself, and its quality guard rolls back a bad round:
a real syncer and real learners (gpt-tiny) on 127.0.0.1.

- the global model's held-out loss is in `status` and in metrics.jsonl (`global_eval` records
  and `loss_global` in the samples), and it falls as the fleet trains;
- a round damaged on purpose (the `bad_round` fault point adds noise to the global model at the
  N-th merge) is caught at the next score: a `quality_guard` event, a rollback to the last good
  state, and the global loss back near where it was, while the learners train on.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.localrun import LocalRun, write_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _scores(lr: LocalRun) -> list[dict]:
    return list(lr.metrics("global_eval"))


def test_the_syncer_scores_the_global_model_and_the_guard_rolls_a_bad_round_back(tmp_path: Path) -> None:
    config = write_config(tmp_path, [{}, {}], run={"global_eval_every": 4, "quality_guard": 0.1})
    with LocalRun(tmp_path, config) as lr:
        # the damage comes at merge 360, well after the first score (the reference it is judged
        # against): at merge 120 a loaded machine's evaluator sometimes first scored the damaged
        # state itself, which then was the best it knew, and nothing was rolled back
        lr.start_syncer(env={"DLDCTL_FAULT_POINTS": "bad_round@360=0.5"})
        for i in range(2):
            lr.start_learner(i)
        lr.wait_for(lambda s: s["loss"]["global"] is not None, 120, "a first score of the global model")
        lr.wait_log("syncer", "fault point bad_round", 150)
        status = lr.wait_for(lambda s: s["guard"]["rollbacks"] >= 1, 60, "the guard's rollback")
        before = [m["loss"] for m in _scores(lr) if m["good"]]
        assert before[-1] < before[0] - 0.2, before  # the global model learned
        flagged = [m for m in _scores(lr) if not m["good"]]
        assert flagged and flagged[0]["loss"] > 1.1 * min(before), flagged
        (event,) = [e for e in lr.events() if e["kind"] == "quality_guard"][:1]
        assert "rolled back" in event["detail"], event
        t_trip = time.time()
        lr.wait_for(lambda s: any(m["t"] > t_trip and m["good"] for m in _scores(lr)), 60, "a good score after it")
        after = next(m for m in _scores(lr) if m["t"] > t_trip and m["good"])
        assert after["loss"] <= 1.1 * min(before), (after, min(before))
        assert status["syncer"]["outer_steps"] > 0
        samples = [s for s in lr.metrics("sample") if s.get("loss_global") is not None]
        assert samples, "loss_global missing from the metrics samples"
        assert all(lr.procs[f"learner-{i}"].poll() is None for i in range(2)), "a learner died"
