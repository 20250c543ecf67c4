"""`dldctl export` on run directories made here: no model at all (one line naming the run and
what to do), no torch (one line saying to install dldctl[train]), a real gpt-tiny final_model.pt
converted (the tensors and config.json), and a corrupt newest checkpoint skipped for an older one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, load_model

from dldctl import rundir
from dldctl.errors import RunError
from dldctl.lifecycle import export as export_mod
from dldctl.runstate import RunState
from syncer import checkpoint
from syncer.common.resolved import ResolvedConfig, SyncerSection
from syncer.common.settings import RunSettings
from syncer.wire import fragments
from workload.gpt import GPT, GPTConfig, build

DLDCTL = str(Path(sys.executable).parent / "dldctl")
NO_TORCH = """
import importlib.abc, sys

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
"""


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> rundir.RunDir:
    """A run that is down, with its config.json (gpt-tiny at seq_len 32) and no model."""
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path / "home"))
    made = rundir.create("exp")
    with made.locked():
        made.write_state(RunState(status="down", run="exp", created=1.0, stopped_at=2.0))
    settings = RunSettings(name="exp", model="gpt-tiny", seq_len=32, batch_size=8, eval_batches=2, fragments=4)
    made.write_config(ResolvedConfig(run_id="exp-1", run=settings, syncer=SyncerSection(port=1, control_port=2)))
    return made


def dl(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(extra_env or {}), "COLUMNS": "200"}
    return subprocess.run([DLDCTL, *args], env=env, capture_output=True, text=True, timeout=120, check=False)


def test_a_run_with_no_model_is_one_line_naming_the_run_and_what_to_do(run: rundir.RunDir) -> None:
    with pytest.raises(RunError, match=f"run {run.name} has no final model"):
        export_mod.export(run)
    proc = dl("export", run.name)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and run.name in lines[0] and f"dldctl down --run {run.name}" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_without_a_run_it_takes_the_latest_as_status_does(run: rundir.RunDir) -> None:
    older = rundir.create("older")
    with older.locked():
        older.write_state(RunState(status="down", run="older", created=0.5, stopped_at=1.0))
    os.utime(older.state_file, (1, 1))
    assert rundir.resolve(None, live_only=False).name == run.name
    proc = dl("export")
    assert proc.returncode == 1 and f"run {run.name} has no final model" in proc.stderr, proc.stderr


def test_without_any_run_it_says_so_in_one_line(tmp_path: Path) -> None:
    proc = dl("export", extra_env={"DLDCTL_HOME": str(tmp_path / "empty")})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["error: no run yet (start one with `dldctl up`)"]


def test_converting_without_torch_says_to_install_the_train_extra(run: rundir.RunDir, tmp_path: Path) -> None:
    run.final_model.write_bytes(b"not read: torch is checked first")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_TORCH)
    proc = dl("export", run.name, extra_env={"PYTHONPATH": str(site)})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "final_model.pt" in lines[0] and "pip install 'dldctl[train]'" in lines[0]


def tiny_model(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in build("gpt-tiny", block_size=32).named_parameters()}


def test_final_model_pt_is_converted_and_loads_into_the_preset(run: rundir.RunDir, tmp_path: Path) -> None:
    tensors = tiny_model(3)
    saved = {"state_dict": tensors, "outer_steps": 12, "run_id": "exp-1", "tokens_merged": 999, "held_out_loss": 4.2}
    torch.save(saved, run.final_model)
    doc = export_mod.export(run, tmp_path / "out")
    assert doc["schema"] == "dldctl.export/1" and doc["source"] == str(run.final_model)
    assert (doc["outer_step"], doc["tokens_merged"], doc["held_out_loss"]) == (12, 999, 4.2)
    got = load_file(doc["weights"])
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)
    config = json.loads(Path(doc["config"]).read_text())
    assert config["gpt"]["n_head"] == 2 and config["gpt"]["block_size"] == 32 and config["run"] == run.name
    model = GPT(GPTConfig(**config["gpt"]))
    load_model(model, doc["weights"])
    assert torch.equal(model.lm_head.weight, tensors["transformer.wte.weight"])


def write_checkpoint(run: rundir.RunDir, tensors: dict[str, torch.Tensor], outer: int) -> Path:
    """A checkpoint file as the syncer writes it: the model cut into its 4 fragments."""
    manifest = [fragments.TensorSpec(n, tuple(t.shape)) for n, t in tensors.items()]
    plan = fragments.plan(manifest, 4)
    state = {
        "manifest": fragments.manifest_to_json(manifest),
        "fragments": 4,
        "theta": [plan.gather(p, tensors) for p in range(4)],
        "outer_steps": outer,
        "fleet": {"merged_tokens": 10 * outer},
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    body = buf.getvalue()
    path = run.checkpoints / f"ckpt-0001-{outer:09d}-1.pt"
    path.write_bytes(checkpoint.MAGIC + hashlib.sha256(body).digest() + body)
    return path


def test_the_newest_valid_checkpoint_is_converted_when_there_is_no_final_model(run: rundir.RunDir) -> None:
    older = tiny_model(5)
    write_checkpoint(run, older, 7)
    newest = write_checkpoint(run, tiny_model(6), 9)
    newest.write_bytes(newest.read_bytes()[:-10])  # cut off: its checksum fails
    with (run.metrics).open("w") as fh:
        fh.write(json.dumps({"kind": "global_eval", "outer_step": 7, "loss": 3.25, "good": True}) + "\n")
    doc = export_mod.export(run)
    assert doc["source"].startswith("checkpoint ") and "ckpt-0001-000000007" in doc["source"], doc
    assert (doc["outer_step"], doc["tokens_merged"], doc["held_out_loss"]) == (7, 70, 3.25)
    got = load_file(doc["weights"])
    assert all(torch.equal(got[k], older[k]) for k in older)
