"""`[run] init_from` through the real CLI: a new run started from a model file (laid out as a
previous run's `dldctl down` exports it, named relative to the inventory) trains from those
weights, not from the seed's init. (A bad file refused by `up`: tests/unit/test_initmodel.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dldctl.testing import DldctlHome
from tests.e2e.fleetutil import run_table
from workload import gpt

pytestmark = [pytest.mark.timeout(180)]

HOSTS = """
[[hosts]]
name = "here"
address = "local"
learners = 1
"""


def gpt_tiny(seed: int) -> dict[str, torch.Tensor]:
    """gpt-tiny's parameters (seq_len 32, the built-in corpus' 256 bytes) from `seed`, as
    `export_model` writes them: named_parameters(), so the tied lm_head.weight is absent."""
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in gpt.build("gpt-tiny", block_size=32).named_parameters()}


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[n] - b[n]).norm()) for n in a)


def test_a_new_run_starts_from_the_init_from_file(tmp_path: Path) -> None:
    init = gpt_tiny(seed=123)
    (tmp_path / "models").mkdir()
    torch.save(
        {"state_dict": init, "outer_steps": 7, "versions": [3, 3, 3, 3], "run_id": "prev-0123abcd"},
        tmp_path / "models" / "final_model.pt",
    )
    inv = tmp_path / "inventory.toml"
    # lr 1e-6: the weights barely move, however many steps the learner takes before `down`
    inv.write_text(run_table("initfrom", quorum=1, lr=1e-6, init_from="models/final_model.pt") + HOSTS)
    with DldctlHome(tmp_path / "home") as dl:
        dl("up", str(inv), "-d")
        dl.wait(lambda s: s["syncer"]["outer_steps"] >= 1, 90, "a merge")
        log = dl.log("learner-0")
        out = dl.down()
        final = torch.load(out["final_model"], weights_only=True)["state_dict"]
        assert dl.leftovers() == []
    said = f"learner-0: initialized from init_model.pt ({len(init)} tensors, from run prev-0123abcd at outer step 7)"
    assert said in log, log[-2000:]
    assert json.loads((Path(out["dir"]) / "config.json").read_text())["init_model"] == "init_model.pt"
    # the global model is the file's (moved a hair by the merges), not the seed's init (file ignored)
    seeded = gpt_tiny(seed=0)
    assert set(final) == set(init)
    # (5%: the learners' steps until `down` move it, more on a loaded machine: 1.03% in one suite run)
    assert distance(final, init) < 0.05 * distance(final, seeded), (distance(final, init), distance(final, seeded))
