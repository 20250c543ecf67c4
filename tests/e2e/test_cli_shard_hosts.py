"""A sharded syncer across hosts, through the real `dldctl` commands: `[syncer] shards = 2` with
`shard_hosts = ["h0"]` runs shard 0 on this machine and shard 1 on a real sshd host (127.0.0.2).
`check` asks h0 over SSH for its free memory against shard 1's need; `up` sets h0 up for it
(wheel, Python, the syncer's keys) although h0 runs no learner; the local
learners dial both shards; `status --json` has shard 1's row with the CPU and memory it reports
itself; its records come home into `shard-1/`; `chaos kill syncer-1` kills it over SSH, the
supervisor restarts it there from its own checkpoint; `down` brings its final checkpoint to shard
0, which writes final_model.pt from both, and leaves nothing running on either machine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dldctl.testing import DldctlHome
from syncer.common import jsonlread
from tests.e2e.fleetutil import host_entry, run_table
from tests.sshfleet import SSHFleet

pytestmark = [pytest.mark.timeout(400)]


def inventory(fleet: SSHFleet, work: Path) -> str:
    h0 = fleet.hosts[0]
    return (
        run_table("shardhosts", fragments=4, checkpoint_every=2, checkpoint_s=1.0)
        + f"""
[syncer]
shards = 2
shard_hosts = ["h0"]

[ssh]
user = "{h0.user}"
identity_file = "{h0.identity_file}"
known_hosts = "{h0.known_hosts}"
use_ssh_config = false

[[hosts]]
name = "here"
address = "local"
learners = 2
threads = 1

"""
        + host_entry("h0", h0, work, learners=0)
    )


def _rows(snap: dict[str, Any]) -> list[dict[str, Any]]:
    return list(snap["shards"])


def _mirrored(run_dir: Path, kind: str, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Shard 1's events of `kind`, once its records have come home into shard-1/."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in jsonlread.read(run_dir / "shard-1" / "events.jsonl") if e["kind"] == kind]
        if found:
            return found
        time.sleep(1)
    raise AssertionError(f"shard 1's {kind} event did not come home")


def test_a_shard_on_an_ssh_host_trains_is_killed_restarted_and_goes_into_the_final_model(
    ssh_fleet: SSHFleet, tmp_path: Path
) -> None:
    inv = tmp_path / "inventory.toml"
    inv.write_text(inventory(ssh_fleet, tmp_path / "remote"))
    with DldctlHome(tmp_path / "home", name="shardhosts") as dl:
        dry = dl("up", str(inv), "--dry-run").stdout
        assert "syncer-1 on h0" in dry
        # each shard's host answers for its own memory, h0 over SSH with its own Python
        memory = json.loads(dl("check", str(inv), "--json").stdout)["syncer_memory"]
        assert [(m["host"], m["shards"], m["status"]) for m in memory] == [("local", [0], "ok"), ("h0", [1], "ok")]
        assert all(m["free_B"] > m["peak_B"] > 0 for m in memory), memory
        dl("up", str(inv), "-d", "--timeout", "180", timeout=300)
        state, config = dl.state(), dl.config()
        assert (state.procs["syncer"].host, state.procs["syncer-1"].host) == ("local", "h0")
        assert config.syncer.shard(1).address.startswith(f"tcp://{ssh_fleet.hosts[0].address}:")
        first = dl.wait(
            lambda s: all(r["up"] and (r["outer_steps"] or 0) >= 3 for r in _rows(s)), 120, "both shards merging"
        )
        remote = _rows(first)[1]
        assert remote["cpu_s"] > 0 and remote["rss_bytes"] > 0, remote  # it reports them itself
        assert sorted(_rows(first)[0]["fragments"] + remote["fragments"]) == [0, 1, 2, 3]
        assert _mirrored(dl.run_dir, "syncer_start")[0]["target"] == "syncer-1"  # its records came home
        dl.wait(lambda s: (_rows(s)[1]["checkpoint_outer_step"] or 0) > 0, 60, "shard 1 checkpointed on h0")

        before = _rows(dl.status())
        killed = json.loads(dl("chaos", "kill", "syncer-1", "--down-for", "6", "--json").stdout)
        assert (killed["target"], killed["pid"]) == ("syncer-1", before[1]["pid"])
        dl.wait(
            lambda s: not _rows(s)[1]["up"] and _rows(s)[0]["outer_steps"] >= before[0]["outer_steps"] + 3,
            40,
            "shard 0 merging while shard 1 is down",
        )
        back = dl.wait(lambda s: _rows(s)[1]["up"] and _rows(s)[1]["epoch"] == 2, 90, "shard 1 restarted on h0")
        assert _rows(back)[1]["outer_steps"] >= before[1]["checkpoint_outer_step"] > 0, "it did not resume"
        resumes = _mirrored(dl.run_dir, "syncer_resume")
        assert resumes[-1]["target"] == "syncer-1" and "from outer step" in resumes[-1]["detail"]

        summary = dl.down()
        assert [s["state"] for s in summary["shards"]] == ["stopped", "stopped"], summary
        gathered = [e for e in dl.events("shard_gathered") if e["target"] == "syncer-1"]
        assert gathered and "from h0" in gathered[0]["detail"]
        saved = torch.load(summary["final_model"], weights_only=True)
        assert [s["shard"] for s in saved["shards"]] == [0, 1]
        assert saved["shards"][1]["outer_steps"] >= _rows(back)[1]["outer_steps"]
        # shard 1's checkpoints were on h0 while it ran: no live score (said once), the final model is
        off = [e["detail"] for e in dl.events("global_eval_off")]
        assert len(off) == 1 and "1 shard(s) keep their checkpoints on another host" in off[0], off
        assert 0 < saved["held_out_loss"] < 10
    assert dl.leftovers() == []
