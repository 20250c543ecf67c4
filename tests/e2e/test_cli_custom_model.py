"""A user's own model through the real CLI: `model = "examples.custom_model:factory"`, made
importable on the host by the inventory's `env = { PYTHONPATH = ... }` as docs/custom-model.md
says, trained by real learner processes started by `dldctl up`; the exported final model holds
the custom model's parameters, not a GPT's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dldctl.testing import DldctlHome
from tests import memcgroup
from tests.e2e.fleetutil import ROOT, run_table

pytestmark = [pytest.mark.timeout(300)]
DLDCTL = str(Path(sys.executable).parent / "dldctl")


def inventory(tmp_path: Path, name: str, model: str, learners: int) -> Path:
    """One local host whose learners can import `examples` (the repository root on PYTHONPATH)."""
    inv = tmp_path / "inventory.toml"
    inv.write_text(
        run_table(name, model=model, quorum=1)
        + f"""
[[hosts]]
name = "here"
address = "local"
learners = {learners}
env = {{ PYTHONPATH = "{ROOT}" }}
"""
    )
    return inv


def test_custom_model_trains_under_dldctl_up(tmp_path: Path) -> None:
    inv = inventory(tmp_path, "custom", "examples.custom_model:factory", 2)
    home = tmp_path / "home"
    with DldctlHome(home) as dl:
        dl("up", str(inv), "-d")
        snap = dl.wait(
            lambda s: (
                s["syncer"]["outer_steps"] >= 12
                and s["loss"]["eval"] is not None
                and all(r["state"] == "running" for r in s["learners"])
            ),
            150,
            "the custom model training",
        )
        assert len(snap["learners"]) == 2
        out = json.loads(dl("down", "--json").stdout)
        final = torch.load(out["final_model"], weights_only=True)["state_dict"]
        assert any(name.startswith("rnn.") for name in final), sorted(final)
        assert not any(name.startswith("transformer.") for name in final)
        assert dl.leftovers() == []


def test_a_learner_that_crashes_at_start_says_why_in_the_events(tmp_path: Path) -> None:
    """A factory that does not exist kills every learner at start; the supervisor's death events
    carry the error from the learner's log, so `dldctl status` shows why, not only that."""
    inv = inventory(tmp_path, "broken", "examples.custom_model:no_such_factory", 1)
    with DldctlHome(tmp_path / "home") as dl:
        dl("up", str(inv), "-d")
        snap = dl.wait(
            lambda s: any(e["kind"] == "death" and "its log ends" in e["detail"] for e in s["events"]),
            90,
            "a death event with the learner's last log line",
        )
        death = next(e for e in snap["events"] if e["kind"] == "death")
        assert death["target"] == "learner-0"
        assert "has no attribute 'no_such_factory'" in death["detail"], death["detail"]
        dl("down")
        assert dl.leftovers() == []


BIG_FACTORY = '''
"""The char-RNN plus one parameter of 150 M values: a model the syncer's memory cannot hold."""
import torch
import torch.nn as nn

from examples import custom_model


def factory(ctx):
    w = custom_model.factory(ctx)
    w.model.big = nn.Parameter(torch.zeros(150_000_000, device=ctx.device))
    return w
'''


@pytest.mark.skipif(memcgroup.unavailable() is not None, reason=str(memcgroup.unavailable()))
def test_a_factory_model_the_syncer_cannot_hold_is_refused_with_one_line(tmp_path: Path) -> None:
    """`up` cannot count a factory's model; the syncer does, at the first hello. The whole run in
    a real 2 GB memory cgroup: the learner holds its 0.6 GB model, the syncer would need 1.8 GB
    for its three vectors and refuses it before allocating anything; the learner stops as
    refused and is not restarted; `down` leaves nothing."""
    (tmp_path / "bigmodel.py").write_text(BIG_FACTORY)
    inv = tmp_path / "inventory.toml"
    inv.write_text(
        run_table("bigmodel", model="bigmodel:factory", quorum=1, fragments=2)
        + f'\n[[hosts]]\nname = "here"\naddress = "local"\nlearners = 1\nenv = {{ PYTHONPATH = "{ROOT}:{tmp_path}" }}\n'
    )
    with memcgroup.limited(2_000_000_000) as inside, DldctlHome(tmp_path / "home") as dl:
        up = subprocess.run([*inside, DLDCTL, "up", str(inv), "-d"], env=dl.env, capture_output=True, text=True)
        assert up.returncode == 0, up.stderr
        snap = dl.wait(lambda s: any(e["kind"] == "refused" for e in s["events"]), 120, "the learner refused")
        [refused] = [e for e in snap["events"] if e["kind"] == "refused"]
        assert refused["target"] == "learner-0"
        assert (
            "the syncer cannot hold this model: its 150.1 M parameters need 1.8 GB (three fp32 vectors)"
            in (refused["detail"])
        )
        assert "(cgroup limit)" in refused["detail"] and "not restarted" in refused["detail"]
        assert snap["syncer"]["alive"] and snap["syncer"]["rejected"] == {"manifest": 1}
        row = dl.wait(lambda s: s["learners"][0]["state"] == "refused", 30, "the learner's row: refused")
        assert row["learners"][0]["pid"] is None and row["quorum"]["live"] == 0
        dl("down")
        assert dl.leftovers() == []
