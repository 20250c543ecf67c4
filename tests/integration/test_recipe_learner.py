"""The GPU recipe's settings on real learner processes (CPU here; the same code on CUDA).

`precision = "bf16"` + `compile = true`: the learner trains a compiled model under bf16
autocast, its loss falls, its `finished` record reports the recipe, the warm-up (compilation)
apart from the steady throughput and the time to its first step, and its replica of the global
model is still bit-identical to the syncer's (the outer gradients stay fp32). A host where
torch.compile cannot work (no C++ compiler for inductor) says so once and trains uncompiled.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from syncer.wire import fragments
from tests.localrun import LocalRun, write_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _finish(lr: LocalRun, timeout: float) -> dict:
    """Wait for learner-0 to spend its budget; its `finished` record."""
    deadline = time.monotonic() + timeout
    while lr.procs["learner-0"].poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert lr.procs["learner-0"].returncode == 0, lr.log("learner-0")[-3000:]
    return json.loads((lr.dir / "learner-0" / "finished").read_text())


def test_bf16_compiled_learner_trains_and_keeps_the_replica_exact(tmp_path: Path) -> None:
    config = write_config(tmp_path, [{}], run={"steps": 80, "precision": "bf16", "compile": True, "eval_every": 40})
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        lr.start_learner(0)
        done = _finish(lr, 200)
        log = lr.log("learner-0")
        assert "(bf16, compiled)" in log, log[-2000:]
        assert (done["precision"], done["compiled"], done["warmup_steps"]) == ("bf16", True, 3)
        # compilation happens in the warm-up: it is timed apart, and the steady part is faster per step
        assert done["first_step_s"] > 0 and done["warmup_s"] > 0 and done["steady_s"] > 0
        assert done["steady_tokens"] == done["tokens"] - 3 * 8 * 32
        assert done["warmup_s"] / 3 > done["steady_s"] / (80 - 3), done
        assert done["peak_memory_bytes"] > 10 * 2**20
        evals = [float(line.split(" eval ")[1].split()[0]) for line in log.splitlines() if " eval " in line]
        assert len(evals) == 2 and evals[-1] < 5.0, evals  # gpt-tiny starts near ln(vocab) = 5.5
        leaves = [e["detail"] for e in lr.events() if e["kind"] == "leave"]
        assert leaves == ["learner finished its budget"], leaves  # the syncer keeps it in the average
        export = tmp_path / "final_model.pt"
        lr.control("shutdown", export="final_model.pt")
        lr.procs["syncer"].wait(timeout=30)
        saved = torch.load(export, weights_only=True)
        state, versions = saved["state_dict"], saved["versions"]
        plan = fragments.plan([fragments.TensorSpec(k, tuple(v.shape)) for k, v in state.items()], 4)
        replica = torch.load(tmp_path / "learner-0" / "replica.pt", weights_only=True)
        # the fragments the learner pushed as it finished are merged after it saved its replica: one
        # version behind there; every other fragment is the syncer's, bit for bit
        behind = [versions[p] - replica["versions"][p] for p in range(plan.count)]
        assert set(behind) <= {0, 1} and 0 in behind, (replica["versions"], versions)
        same = [p for p in range(plan.count) if behind[p] == 0]
        for p in same:
            assert torch.equal(replica["fragments"][p], plan.gather(p, state)), f"fragment {p} differs"


def test_a_host_that_cannot_compile_trains_uncompiled(tmp_path: Path) -> None:
    config = write_config(tmp_path, [{}], run={"steps": 30, "compile": True, "eval_every": 30})
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        lr.start_learner(0, env={"CXX": "/bin/false"})  # inductor finds no working C++ compiler
        done = _finish(lr, 150)
        log = lr.log("learner-0")
        assert log.count("torch.compile failed (InductorError") == 1, log[-2000:]
        assert "training uncompiled (set compile = false)" in log
        assert (done["steps"], done["compiled"], done["warmup_steps"]) == (30, False, 3)
        lr.kill("syncer", signal.SIGTERM)
