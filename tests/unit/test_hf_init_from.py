"""`[run] init_from` = a Hugging Face save_pretrained directory or a .safetensors file: the
learner loads it into the model `hf:` built (exactly; bf16 cast to fp32), the operator checks
and copies it by its headers alone (no torch), and a broken source is one line saying what."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from dldctl import extras, inventory, rundir
from dldctl.errors import ConfigError
from dldctl.lifecycle import initmodel as up_side
from dldctl.lifecycle import plan
from learner import config as learner_config
from learner import initmodel
from syncer.common import modelfile
from tests.hfmodels import tiny_gpt2_dir, tiny_llama_dir
from workload import hf

INVENTORY = """
[run]
model = "hf:{model}"
seq_len = 32
init_from = "{init}"
[[hosts]]
name = "a"
address = "local"
learners = 1
"""
ROOT = Path(__file__).resolve().parents[2]


def built(directory: Path, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return hf.build_model(str(directory), {})


def saved(tmp_path: Path, seed: int = 1, **save: object) -> tuple[Path, Path, torch.nn.Module]:
    """A tiny Llama's config dir, and a save_pretrained of its model under `seed` (its weights)."""
    config_dir = tiny_llama_dir(tmp_path / "config")
    model = built(config_dir, seed)
    weights = tmp_path / "weights"
    model.save_pretrained(str(weights), **save)
    return config_dir, weights, model


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    ours = dict(b.state_dict())
    return all(torch.equal(t, ours[n]) for n, t in a.state_dict().items())


def inv_with(tmp_path: Path, model: Path, init: Path) -> inventory.Inventory:
    path = tmp_path / "inv.toml"
    path.write_text(INVENTORY.format(model=model, init=init))
    return inventory.load(path)


# -- the learner: a save_pretrained directory loads into the fleet's model exactly -------------------
def test_a_save_pretrained_directory_loads_exactly(tmp_path: Path) -> None:
    config_dir, weights, source = saved(tmp_path)
    assert (weights / "model.safetensors").is_file()
    model = built(config_dir, 0)
    assert not same(model, source)
    said = initmodel.load(model, weights, str(weights))
    assert same(model, source) and model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert said == f"initialized from weights ({len(dict(model.named_parameters()))} tensors, safetensors weights)"


def test_a_sharded_save_loads_exactly_and_its_run_copy_is_one_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path / "home"))
    config_dir, weights, source = saved(tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in weights.glob("model-*.safetensors"))
    assert (weights / "model.safetensors.index.json").is_file() and len(shards) > 2
    model = built(config_dir, 0)
    initmodel.load(model, weights)
    assert same(model, source)
    # the operator: checked, copied into the run directory as one merged file the learner reads
    inv = inv_with(tmp_path, config_dir, weights)
    checked = up_side.check(inv)
    assert isinstance(checked, modelfile.Safetensors) and len(checked.files) == len(shards)
    run = rundir.create(inv.run.name)
    config = plan.write(inv, run)
    assert config.init_model == "init_model.safetensors"
    assert json.loads(run.config.read_text())["init_model"] == "init_model.safetensors"
    copy = learner_config.load(run.config, "learner-0").init_model
    assert copy == run.path.resolve() / "init_model.safetensors" and copy.is_file()
    fresh = built(config_dir, 0)
    initmodel.load(fresh, copy)
    assert same(fresh, source)
    from safetensors.torch import load_file  # the merged copy is a valid safetensors file

    assert set(load_file(str(copy))) == set(
        json.loads((weights / "model.safetensors.index.json").read_text())["weight_map"]
    )


def test_bf16_weights_load_into_the_fp32_model(tmp_path: Path) -> None:
    config_dir = tiny_gpt2_dir(tmp_path / "config")
    source = built(config_dir, 1).to(torch.bfloat16)
    source.save_pretrained(str(tmp_path / "weights"))
    header = modelfile.scan(tmp_path / "weights")
    assert {e.dtype for e in header.entries.values()} == {"BF16"}
    model = built(config_dir, 0)
    initmodel.load(model, tmp_path / "weights")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    ours = dict(model.named_parameters())
    assert all(torch.equal(ours[n], p.float()) for n, p in source.named_parameters())


