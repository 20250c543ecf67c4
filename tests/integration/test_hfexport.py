"""`dldctl export RUN --format hf` on run directories laid out as the syncer leaves them: config.json
written with syncer.common.resolved, final_model.pt as `dldctl down` exports it (syncer/checkpoint.py
`export_model`), its held_out_loss scored the way the syncer's evaluator scores (the workload's loss
on its eval batches), after a few real training steps. The real CLI writes the directory; here it is
loaded with `AutoModelForCausalLM.from_pretrained` (and `AutoTokenizer` for an `hf:` model) and
scored again: the run's loss to 1e-4. A wrong reported loss fails the command and writes nothing;
data that is not on this machine skips the verification and says so; a factory is refused; a
missing run or one without a model gives the existing errors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dldctl import rundir
from dldctl.runstate import RunState
from syncer.common.resolved import ResolvedConfig, SyncerSection
from syncer.common.settings import RunSettings
from tests import hfmodels
from workload import WorkloadContext, build_workload
from workload.hfexport import held_out_loss

pytestmark = [pytest.mark.timeout(240)]

DLDCTL = str(Path(sys.executable).parent / "dldctl")
SMALL = {"seq_len": 32, "batch_size": 4, "eval_batches": 2, "fragments": 4, "seed": 3}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """DLDCTL_HOME and the corpus cache in tmp_path, for the runs made here and the CLI alike."""
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DLDCTL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "home"


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return hfmodels.sample_text(tmp_path / "corpus.txt", 60_000)


def make_run(name: str, settings: RunSettings, model_dir: Path | None = None) -> rundir.RunDir:
    """A run that is down: state.json, and the config.json `dldctl up` writes (an `hf:` model's
    directory copied into the run as `hf_model`, named relative to config.json)."""
    run = rundir.create(name)
    with run.locked():
        run.write_state(RunState(status="down", run=name, created=1.0, stopped_at=2.0))
    if model_dir is not None:
        shutil.copytree(model_dir, run.path / "hf_model")
    section = SyncerSection(port=1, control_port=2)
    run.write_config(
        ResolvedConfig(
            run_id=f"{name}-1", run=settings, syncer=section, model_dir="hf_model" if model_dir is not None else None
        )
    )
    return run


def workload(run: rundir.RunDir) -> Any:
    """The run's workload as the syncer's evaluator builds it (syncer/evaluator.py `_build`)."""
    cfg = run.read_config()
    s = cfg.run.to_dict()
    where = cfg.model_dir_path(run.path)
    ctx = WorkloadContext(
        settings=s,
        learner_index=0,
        shards=1,
        batch_size=int(s["batch_size"]),
        device=torch.device("cpu"),
        seed=int(s["seed"]),
        model_args=dict(cfg.model_args),
        model_dir=None if where is None else str(where),
    )
    return build_workload(ctx)


def train_and_export(run: rundir.RunDir, steps: int = 12, loss_offset: float = 0.0) -> float:
    """A few real AdamW steps, then final_model.pt as `dldctl down` writes it, its held_out_loss
    the evaluator's score of exactly these weights (+ `loss_offset`, to make it wrong). The loss."""
    wl = workload(run)
    opt = torch.optim.AdamW(wl.model.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        wl.loss(wl.model, wl.next_batch()).backward()
        opt.step()
    wl.model.eval()
    with torch.no_grad():
        held = sum(float(wl.loss(wl.model, b)) for b in wl.eval_batches) / len(wl.eval_batches)
    tensors = {n: p.detach().clone() for n, p in wl.model.named_parameters()}
    saved = {"state_dict": tensors, "outer_steps": 7, "versions": [7] * 4, "run_id": run.read_config().run_id}
    torch.save({**saved, "tokens_merged": 1234, "held_out_loss": held + loss_offset}, run.final_model)
    return held


def dl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DLDCTL, *args], capture_output=True, text=True, timeout=200, env=dict(os.environ))


def exported(run: rundir.RunDir, *args: str) -> dict[str, Any]:
    proc = dl("export", run.name, "--format", "hf", "--json", *args)
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    assert doc["schema"] == "dldctl.export/1" and doc["format"] == "hf" and doc["run"] == run.name, doc
    return doc


def scored(directory: str, run: rundir.RunDir) -> float:
    """The directory loaded as a user loads it, scored on the run's held-out batches."""
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    return held_out_loss(model, workload(run).eval_batches)


