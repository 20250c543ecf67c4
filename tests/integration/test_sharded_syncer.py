"""A sharded syncer of real processes on 127.0.0.1: two or three `python -m syncer --shard N`
processes, each owning its share of the fragments, and real learners (gpt-tiny) with one CURVE
link per shard.

The shards split the fragments between them and every learner's replica is bit-identical to
each shard's fragments; a SIGKILLed shard restarts from its own checkpoint while the others keep
merging; a learner that joins during the outage trains once the restarted shard is back; the
final model is assembled from every shard's newest checkpoint, with each shard's versions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dldctl.ports import free_port
from syncer.wire import fragments, shards
from tests.localrun import LocalRun, write_config
from workload import WorkloadContext, build_workload

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


class ShardedRun:
    """One LocalRun per shard (its control socket and log), the learners on the first."""

    def __init__(self, tmp_path: Path, count: int, learners: int, **run: Any) -> None:
        config = write_config(tmp_path, [{} for _ in range(learners)], run=run)
        data = json.loads(config.read_text())
        data["syncer"]["shards"] = count
        data["syncer"]["shard_ports"] = [free_port() for _ in range(2 * (count - 1))]
        config.write_text(json.dumps(data))
        self.dir, self.count, self.learners = tmp_path, count, learners
        self.main = LocalRun(tmp_path, config)
        self.views = [self.main] + [_ShardView(tmp_path, config, s) for s in range(1, count)]

    def __enter__(self) -> ShardedRun:
        return self

    def __exit__(self, *exc: Any) -> None:
        for view in self.views[1:]:
            view.close()
        self.main.close()

    def start_shard(self, s: int) -> None:
        self.main.spawn(_name(s), ["-m", "syncer", "--config", str(self.main.config), "--shard", str(s)])

    def kill_shard(self, s: int) -> None:
        self.main.kill(_name(s), signal.SIGKILL)

    def status(self, s: int) -> dict[str, Any]:
        return self.views[s].status()

    def wait_for(self, s: int, predicate: Any, timeout: float, what: str) -> dict[str, Any]:
        return self.views[s].wait_for(predicate, timeout, f"shard {s}: {what}")


class _ShardView(LocalRun):
    """The control socket of shard s (its log is the main run's `syncer-s.log`)."""

    def __init__(self, directory: Path, config: Path, shard: int) -> None:
        super().__init__(directory, config)
        self.cfg = dataclasses.replace(self.cfg, syncer=self.cfg.syncer.shard(shard))


def _name(s: int) -> str:
    return "syncer" if s == 0 else f"syncer-{s}"


def _outer(run: ShardedRun, s: int) -> int:
    return int(run.status(s)["syncer"]["outer_steps"])


def test_shards_split_the_fragments_and_every_replica_matches_its_shard(tmp_path: Path) -> None:
    with ShardedRun(tmp_path, 3, 3, fragments=6, H=12) as run:
        for s in range(3):
            run.start_shard(s)
        for i in range(3):
            run.main.start_learner(i)
        owned: list[list[int]] = []
        seen: dict[int, set[str]] = {s: set() for s in range(3)}
        for s in range(3):

            def matched(snap: dict[str, Any], s: int = s) -> bool:
                rows = snap["learners"]
                assert all(r["replica"]["identical"] == r["replica"]["current"] for r in rows), rows
                seen[s].update(r["id"] for r in rows if r["replica"]["current"] >= 1)
                return snap["syncer"]["outer_steps"] >= 6 and len(seen[s]) == 3

            snap = run.wait_for(s, matched, 150, "merges and every replica identical")
            owned.append(snap["syncer"]["owned"])
            assert snap["syncer"]["shards"] == 3 and snap["syncer"]["shard"] == s
        assert sorted(p for o in owned for p in o) == list(range(6)), owned
        assert all(len(o) == 2 for o in owned), owned  # balanced: gpt-tiny's 6 fragments, 2 each


def test_a_killed_shard_restarts_from_its_checkpoint_while_the_others_merge(tmp_path: Path) -> None:
    with ShardedRun(tmp_path, 2, 3, fragments=4, H=8, checkpoint_every=2, checkpoint_s=1.0) as run:
        run.start_shard(0)
        run.start_shard(1)
        run.main.start_learner(0)
        run.main.start_learner(1)
        run.wait_for(1, lambda s: s["syncer"]["outer_steps"] >= 8, 150, "merges")
        run.wait_for(0, lambda s: s["syncer"]["outer_steps"] >= 8, 60, "merges")
        time.sleep(1.5)  # a checkpoint of shard 1 (checkpoint_s = 1)
        run.kill_shard(1)
        run.main.expect_dead.add("syncer-1")
        killed_at = _outer(run, 0)
        run.main.start_learner(2)  # joins during the outage: shard 0's state now, shard 1's when it is back
        run.wait_for(0, lambda s: s["syncer"]["outer_steps"] >= killed_at + 8, 60, "merges while shard 1 is down")
        assert "joined at versions" not in run.main.log("learner-2"), "joined without shard 1's state"
        run.start_shard(1)
        resumed = run.wait_for(1, lambda s: s["syncer"]["epoch"] >= 2, 60, "restarted")
        assert resumed["syncer"]["outer_steps"] >= 2, "shard 1 did not resume from its checkpoint"
        events = (tmp_path / "shard-1" / "events.jsonl").read_text()
        assert "syncer_resume" in events
        owned = resumed["syncer"]["owned"]
        assert "syncer shard 1 of 2: serving run" in run.main.log("syncer-1")
        assert f"epoch 2, fragments {owned} of 4," in run.main.log("syncer-1")  # its own part, from its checkpoint
        run.main.wait_log("learner-2", "joined at versions", 60)
        before = _outer(run, 1)
        run.wait_for(1, lambda s: s["syncer"]["outer_steps"] >= before + 4, 60, "merges after the restart")


def test_the_final_model_is_assembled_from_every_shards_checkpoint(tmp_path: Path) -> None:
    """...and scored: live, on shard 0, from both shards' checkpoints (a `global_eval` record
    naming them, the global loss in its status), and as the final model (its held-out loss)."""
    with ShardedRun(tmp_path, 2, 2, fragments=4, H=8, checkpoint_every=2, global_eval_every=2) as run:
        run.start_shard(0)
        run.start_shard(1)
        run.main.start_learner(0)
        run.main.start_learner(1)
        for s in (0, 1):
            run.wait_for(s, lambda snap: snap["syncer"]["outer_steps"] >= 6, 150, "merges")
        scored = run.wait_for(0, lambda snap: snap["loss"]["global"] is not None, 60, "a score of the global model")
        assert scored["guard"]["last"]["good"] in (True, False)  # judged (a flag rolls nothing back)
        evals = run.main.metrics("global_eval")
        assert evals and all(math.isfinite(r["loss"]) for r in evals)
        assert [x.split(":")[0] for x in evals[-1]["sources"]] == ["shard 0", "shard 1"]
        assert len({tuple(r["sources"]) for r in evals}) == len(evals), "a set of checkpoints scored twice"
        for i in range(2):
            run.main.kill(f"learner-{i}", signal.SIGTERM)
        run.views[1].control("shutdown")
        run.main.procs["syncer-1"].wait(timeout=30)
        run.main.control("shutdown", export="final_model.pt")
        run.main.procs["syncer"].wait(timeout=30)
        saved = torch.load(tmp_path / "final_model.pt", weights_only=True)
        assert [s["shard"] for s in saved["shards"]] == [0, 1]
        assert saved["held_out_loss"] == pytest.approx(_held_out_loss(run, saved["state_dict"]), rel=1e-5)
        specs = [fragments.TensorSpec(k, tuple(v.shape)) for k, v in saved["state_dict"].items()]
        plan = fragments.plan(specs, 4)
        owner = shards.assign(plan.sizes(), 2)
        for source in saved["shards"]:
            assert list(source["fragments"]) == list(owner.owned(source["shard"]))
            for p, version in zip(source["fragments"], source["versions"], strict=True):
                assert saved["versions"][p] == version >= 1
        replica = torch.load(tmp_path / "learner-0" / "replica.pt", weights_only=True)
        for p in range(4):  # the learner's replica at the same version is bit-equal to the assembled fragment
            if replica["versions"][p] == saved["versions"][p]:
                assert torch.equal(replica["fragments"][p], plan.gather(p, saved["state_dict"]))


def _held_out_loss(run: ShardedRun, state: dict[str, torch.Tensor]) -> float:
    """The run's held-out loss of `state`, computed here as every learner scores its own model."""
    settings = run.main.cfg.run.to_dict()
    batch = int(settings["batch_size"])
    ctx = WorkloadContext(settings, 0, 1, batch, torch.device("cpu"), int(settings["seed"]))  # as the syncer's
    wl = build_workload(ctx)
    wl.model.load_state_dict(state, strict=False)
    wl.model.eval()
    with torch.no_grad():
        losses = [float(wl.loss(wl.model, b)) for b in wl.eval_batches]
    return sum(losses) / len(losses)


def test_every_shard_crashed_at_once_resumes_from_its_own_newest_checkpoint(tmp_path: Path) -> None:
    with ShardedRun(tmp_path, 2, 2, fragments=4, H=8, checkpoint_every=2, checkpoint_s=1.0) as run:
        for s in (0, 1):
            run.start_shard(s)
        for i in range(2):
            run.main.start_learner(i)
        for s in (0, 1):
            run.wait_for(s, lambda snap: snap["syncer"]["outer_steps"] >= 8, 150, "merges")
        time.sleep(1.5)  # checkpoints of both (checkpoint_s = 1)
        run.main.expect_dead.update({"syncer", "syncer-1"})
        for s in (0, 1):
            run.kill_shard(s)
        run.main.expect_dead.clear()
        for s in (0, 1):
            run.start_shard(s)
        for s in (0, 1):
            snap = run.wait_for(s, lambda x: x["syncer"]["epoch"] >= 2, 60, "restarted")
            assert snap["syncer"]["outer_steps"] >= 2, f"shard {s} did not resume from its checkpoint"
            folder = tmp_path if s == 0 else tmp_path / "shard-1"
            resumes = [
                e
                for e in map(json.loads, (folder / "events.jsonl").read_text().splitlines())
                if e["kind"] == "syncer_resume"
            ]
            assert resumes and "versions" in resumes[-1]["detail"], resumes  # what each shard resumed at
            assert resumes[-1]["target"] == _name(s)  # shard 1's events name it as dldctl does
            before = snap["syncer"]["outer_steps"]
            run.wait_for(s, lambda x, b=before: x["syncer"]["outer_steps"] >= b + 4, 60, "merges after the restart")
