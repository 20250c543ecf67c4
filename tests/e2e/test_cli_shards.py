"""`[syncer] shards = 2` through the real `dldctl` commands on this machine (no SSH): `up` starts a
process per shard, `status --json` has a row per shard, `chaos kill syncer-1` takes shard 1 down
while shard 0 merges on, the supervisor restarts it from its own checkpoint, and `down` stops the
shards in order and leaves final_model.pt assembled from both (and scored), and nothing running;
shard 0 scores the global model from both shards' checkpoints while the run trains.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dldctl.testing import DldctlHome
from tests.e2e.fleetutil import run_table

pytestmark = [pytest.mark.timeout(240)]

INVENTORY = (
    run_table("shards", fragments=4, checkpoint_every=2, checkpoint_s=1.0, global_eval_every=4)
    + """
[syncer]
shards = 2

[[hosts]]
name = "here"
address = "local"
learners = 2
threads = 1
"""
)


def _rows(snap: dict[str, Any]) -> list[dict[str, Any]]:
    return list(snap["shards"])


def test_two_shards_up_killed_restarted_and_down(tmp_path: Path) -> None:
    inv = tmp_path / "inventory.toml"
    inv.write_text(INVENTORY)
    with DldctlHome(tmp_path / "home", name="shards") as dl:
        dl("up", str(inv), "-d", "--timeout", "120", timeout=180)
        assert {"syncer", "syncer-1"} <= set(dl.state().procs)
        config = dl.config()
        assert config.syncer.shards == 2 and len(config.syncer.shard_ports) == 2
        first = dl.wait(
            lambda s: all(r["up"] and (r["outer_steps"] or 0) >= 3 and r["checkpoint_outer_step"] for r in _rows(s)),
            90,
            "both shards merging and checkpointed",
        )
        rows = _rows(first)
        assert [r["shard"] for r in rows] == [0, 1] and [r["name"] for r in rows] == ["syncer", "syncer-1"]
        assert sorted(rows[0]["fragments"] + rows[1]["fragments"]) == [0, 1, 2, 3]
        assert all(isinstance(r["pid"], int) and r["epoch"] == 1 for r in rows)
        assert first["syncer"]["fragments"] == 4 and first["quorum"]["total"] == 2  # shard 0 speaks for the fleet
        dl.wait(lambda s: _rows(s)[1]["outer_steps"] > rows[1]["outer_steps"], 30, "shard 1 advancing")
        # shard 0 scores the model of both shards' checkpoints: the global loss, as unsharded
        scored = dl.wait(lambda s: s["loss"]["global"] is not None, 60, "a score of the sharded global model")
        assert 0 < scored["loss"]["global"] < 10 and scored["guard"]["last"]["good"] in (True, False)
        assert "shard 1 of 2" in dl("logs", "syncer-1", "--tail", "50").stdout

        before = _rows(dl.status())
        killed = json.loads(dl("chaos", "kill", "syncer-1", "--down-for", "8", "--json").stdout)
        assert (killed["action"], killed["target"], killed["pid"]) == ("kill", "syncer-1", before[1]["pid"])
        down = dl.wait(
            lambda s: not _rows(s)[1]["up"] and _rows(s)[0]["outer_steps"] >= before[0]["outer_steps"] + 3,
            30,
            "shard 0 merging while shard 1 is down",
        )
        assert down["syncer"]["alive"] is True and _rows(down)[1]["state"] in ("dead", "restarting")
        back = dl.wait(lambda s: _rows(s)[1]["up"], 60, "shard 1 restarted")
        row = _rows(back)[1]
        assert row["epoch"] == 2 and row["restarts"] == 1
        assert row["outer_steps"] >= before[1]["checkpoint_outer_step"] > 0, "shard 1 did not resume its checkpoint"
        assert any(e["target"] == "syncer-1" for e in dl.events("restart"))

        summary = dl.down()
        assert summary["final_model"] and [s["shard"] for s in summary["shards"]] == [0, 1]
        assert all(s["state"] == "stopped" and s["outer_steps"] > 0 for s in summary["shards"]), summary
        saved = torch.load(summary["final_model"], weights_only=True)
        assert [s["shard"] for s in saved["shards"]] == [0, 1]
        assert 0 < saved["held_out_loss"] < 10  # the final model, assembled and scored
        assert dl.leftovers() == []
