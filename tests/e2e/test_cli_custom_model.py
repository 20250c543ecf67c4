"""A user's own model through the real CLI when it goes wrong: a factory that fails only in the
learner process (the probe at `up` built it) dies with its error in the events; a model the
syncer's memory cannot hold is refused with one line. (A factory from a shipped workdir training
on a local and an SSH host, scored by the syncer: tests/e2e/test_cli_user_model.py; the same on
a Slurm site: tests/e2e/test_slurm.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dldctl.testing import DldctlHome
from tests import memcgroup
from tests.e2e.fleetutil import ROOT, run_table

pytestmark = [pytest.mark.timeout(300)]
DLDCTL = str(Path(sys.executable).parent / "dldctl")


def inventory(tmp_path: Path, name: str, model: str, learners: int, workdir: Path = ROOT / "examples") -> Path:
    """One local host; the model's code from `workdir` (the repository's examples/ by default)."""
    inv = tmp_path / "inventory.toml"
    inv.write_text(
        run_table(name, model=model, quorum=1, workdir=str(workdir))
        + f"""
[[hosts]]
name = "here"
address = "local"
learners = {learners}
"""
    )
    return inv


LEARNER_ONLY_BUG = '''
"""Builds in the probe and on the syncer, fails in every learner process (as a bug that only
shows on the learner's device would): the learners have DLDCTL_RESTARTS in their environment."""
import os

from custom_model import factory as good


def factory(ctx):
    if "DLDCTL_RESTARTS" in os.environ:
        raise AttributeError("module 'custom_model' has no attribute 'no_such_factory'")
    return good(ctx)
'''


def test_a_learner_that_crashes_at_start_says_why_in_the_events(tmp_path: Path) -> None:
    """A factory that fails in the learner kills every learner at start; the supervisor's death
    events carry the error from the learner's log, so `dldctl status` shows why, not only that."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "custom_model.py").write_text((ROOT / "examples" / "custom_model.py").read_text())
    (tmp_path / "code" / "buggy.py").write_text(LEARNER_ONLY_BUG)
    inv = inventory(tmp_path, "broken", "buggy:factory", 1, workdir=tmp_path / "code")
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
    """`up` cannot count a factory's model; the syncer does, at the first hello (not scoring it:
    `global_eval_every = 0`, so only the learners import it, from their PYTHONPATH). The whole run in
    a real 2 GB memory cgroup: the learner holds its 0.6 GB model, the syncer would need 1.8 GB
    for its three vectors and refuses it before allocating anything; the learner stops as
    refused and is not restarted; `down` leaves nothing."""
    (tmp_path / "bigmodel.py").write_text(BIG_FACTORY)
    inv = tmp_path / "inventory.toml"
    inv.write_text(
        run_table("bigmodel", model="bigmodel:factory", quorum=1, fragments=2, global_eval_every=0)
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
