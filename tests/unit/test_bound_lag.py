"""Where a (re)joining learner's push schedule starts when learners wait on merges (max_lag or
overlap = false): it follows the fleet's fragment order. The waits themselves (max_lag, the
synchronous round) run against a real link thread in tests/integration/test_link_shell.py."""

from __future__ import annotations

from pathlib import Path

from learner.config import LearnerConfig, LearnerSpec
from learner.outer import OuterState
from learner.trainer import Trainer
from syncer.common.settings import RunSettings
from syncer.wire import fragments


def _trainer(tmp_path: Path, **run: object) -> Trainer:
    settings = RunSettings(liveness_s=1.0, **{"round_clock": "learner", **run})
    cfg = LearnerConfig("run", settings, LearnerSpec("learner-1"), "tcp://127.0.0.1:1", None, None, tmp_path)
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
