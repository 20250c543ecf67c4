"""A real syncer that scores no global model says so, and why: in its status snapshot
(`loss.global_off`, `guard.off`), its metrics samples, one `global_eval_off` event and the
export `down` asks for (`held_out_loss_missing`); real processes on 127.0.0.1.

- the model's factory is importable on the learner's side only (as when a user's code is not on
  the syncer's host): the learner trains and the syncer merges, while every record of the run
  says the global model is not scored and why;
- `global_eval_every = 0` is reported as off on purpose, with no event.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from syncer.common import modelexport, unscored
from tests.localrun import LocalRun, user_module, write_config

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

FACTORY = '''
"""gpt-tiny under another name: importable where this directory is on the path."""
import dataclasses

from workload import gpt_workload


def factory(ctx):
    return gpt_workload(dataclasses.replace(ctx, settings={**ctx.settings, "model": "gpt-tiny"}))
'''


def test_a_syncer_that_cannot_build_the_model_says_why_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = user_module(tmp_path, "learner_only_model", FACTORY)
    config = write_config(tmp_path, [{}], run={"model": "learner_only_model:factory", "global_eval_every": 2})
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        status = lr.wait_for(lambda s: s["loss"].get("global_off"), 60, "the syncer to say why it cannot score")
        reason = status["loss"]["global_off"]
        assert reason.startswith(unscored.BUILD) and "learner_only_model" in reason, reason
        assert status["guard"]["off"] == reason and status["loss"]["global"] is None
        monkeypatch.setenv("PYTHONPATH", str(code))  # the learner's host has the user's code
        lr.start_learner(0)
        status = lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= 4, 120, "merges of the learner's work")
        assert status["loss"]["global_off"] == reason and status["loss"]["global"] is None  # still not scored
        assert status["guard"]["trips"] == 0 and status["guard"]["off"] == reason
        lr.wait_for(lambda s: any(m.get("global_off") == reason for m in lr.metrics("sample")), 30, "a sample")
        (event,) = [e for e in lr.events() if e["kind"] == unscored.EVENT]
        assert reason in event["detail"] and "importable" in event["detail"], event
        assert not lr.metrics("global_eval"), "a score of a model the syncer could not build"
        assert unscored.from_records(lr.metrics("sample"), lr.events()) == reason
        lr.control("shutdown", export="final_model.pt")
        lr.expect_dead.add("syncer")
        lr.procs["syncer"].wait(timeout=60)
        exported = modelexport.read_config(tmp_path / modelexport.EXPORT_DIR / modelexport.CONFIG)
        assert exported["held_out_loss"] is None and exported["held_out_loss_missing"] == reason


def test_global_eval_every_0_is_reported_as_off_on_purpose(tmp_path: Path) -> None:
    config = write_config(tmp_path, [{}], run={"global_eval_every": 0})
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        status = lr.wait_for(lambda s: s["loss"].get("global_off"), 60, "the syncer's snapshot")
        assert status["loss"]["global_off"] == unscored.EVERY_OFF and unscored.on_purpose(status["loss"]["global_off"])
        assert status["guard"]["off"] == unscored.EVERY_OFF
        lr.wait_for(
            lambda s: any(m.get("global_off") == unscored.EVERY_OFF for m in lr.metrics("sample")), 30, "a sample"
        )
        assert not [e for e in lr.events() if e["kind"] == unscored.EVENT]
