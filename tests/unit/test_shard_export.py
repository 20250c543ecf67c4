"""`dldctl export` of a sharded run with no final_model.pt: every shard's newest valid checkpoint
(each in its own directory) assembled into the whole model, as the syncer's own assembly
(syncer/shardmodel.py) does; a shard without one is one line naming the shard and its directory.
Shard 0's scorer (syncer/shardscore.py, a real evaluator thread) scores the same assembly of
these checkpoints, each new set once, and the export carries that score."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dldctl import rundir
from dldctl.errors import RunError
from dldctl.lifecycle import export as export_mod
from dldctl.runstate import RunState
from syncer import checkpoint, shardmodel
from syncer.common.resolved import ResolvedConfig, SyncerSection
from syncer.common.settings import RunSettings
from syncer.globalmodel import Outbox
from syncer.guard import QualityGuard
from syncer.shardscore import CheckpointEvaluator, ShardScoring
from syncer.wire import fragments, shards
from workload import WorkloadContext, build_workload
from workload.gpt import build

COUNT = 2


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> rundir.RunDir:
    """A sharded run that is down, with its config.json (gpt-tiny, 4 fragments, 2 shards) and no model."""
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path / "home"))
    made = rundir.create("shx")
    with made.locked():
        made.write_state(RunState(status="down", run="shx", created=1.0, stopped_at=2.0))
    settings = RunSettings(name="shx", model="gpt-tiny", seq_len=32, batch_size=8, eval_batches=2, fragments=4)
    section = SyncerSection(port=1, control_port=2, shards=COUNT, shard_ports=(3, 4))
    made.write_config(ResolvedConfig(run_id="shx-1", run=settings, syncer=section))
    return made


def tiny_model(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in build("gpt-tiny", block_size=32).named_parameters()}


def write_shard_checkpoint(
    run: rundir.RunDir, shard: int, tensors: dict[str, torch.Tensor], outer: int, run_id: str = "shx-1"
) -> Path:
    """Shard `shard`'s checkpoint as the syncer writes it: only the fragments it owns, in local order."""
    manifest = [fragments.TensorSpec(n, tuple(t.shape)) for n, t in tensors.items()]
    owned = shards.assign(fragments.plan(manifest, 4).sizes(), COUNT).owned(shard)
    plan = shards.shard_plan(manifest, 4, shard, COUNT)
    state = {
        "run_id": run_id,
        "epoch": 1,
        "manifest": fragments.manifest_to_json(manifest),
        "fragments": 4,
        "shard": [shard, COUNT],
        "owned": list(owned),
        "theta": [plan.gather(q, tensors) for q in range(len(owned))],
        "versions": [outer] * len(owned),
        "outer_steps": outer,
        "fleet": {"merged_tokens": 10 * outer},
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    body = buf.getvalue()
    directory = (run.path / f"shard-{shard}" if shard else run.path) / "checkpoints"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-0001-{outer:09d}-{outer}.pt"
    path.write_bytes(checkpoint.MAGIC + hashlib.sha256(body).digest() + body)
    return path


def test_every_shards_newest_valid_checkpoint_is_assembled(run: rundir.RunDir) -> None:
    model = tiny_model(3)
    write_shard_checkpoint(run, 0, model, 7)
    write_shard_checkpoint(run, 1, tiny_model(4), 5)
    write_shard_checkpoint(run, 1, model, 6)
    cut = write_shard_checkpoint(run, 1, tiny_model(5), 9)
    cut.write_bytes(cut.read_bytes()[:-10])  # its checksum fails: the one before it stands in
    doc = export_mod.export(run)
    assert "the newest checkpoints of 2 syncer shards" in doc["source"] and "shard-1/checkpoints/" in doc["source"]
    # outer steps of both shards; merged tokens are shard 0's (each counts its fragments as the model)
    assert (doc["outer_step"], doc["tokens_merged"], doc["held_out_loss"]) == (13, 70, None)
    got = load_file(doc["weights"])
    assert got.keys() == model.keys() and all(torch.equal(got[k], model[k]) for k in model)
    syncers = shardmodel.assemble(run.path, COUNT)  # the syncer's own assembly says the same
    assert all(torch.equal(syncers.tensors[k], got[k]) for k in model)
    assert (syncers.outer_steps, syncers.merged_tokens, syncers.versions) == (13, 70, [7, 6, 6, 7])


def test_a_shard_with_no_valid_checkpoint_is_named(run: rundir.RunDir) -> None:
    write_shard_checkpoint(run, 0, tiny_model(3), 7)
    write_shard_checkpoint(run, 1, tiny_model(3), 6, run_id="another-run")
    with pytest.raises(RunError) as caught:
        export_mod.export(run)
    line = caught.value.line()
    assert "syncer shard 1 has no valid checkpoint in" in line and str(run.path / "shard-1") in line
    assert "not shard 1 of 2 of run shx-1" in line and "\n" not in line


def test_the_export_carries_shard_0s_score_of_exactly_those_checkpoints(run: rundir.RunDir) -> None:
    model = tiny_model(3)
    write_shard_checkpoint(run, 0, model, 7)
    write_shard_checkpoint(run, 1, model, 6)
    record = {"kind": "global_eval", "loss": 2.5, "good": None}
    lines = [
        {**record, "loss": 2.4, "sources": ["shard 0: ckpt-0001-000000007", "shard 1: ckpt-0001-000000005"]},
        {**record, "sources": ["shard 0: ckpt-0001-000000007", "shard 1: ckpt-0001-000000006"]},  # these
        {"kind": "sample", "loss_global": 9.0},
    ]
    run.metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert export_mod.export(run)["held_out_loss"] == 2.5
    write_shard_checkpoint(run, 1, model, 8)  # a newer checkpoint nobody scored: no loss, not a stale one
    shutil.rmtree(run.path / export_mod.EXPORT_DIR)  # (a down run's export is reused)
    assert export_mod.export(run)["held_out_loss"] is None


def _scores(scoring: ShardScoring, core: Any, until: int, timeout: float = 30.0) -> Outbox:
    """Tick shard 0's scoring (a new outer step each time) until `until` scores are recorded."""
    out = Outbox()
    deadline = time.monotonic() + timeout
    while len(out.metrics) < until and time.monotonic() < deadline:
        core.outer_steps += 1
        scoring.tick(core, time.time(), out)
        time.sleep(0.02)
    return out


def test_shard_0_scores_each_new_set_of_every_shards_checkpoints_once(run: rundir.RunDir) -> None:
    settings = run.read_config().run.to_dict()
    evaluator = CheckpointEvaluator(settings, run.path, COUNT)
    scoring = ShardScoring(evaluator, every=1, elsewhere=0)
    guard = 0.01  # the blown-up model below scores ~4% worse than the random one (a model this young barely learns)
    # what tick reads of the core
    core = SimpleNamespace(outer_steps=0, guard=QualityGuard(guard), s=RunSettings(quality_guard=guard))
    evaluator.start()
    try:
        model = tiny_model(3)
        write_shard_checkpoint(run, 0, model, 7)
        assert _scores(scoring, core, 1, timeout=2.0).metrics == []  # shard 1 has none yet: nothing scored
        write_shard_checkpoint(run, 1, model, 6)
        (first,) = _scores(scoring, core, 1).metrics
        assert first["sources"] == ["shard 0: ckpt-0001-000000007", "shard 1: ckpt-0001-000000006"]
        wl = build_workload(WorkloadContext(settings, 0, 1, 8, torch.device("cpu"), int(settings["seed"])))
        with torch.no_grad():
            for name, param in wl.model.named_parameters():
                param.copy_(model[name])
            expected = sum(float(wl.loss(wl.model, b)) for b in wl.eval_batches) / len(wl.eval_batches)
        assert first["loss"] == pytest.approx(expected, rel=1e-6) and first["good"] is True
        assert core.guard.last["loss"] == first["loss"] and core.guard.last["good"] is True
        assert _scores(scoring, core, 1, timeout=2.0).metrics == []  # the same checkpoints: not scored again
        # shard 1's part blown up: flagged, said, counted; nothing rolled back (no shard can)
        write_shard_checkpoint(run, 1, {k: 1000 * v for k, v in model.items()}, 8)
        out = _scores(scoring, core, 1)
        (second,) = out.metrics
        assert second["sources"][1] == "shard 1: ckpt-0001-000000008" and second["loss"] > (1 + guard) * first["loss"]
        assert second["good"] is False and second["reference"] == first["loss"] and core.guard.trips == 1
        (said,) = [e for e in out.events if e["kind"] == "quality_guard"]
        assert "shard 1: ckpt-0001-000000008" in said["detail"] and "does not roll back" in said["detail"]
    finally:
        evaluator.stop()
