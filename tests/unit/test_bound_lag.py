"""Where a (re)joining learner's push schedule starts when learners wait on merges (max_lag or
overlap = false): it follows the fleet's fragment order. The waits themselves (max_lag, the
synchronous round) run against a real link thread in tests/integration/test_link_shell.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.config import LearnerConfig
from learner.outer import OuterState
from learner.trainer import Trainer
from syncer.common.resolved import LearnerEntry
from syncer.common.settings import RunSettings
from syncer.wire import fragments


def _trainer(tmp_path: Path, **run: object) -> Trainer:
    settings = RunSettings(liveness_s=1.0, **{"round_clock": "learner", **run})
    cfg = LearnerConfig("run", settings, LearnerEntry("learner-1"), "tcp://127.0.0.1:1", None, None, tmp_path)
    return Trainer(cfg, "inc")


def test_a_rejoiner_follows_the_fleets_fragment_order_when_learners_wait(tmp_path: Path) -> None:
    # H = 8, P = 4, fragments 0 and 1 merged once more than 2 and 3: fragment 2 merges next
    plan = fragments.plan([fragments.TensorSpec(f"t{i}", (3,)) for i in range(4)], 4)
    outer = OuterState(plan, 8, 0.0, base_version=[5, 5, 4, 4])
    cases = {(True, 2): 4, (False, 0): 4, (True, 0): 0}  # (overlap, max_lag) -> phase
    for (overlap, max_lag), phase in cases.items():
        trainer = _trainer(tmp_path, overlap=overlap, max_lag=max_lag)
        assert trainer.schedule_phase(outer) == phase, (overlap, max_lag)
    # with max_lag, the rejoiner's first push (after H/P = 2 steps) is fragment 2, the open round
    trainer = _trainer(tmp_path, max_lag=2)
    phase = trainer.schedule_phase(outer)
    assert next((step, outer.due(step + phase)) for step in range(1, 9) if outer.due(step + phase)) == (2, [2])


@pytest.mark.parametrize("resumed_at", [0, 1, 7, 119, 1000])
@pytest.mark.parametrize("overlap", [False, True], ids=["lock-step", "max_lag"])
def test_a_restarted_learner_that_continues_its_step_counter_still_pushes_the_open_round(
    tmp_path: Path, resumed_at: int, overlap: bool
) -> None:
    """A restarted learner resumes its own step counter (its lr schedule): its first push must
    still be the fragment the fleet merges next, or a lock-step fleet waits on it forever."""
    plan = fragments.plan([fragments.TensorSpec(f"t{i}", (3,)) for i in range(4)], 4)
    outer = OuterState(plan, 8, 0.0, base_version=[5, 5, 4, 4])  # fragment 2 merges next
    trainer = _trainer(tmp_path, overlap=overlap, max_lag=2 if overlap else 0)
    trainer.resume(resumed_at)
    phase = trainer.schedule_phase(outer)
    first = next((k, outer.due(trainer.step + k + phase)) for k in range(1, 9) if outer.due(trainer.step + k + phase))
    assert first == (2, [2]), f"resumed at step {resumed_at}: first push {first}"
