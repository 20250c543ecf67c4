"""A learner whose values turn non-finite reloads the global model and trains on, every time: real
syncer and learner processes on 127.0.0.1.

- A factory whose loss is NaN (or whose gradients are, the loss finite) for one step in fifteen,
  `eval_every = 1` so that a reload always lands on a reporting step (the report then had no
  loss to print and the learner died of a TypeError). The step is skipped and the weights stay
  finite: a reload used to rebase (local := global + local - mark), which kept the NaN of the
  local weights, and the learner reloaded at every step after the first, its eval NaN forever.
- `dldctl chaos corrupt --mode nan` through its real path: the chaos code writes the learner's
  control.json (as on its host) and the learner, started as dldctl starts it (`--workdir`), puts
  a NaN in its weights before every step until the fault ends; it reloads, pushes nothing
  non-finite, and pushes and merges again afterwards.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from dldctl.faults import procs
from dldctl.hostruntime import HostRuntime
from dldctl.hosts.local import LocalHost
from tests.localrun import LocalRun, user_module, write_config

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

FACTORY = '''
"""gpt-tiny whose loss (or only its gradients) is NaN at every fifteenth step after the thirtieth."""
import dataclasses
import itertools

from workload import gpt_workload

CALLS = itertools.count()
WHAT = "{what}"


def factory(ctx):
    wl = gpt_workload(dataclasses.replace(ctx, settings={{**ctx.settings, "model": "gpt-tiny"}}))

    def loss(model, batch):
        value = wl.loss(model, batch)
        n = next(CALLS)
        if not model.training or n <= 30 or n % 15:
            return value
        if WHAT == "loss":
            return value * float("nan")
        # a finite loss whose gradients are NaN: d sqrt(|u|)/du at u = 0 is inf x 0
        weight = next(model.parameters())
        return value + (weight.sum() * 0.0).abs().sqrt()

    return dataclasses.replace(wl, loss=loss)
'''

REPORT = re.compile(r"step (\d+) loss (\S+) eval (\S+) ")


def _reports(log: str) -> list[tuple[int, str]]:
    """(step, eval) of every report line."""
    return [(int(m.group(1)), m.group(3)) for m in REPORT.finditer(log)]


@pytest.mark.parametrize("what", ["loss", "gradients"])
def test_a_learner_whose_loss_or_gradients_turn_nan_reloads_and_keeps_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    code = user_module(tmp_path, "nan_model", FACTORY.format(what=what))
    run = {"model": "nan_model:factory", "eval_every": 1, "global_eval_every": 0}
    config = write_config(tmp_path, [{}], run=run)
    said = "non-finite loss" if what == "loss" else "non-finite gradients at step"
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
        assert said in log, log[-3000:]
        if what == "loss":
            assert " loss - eval " in log, "a report right after a reload says the loss is not known yet"
        reloads, reports = log.count("reloading the global model"), _reports(log)
        assert reloads <= len(reports) // 10, f"{reloads} reloads in {len(reports)} steps: one in fifteen, not all"
        assert reports[-1][1] != "nan", "the reloaded model is finite again"
        assert lr.status()["syncer"]["rejected"].get("nan", 0) == 0, "nothing non-finite was pushed"


def test_chaos_corrupt_nan_through_control_json_reloads_and_pushes_again(tmp_path: Path) -> None:
    config = write_config(tmp_path, [{}], run={"eval_every": 5, "global_eval_every": 0})
    runtime = HostRuntime("here", sys.executable, "", str(tmp_path), str(config))
    workdir = tmp_path / "learners" / "learner-0"  # where dldctl starts it (launch.learner_workdir)
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        tail = ["-m", "learner", "--config", str(config), "--id", "learner-0", "--workdir", str(workdir)]
        learner = lr.spawn("learner-0", tail)
        lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= 4, 120, "merges before the fault")
        # what `dldctl chaos corrupt learner-0 --mode nan --duration 3s` does on the learner's host
        assert procs.apply("corrupt", LocalHost("here"), runtime, "learner-0", None, 3.0, 1.0, mode="nan")
        lr.wait_log("learner-0", "chaos: corrupting weights (nan) until", 30)
        lr.wait_log("learner-0", "chaos: corruption (nan) over", 30)
        log = lr.log("learner-0")
        during = log[log.index("chaos: corrupting weights") : log.index("chaos: corruption (nan) over")]
        assert "reloading the global model" in during, log[-3000:]
        merged = lr.status()["syncer"]["outer_steps"]
        lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= merged + 4, 60, "its pushes merged again after the fault")
        assert learner.poll() is None, lr.log("learner-0")[-3000:]
        log = lr.log("learner-0")
        assert "Traceback" not in log, log[-3000:]
        after = _reports(log[log.index("chaos: corruption (nan) over") :])
        assert after and all(value != "nan" for _, value in after), after
        assert lr.status()["syncer"]["rejected"].get("nan", 0) == 0, "nothing non-finite was pushed"
