"""A learner whose loss turns non-finite reloads the global model and trains on, every time: real
syncer and learner processes on 127.0.0.1, a factory whose loss is NaN for one step in fifteen,
`eval_every = 1` so that a reload always lands on a reporting step (the report then had no loss
to print and the learner died of a TypeError)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.localrun import LocalRun, user_module, write_config

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

FACTORY = '''
"""gpt-tiny whose loss is NaN at every fifteenth step after the thirtieth."""
import dataclasses
import itertools

from workload import gpt_workload

CALLS = itertools.count()


def factory(ctx):
    wl = gpt_workload(dataclasses.replace(ctx, settings={**ctx.settings, "model": "gpt-tiny"}))

    def loss(model, batch):
        value = wl.loss(model, batch)
        n = next(CALLS)
        return value * float("nan") if n > 30 and n % 15 == 0 else value

    return dataclasses.replace(wl, loss=loss)
'''


def test_a_learner_whose_loss_turns_nan_reloads_and_keeps_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = user_module(tmp_path, "nan_model", FACTORY)
    run = {"model": "nan_model:factory", "eval_every": 1, "global_eval_every": 0}
    config = write_config(tmp_path, [{}], run=run)
    with LocalRun(tmp_path, config) as lr:
        monkeypatch.setenv("PYTHONPATH", str(code))  # the user's code, on both sides
        lr.start_syncer()
        learner = lr.start_learner(0)
        lr.wait_for(lambda s: lr.log("learner-0").count("reloading the global model") >= 3, 120, "three reloads")
        steps = lr.status()["learners"][0]["step"]
        lr.wait_for(lambda s: s["learners"][0]["step"] > steps + 20, 60, "training on after the reloads")
        assert learner.poll() is None, lr.log("learner-0")[-3000:]
        log = lr.log("learner-0")
        assert "Traceback" not in log, log[-3000:]
        assert " loss - eval " in log, "a report right after a reload says the loss is not known yet"
