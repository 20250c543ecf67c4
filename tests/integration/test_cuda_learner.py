"""The CUDA path of the learner (skipped where torch sees no GPU): a real fleet of one learner on
`device = "cuda"` and one on the CPU, against a real syncer on 127.0.0.1.

Both train and merge; the GPU learner's replica of the global model is bit-identical to the
syncer's (its outer gradients are encoded on the GPU, its fragments come back through pinned
memory); it runs a GPU user's recipe by default (bf16, compiled, fused AdamW, TF32); the eval loss
falls; a step budget ends it with a `finished` record that names the GPU and the recipe.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests.localrun import LocalRun, write_config

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

DEVICE, GPU_NAME = "cuda", "cuda:0"


def test_a_cuda_learner_and_a_cpu_learner_train_one_model(tmp_path: Path) -> None:
    config = write_config(tmp_path, [{"device": DEVICE}, {"device": "cpu"}], run={"H": 8, "steps": 600})
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        lr.start_learner(0)
        lr.start_learner(1)
        try:
            check_fleet(lr, tmp_path)
        except (AssertionError, TimeoutError) as exc:  # a GPU host is rare: say all we know
            raise AssertionError(f"{exc}\n--- learner-0 log:\n{lr.log('learner-0')[-3000:]}") from None


def check_fleet(lr: LocalRun, tmp_path: Path) -> None:
    """Both merge, the GPU replica is exact, the loss falls, the budget ends with a record."""
    rows = lr.wait_for(lambda s: len(s["learners"]) == 2 and s["syncer"]["outer_steps"] >= 8, 60, "merges")["learners"]
    assert {r["id"]: r["device"] for r in rows} == {"learner-0": DEVICE, "learner-1": "cpu"}
    recipe = "(bf16, compiled, fused AdamW, TF32)"  # a GPU user's defaults
    assert f"parameters on {GPU_NAME} {recipe}" in lr.log("learner-0")
    lr.wait_for(
        lambda s: any(
            r["id"] == "learner-0"
            and r["replica"]["current"] >= 1
            and r["replica"]["identical"] == r["replica"]["current"]
            for r in s["learners"]
        ),
        60,
        "the GPU learner's replica at the syncer's versions",
    )
    rounds = lr.metrics("round")
    for name in ("learner-0", "learner-1"):
        assert any(name in r["contributors"] for r in rounds), f"{name} never merged"
    deadline = time.monotonic() + 200
    while not (tmp_path / "learner-0" / "finished").exists():
        assert time.monotonic() < deadline and lr.procs["learner-0"].poll() in (None, 0), lr.log("learner-0")[-2000:]
        time.sleep(0.5)
    done = json.loads((tmp_path / "learner-0" / "finished").read_text())
    assert (done["device"], done["steps"]) == (GPU_NAME, 600)
    assert (done["precision"], done["compiled"]) == ("bf16", True)
    assert done["steady_s"] > 0 and done["peak_memory_bytes"] > 0
    losses = [s["loss_eval"] for s in lr.metrics("sample") if s.get("loss_eval") is not None]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