def one_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_a_preset_run_exports_a_gpt2_that_scores_the_run_loss(home: Path, corpus: Path) -> None:
    run = make_run("tiny", RunSettings(name="tiny", model="gpt-tiny", data=str(corpus), **SMALL))
    held = train_and_export(run)
    doc = exported(run)
    out = run.path / "export-hf"
    assert doc["dir"] == str(out) and doc["class"] == "GPT2LMHeadModel" and doc["model_type"] == "gpt2"
    assert doc["source"] == str(run.final_model) and doc["safetensors"] == str(run.path / "export")
    assert doc["verification"] == "done" and doc["held_out_loss"] == held and doc["eval_batches"] == 2
    assert abs(doc["verified_loss"] - held) < 1e-4 and abs(doc["loss_diff"]) < 1e-4, doc
    assert abs(doc["reference_loss"] - held) < 1e-4
    assert type(AutoModelForCausalLM.from_pretrained(str(out))).__name__ == "GPT2LMHeadModel"
    assert abs(scored(str(out), run) - held) < 1e-4
    record = json.loads((out / "dldctl_export.json").read_text())
    assert (record["run_id"], record["outer_step"], record["tokens_merged"]) == ("tiny-1", 7, 1234)
    assert record["model"] == "gpt-tiny" and record["held_out_loss"] == held and record["verification"] == "done"
    readme = (out / "README.md").read_text()
    assert "AutoModelForCausalLM.from_pretrained" in readme and "byte value" in readme
    # again, unverified, over the first: the directory is replaced whole, nothing left beside it
    again = exported(run, "--no-verify")
    assert again["verification"] == "off" and again["verified_loss"] is None
    assert sorted(p.name for p in run.path.iterdir() if p.name.startswith(".")) == []


def test_an_hf_llama_run_exports_its_own_class_and_tokenizer(home: Path, corpus: Path, tmp_path: Path) -> None:
    user_dir = hfmodels.tiny_llama_dir(tmp_path / "my-llama", tokenizer_text=corpus)
    settings = RunSettings(name="llama", model=f"hf:{user_dir}", data=str(corpus), **SMALL)
    run = make_run("llama", settings, model_dir=user_dir)
    held = train_and_export(run, steps=6)
    doc = exported(run)
    out = Path(doc["dir"])
    assert doc["class"] == "LlamaForCausalLM" and doc["verification"] == "done", doc
    assert abs(doc["verified_loss"] - held) < 1e-4, doc
    assert doc["tokenizer"] and (out / "tokenizer.json").is_file()
    assert abs(scored(str(out), run) - held) < 1e-4
    text = "def main(argv):\n    return 0\n"
    theirs, ours = AutoTokenizer.from_pretrained(str(user_dir)), AutoTokenizer.from_pretrained(str(out))
    assert ours(text)["input_ids"] == theirs(text)["input_ids"] and ours.eos_token == hfmodels.EOS
    assert "AutoTokenizer.from_pretrained" in (out / "README.md").read_text()


def test_a_wrong_reported_loss_fails_and_writes_nothing(home: Path, corpus: Path, tmp_path: Path) -> None:
    run = make_run("off", RunSettings(name="off", model="gpt-tiny", data=str(corpus), **SMALL))
    train_and_export(run, steps=2, loss_offset=0.05)
    out = tmp_path / "model"
    line = one_line(dl("export", run.name, "--format", "hf", "--out", str(out)), 1)
    assert "the hf export is wrong" in line and "reported held-out loss" in line, line
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_data_not_on_this_machine_skips_the_verification_and_says_why(home: Path, corpus: Path) -> None:
    run = make_run("far", RunSettings(name="far", model="gpt-tiny", data=str(corpus), **SMALL))
    train_and_export(run, steps=1)
    cfg = run.read_config()  # the run's data lived on the syncer's host, not here
    run.write_config(
        ResolvedConfig(
            run_id=cfg.run_id, run=RunSettings(**{**cfg.run.to_dict(), "data": "/gone/corpus.txt"}), syncer=cfg.syncer
        )
    )
    doc = exported(run)
    assert doc["verification"] == "skipped" and "/gone/corpus.txt" in doc["why"] and doc["verified_loss"] is None
    assert "not verified" in (run.path / "export-hf" / "README.md").read_text()
    human = dl("export", run.name, "--format", "hf")
    assert human.returncode == 0 and "not verified: the run's held-out data is not readable" in human.stdout


def test_a_factory_run_is_refused_and_missing_models_keep_their_errors(home: Path) -> None:
    run = make_run("mine", RunSettings(name="mine", model="mypkg.models:factory", **SMALL))
    line = one_line(dl("export", run.name, "--format", "hf"), 2)
    assert "transformers has no class for it" in line and f"`dldctl export {run.name}`" in line, line
    assert "load_state_dict" in line and 'model = "hf:DIR"' in line
    bare = make_run("bare", RunSettings(name="bare", model="gpt-tiny", **SMALL))
    line = one_line(dl("export", bare.name, "--format", "hf"), 1)
    assert f"run {bare.name} has no final model" in line and f"dldctl down --run {bare.name}" in line
    line = one_line(dl("export", "no-such-run", "--format", "hf"), 1)
    assert "no run named 'no-such-run'" in line
    assert one_line(dl("export", bare.name, "--format", "onnx"), 2) == "error: --format 'onnx': use safetensors or hf"