def test_a_single_safetensors_file_and_dldctl_exports_metadata(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    config_dir = tiny_gpt2_dir(tmp_path / "config")
    source = built(config_dir, 3)
    tensors = {n: p.detach().contiguous() for n, p in source.named_parameters()}
    save_file(
        tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt", "run": "prev-1", "outer_step": "9"}
    )
    read = modelfile.read(tmp_path / "model.safetensors")
    assert read.exported and read.origin() == "from run prev-1 at outer step 9" and set(read.tensors) == set(tensors)
    model = built(config_dir, 0)
    initmodel.load(model, tmp_path / "model.safetensors")
    assert same(model, source)


def test_another_models_weights_name_the_tensor_and_the_shapes(tmp_path: Path) -> None:
    _, weights, _ = saved(tmp_path)
    other = hf.build_model(str(tiny_llama_dir(tmp_path / "wider")), {"intermediate_size": 96})
    with pytest.raises(
        initmodel.InitModelError,
        match=r"'model.layers.0.mlp.down_proj.weight' is \[64, 128\] in the file but \[64, 96\] in the model",
    ):
        initmodel.load(other, weights)


# -- broken sources: one line naming the file and what is wrong ------------------------------------
def broken(tmp_path: Path, case: str) -> tuple[Path, str]:
    """A broken init_from of kind `case`, and the words its error must hold."""
    if case == "empty-dir":
        tiny_llama_dir(tmp_path / "config")
        (tmp_path / "empty").mkdir()
        return tmp_path / "empty", "no weights in the directory"
    _, weights, _ = saved(tmp_path, max_shard_size="40KB")
    shards = sorted(weights.glob("model-*.safetensors"))
    if case == "shard-missing":
        shards[1].unlink()
        return weights, f"{shards[1]}: the shard is missing"
    if case == "not-safetensors":
        shards[0].write_bytes(b"PK\x03\x04 this is a zip, or anything else" * 10)
        return weights, f"{shards[0]}: not a safetensors file"
    if case == "header-not-json":
        shards[0].write_bytes((40).to_bytes(8, "little") + b"{not json at all" + b"x" * 100)
        return weights, f"{shards[0]}: not a safetensors file (its header is not JSON)"
    assert case == "cut-off"
    shards[0].write_bytes(shards[0].read_bytes()[:-100])
    return weights, f"{shards[0]}: tensor"


@pytest.mark.parametrize("case", ["empty-dir", "shard-missing", "not-safetensors", "header-not-json", "cut-off"])
def test_a_broken_source_is_one_line_at_up_and_at_the_learner(tmp_path: Path, case: str) -> None:
    path, words = broken(tmp_path, case)
    with pytest.raises(ConfigError) as err:
        up_side.check(inv_with(tmp_path, tmp_path / "config", path))
    line = err.value.line()
    assert line.startswith(f"{tmp_path / 'inv.toml'}: [run.init_from] "), line
    assert words in line and "\n" not in line and err.value.exit_code == 2
    with pytest.raises(initmodel.InitModelError, match="init model") as lerr:
        initmodel.load(torch.nn.Linear(2, 2), path)
    assert words in str(lerr.value) and "\n" not in str(lerr.value)


# -- the operator needs no torch for a safetensors source -------------------------------------------
NO_TORCH = """
import importlib.abc, sys

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
"""
CHECK_AND_COPY = """
import sys
from dldctl import inventory, rundir
from dldctl.lifecycle import initmodel, plan
inv = inventory.load(sys.argv[1])
print(initmodel.check(inv).describe())
run = rundir.create(inv.run.name)
print(plan.write(inv, run).init_model, "torch" in sys.modules)
"""


def test_check_and_copy_of_a_safetensors_source_need_no_torch(tmp_path: Path) -> None:
    config_dir, weights, source = saved(tmp_path, max_shard_size="40KB")
    inv = inv_with(tmp_path, config_dir, weights)
    assert "the check of [run] init_from" not in extras.torch_users(inv)  # headers only, no torch
    torch.save(source.state_dict(), tmp_path / "init.pt")
    assert "the check of [run] init_from" in extras.torch_users(inv_with(tmp_path, config_dir, tmp_path / "init.pt"))
    inv_with(tmp_path, config_dir, weights)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_TORCH)
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}", DLDCTL_HOME=str(tmp_path / "home"))
    proc = subprocess.run(
        [sys.executable, "-c", CHECK_AND_COPY, str(tmp_path / "inv.toml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    count = len(dict(source.named_parameters()))
    assert proc.stdout.split("\n")[:2] == [
        f"{count} safetensors tensors in {len(list(weights.glob('model-*')))} shards",
        "init_model.safetensors False",
    ]
    copy = next((tmp_path / "home").rglob("init_model.safetensors"))
    model = built(config_dir, 0)
    initmodel.load(model, copy)
    assert same(model, source)
