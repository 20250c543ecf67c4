"""The Hugging Face export's parts: the preset -> GPT2LMHeadModel mapping computes the same logits
as the built-in GPT (with and without biases), the written directory loads back with
AutoModelForCausalLM as a GPT2LMHeadModel, a tensor that does not fit is named, `judge`
passes a loss within 1e-3 relative of the run's and fails one beyond it, and a Python without
transformers (or torch) gets one line with the pip command.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

from dldctl import rundir
from dldctl.lifecycle import hfexport as dl_hfexport
from dldctl.runstate import RunState
from syncer.common.resolved import ResolvedConfig, SyncerSection
from syncer.common.settings import RunSettings
from tests import hfmodels
from workload import hf, hfexport
from workload.gpt import GPT, GPTConfig, build

pytestmark = [pytest.mark.timeout(120)]


def trained_like(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Parameters moved off their init (biases and LayerNorms too, so a dropped or untransposed
    tensor shows): what a few thousand steps would leave, without the steps."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x) if isinstance(model, GPT) else model(input_ids=x).logits
    return out[0] if isinstance(out, tuple) else out


@pytest.fixture
def tiny() -> tuple[GPT, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build("gpt-tiny", vocab_size=256, block_size=32).eval()
    return model, trained_like(model, 1)


def test_a_preset_is_a_gpt2_with_the_same_logits(tiny: tuple[GPT, dict[str, torch.Tensor]]) -> None:
    model, tensors = tiny
    assert "lm_head.weight" not in tensors  # the tied head is stored once, as wte
    hf = hfexport.gpt2_model("gpt-tiny", tensors)
    assert isinstance(hf, GPT2LMHeadModel) and hf.lm_head.weight is hf.transformer.wte.weight
    c = hf.config
    assert (c.n_embd, c.n_layer, c.n_head, c.n_positions, c.vocab_size) == (64, 2, 2, 32, 256)
    assert c.activation_function == "gelu" and c.layer_norm_epsilon == 1e-5 and c.tie_word_embeddings
    # a Conv1D weight is the nn.Linear one transposed: (in, out)
    assert hf.transformer.h[0].attn.c_attn.weight.shape == (64, 192)
    assert torch.equal(hf.transformer.h[1].mlp.c_fc.weight, tensors["transformer.h.1.mlp.c_fc.weight"].t())
    x = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits(hf, x), logits(model, x), atol=1e-5, rtol=1e-5)


def test_the_written_directory_loads_back_as_gpt2(tmp_path: Path, tiny: tuple[GPT, dict[str, torch.Tensor]]) -> None:
    model, tensors = tiny
    files = hfexport.write(hfexport.gpt2_model("gpt-tiny", tensors), tmp_path / "out", None)
    assert {"config.json", "model.safetensors"} <= set(files)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(loaded) is GPT2LMHeadModel and next(loaded.parameters()).dtype == torch.float32
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(logits(loaded, x), logits(model, x), atol=1e-5, rtol=1e-5)
    assert type(hfexport.load_back(tmp_path / "out")) is GPT2LMHeadModel


def test_a_gpt_without_biases_maps_with_zero_biases() -> None:
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
    torch.manual_seed(4)
    model = GPT(cfg).eval()
    tensors = trained_like(model, 5)
    hf = GPT2LMHeadModel(hfexport.gpt2_config(cfg)).eval()
    hfexport.load_parameters(hf, hfexport.gpt2_tensors(tensors, cfg), "test")
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(logits(hf, x), logits(model, x), atol=1e-5, rtol=1e-5)


def test_a_tensor_that_does_not_fit_is_named(tiny: tuple[GPT, dict[str, torch.Tensor]]) -> None:
    _, tensors = tiny
    missing = {k: v for k, v in tensors.items() if k != "transformer.h.1.ln_2.bias"}
    with pytest.raises(
        hfexport.HFExportError, match=re.escape("no trained tensor for parameter 'transformer.h.1.ln_2.bias'")
    ):
        hfexport.gpt2_model("gpt-tiny", missing)
    bent = {**tensors, "transformer.h.0.mlp.c_proj.bias": torch.zeros(65)}
    with pytest.raises(hfexport.HFExportError, match=re.escape("'transformer.h.0.mlp.c_proj.bias' has shape (65,)")):
        hfexport.gpt2_model("gpt-tiny", bent)
    extra = {**tensors, "transformer.h.2.ln_1.weight": torch.ones(64)}
    with pytest.raises(
        hfexport.HFExportError, match=re.escape("'transformer.h.2.ln_1.weight', which the model has no")
    ):
        hfexport.gpt2_model("gpt-tiny", extra)
    longer = {**tensors, "transformer.wpe.weight": torch.zeros(200, 64)}  # gpt-tiny has at most 128 positions
    with pytest.raises(hfexport.HFExportError, match="do not fit preset gpt-tiny"):
        hfexport.gpt2_model("gpt-tiny", longer)


def test_an_hf_model_gets_every_parameter_an_untied_head_included(tmp_path: Path) -> None:
    user_dir = hfmodels.tiny_gpt2_dir(tmp_path / "gpt2", vocab_size=300, tie_word_embeddings=False)
    torch.manual_seed(7)
    trained = hf.build_model(str(user_dir), {"n_layer": 1}).eval()
    tensors = trained_like(trained, 8)
    assert "lm_head.weight" in tensors  # untied: its own parameter, which must arrive
    run = hfexport.RunModel(f"hf:{user_dir}", {}, {"n_layer": 1}, user_dir)
    model = hfexport.hf_model(run, tensors)
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.n_layer == 1
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(logits(model, x), logits(trained, x), atol=1e-5, rtol=1e-5)
    headless = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    with pytest.raises(hfexport.HFExportError, match=re.escape("no trained tensor for parameter 'lm_head.weight'")):
        hfexport.hf_model(run, headless)


def test_judge_passes_the_run_loss_and_fails_a_wrong_one() -> None:
    done = {"verification": "done", "verified_loss": 2.50001, "reference_loss": 2.5}
    assert dl_hfexport.judge(done, 2.5) == (None, pytest.approx(1e-5))
    assert dl_hfexport.judge(done, None) == (None, None)  # no reported loss: the reference still checks
    problem, diff = dl_hfexport.judge({**done, "verified_loss": 2.51}, 2.5)
    assert problem and "2.510000" in problem and "reported" in problem and diff == pytest.approx(0.01)
    problem, _ = dl_hfexport.judge({**done, "verified_loss": 2.51, "reference_loss": 2.5}, None)
    assert problem and "the same tensors" in problem
    assert (
        dl_hfexport.judge({**done, "verified_loss": None}, 2.5)[0] == "loaded back, it scores no finite held-out loss"
    )
    assert dl_hfexport.judge({"verification": "skipped", "why": "no data"}, 2.5) == (None, None)
    assert dl_hfexport.judge({"verification": "off"}, 2.5) == (None, None)


BLOCK = """
import importlib.abc, sys

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Block())
"""


@pytest.mark.parametrize(("blocked", "fix"), [({"transformers"}, "hf"), ({"torch", "transformers"}, "train,hf")])
def test_without_transformers_one_line_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocked: set[str], fix: str
) -> None:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path / "home"))
    run = rundir.create("exp")
    with run.locked():
        run.write_state(RunState(status="down", run="exp", created=1.0, stopped_at=2.0))
    settings = RunSettings(name="exp", model="gpt-tiny", seq_len=32, batch_size=8, fragments=4)
    run.write_config(ResolvedConfig(run_id="exp-1", run=settings, syncer=SyncerSection(port=1, control_port=2)))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK.format(blocked=sorted(blocked)))
    env = {**os.environ, "PYTHONPATH": str(site), "COLUMNS": "300"}
    dldctl = str(Path(sys.executable).parent / "dldctl")
    proc = subprocess.run(
        [dldctl, "export", run.name, "--format", "hf"], env=env, capture_output=True, text=True, timeout=120
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"needs {' and '.join(sorted(blocked))}" in lines[0] and f"pip install 'dldctl[{fix}]'" in lines[0]
    assert not (run.path / "export").exists()  # nothing done before the check
