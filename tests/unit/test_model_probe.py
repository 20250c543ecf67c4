"""The run's model as the operator checks it: the `[model]` table and an `hf:` directory in the
inventory (dldctl/modelspec.py, torch-free), the probe's verdicts (dldctl/lifecycle/modelprobe.py
`judge`, pure), and the probe itself as the process `check` and `up` run (workload/probe.py): a
transformers model whose loss shifts the targets twice is caught."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dldctl import inventory
from dldctl.errors import ConfigError
from dldctl.hosts import LocalHost
from dldctl.lifecycle import modelprobe
from tests import hfmodels
from workload import probe

ROOT = Path(__file__).resolve().parents[2]


def load(tmp_path: Path, run: str, extra: str = "") -> inventory.Inventory:
    path = tmp_path / "inv.toml"
    path.write_text(f'[run]\n{run}\nfragments = 2\nH = 8\n\n[[hosts]]\nname = "a"\naddress = "local"\n{extra}')
    return inventory.load(path)


def test_model_table_reaches_the_inventory_and_its_json(tmp_path: Path) -> None:
    inv = load(tmp_path, 'model = "pkg.mod:factory"', '\n[model]\nhidden = 48\nlayers = [1, 2]\nname = "x"\n')
    assert inv.model_args == {"hidden": 48, "layers": [1, 2], "name": "x"}
    again = inventory.parse(inventory.to_dict(inv), "x")
    assert again.model_args == inv.model_args


def test_model_table_refuses_what_config_json_cannot_carry(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.when.*date"):
        inventory.parse({"run": {}, "model": {"when": datetime.date(2026, 1, 1)}}, "inv.toml")
    with pytest.raises(ConfigError, match="built-in preset: it takes no \\[model\\] keys"):
        load(tmp_path, 'model = "gpt-tiny"', "\n[model]\nhidden = 1\n")


def test_hf_directory_is_checked_torch_free_and_made_absolute(tmp_path: Path) -> None:
    hfmodels.tiny_llama_dir(tmp_path / "llama")
    inv = load(tmp_path, 'model = "hf:llama"\nseq_len = 64')
    assert inv.run.model == f"hf:{tmp_path / 'llama'}"
    with pytest.raises(ConfigError, match=r"run\.seq_len.*longer than the model's 128 positions"):
        load(tmp_path, 'model = "hf:llama"\nseq_len = 256')
    with pytest.raises(ConfigError, match="no such directory"):
        load(tmp_path, 'model = "hf:nothere"')
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        load(tmp_path, 'model = "hf:empty"')
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "m.M"}}))
    with pytest.raises(ConfigError, match="auto_map"):
        load(tmp_path, 'model = "hf:remote"')


def test_workdir_is_taken_from_the_inventory_directory(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    inv = load(tmp_path, 'model = "m:f"\nworkdir = "code"')
    assert inv.run.workdir == str(tmp_path / "code")
    with pytest.raises(ConfigError, match=r"run\.workdir.*no such directory"):
        load(tmp_path, 'model = "m:f"\nworkdir = "nope"')


def answer(host: str, **data: object) -> modelprobe.Answer:
    target = modelprobe.Target(host, ("learner",), "py", "", None, lambda: LocalHost(host))
    return modelprobe.Answer(target, dict(data))


def test_judge_names_the_host_and_tells_failures_from_not_yet() -> None:
    good = {"ok": True, "tensors": 7, "params": 10, "manifest": "aa"}
    assert modelprobe.judge([answer("a", **good), answer("b", **good)], 4) == []
    failed = answer("b", ok=False, stage="build", error="ValueError: boom")
    assert modelprobe.judge([answer("a", **good), failed], 4) == [
        f"host b (learner): ValueError: boom; {modelprobe.FIX['build']}"
    ]
    later = answer("c", ok=False, stage="missing", error="ModuleNotFoundError: numpy")
    assert modelprobe.judge([answer("a", **good), later], 4) == [] and later.unprobed
    other = answer("b", **{**good, "manifest": "bb", "tensors": 8})
    (line,) = modelprobe.judge([answer("a", **good), other], 4)
    assert "differ between hosts" in line and "a: 7 tensors (aa)" in line and "b: 8 tensors (bb)" in line
    assert modelprobe.judge([answer("a", **good)], 8) == [
        "[run] fragments = 8 but the model has only 7 parameter tensors"
    ]


def test_double_shift_is_told_only_when_the_two_losses_differ() -> None:
    assert probe.double_shift(5.0, 4.9, 5.0)
    assert not probe.double_shift(4.9, 4.9, 5.0)
    assert not probe.double_shift(5.0, 5.0, 5.0)  # cannot tell: not flagged


FACTORY = """
from workload import hf

def shifted_again(model, batch):
    x, y = batch
    return model(input_ids=x, labels=y).loss

def wrong(ctx):
    inner = hf.hf_workload(ctx)
    inner.loss = shifted_again
    return inner

def right(ctx):
    return hf.hf_workload(ctx)
"""


@pytest.mark.timeout(180)
def test_the_probe_process_catches_a_loss_that_shifts_twice(tmp_path: Path) -> None:
    text = hfmodels.sample_text(tmp_path / "corpus.txt", 60_000)
    model_dir = hfmodels.tiny_gpt2_dir(tmp_path / "gpt2", tokenizer_text=text)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "hfwrap.py").write_text(FACTORY)
    settings = {"data": str(text), "seed": 0, "seq_len": 32, "batch_size": 4, "eval_batches": 1}
    for name, ok in (("wrong", False), ("right", True)):
        spec = {"settings": {**settings, "model": f"hfwrap:{name}"}}
        out = subprocess.run(
            [sys.executable, "-m", "workload.probe"],
            input=json.dumps({**spec, "model_dir": str(model_dir), "shards": 2}),
            env={"PYTHONPATH": f"{tmp_path / 'code'}:{ROOT}", "DLDCTL_CACHE": str(tmp_path / "cache")},
            capture_output=True,
            text=True,
            check=True,
        )
        answer = json.loads(out.stdout.strip().splitlines()[-1])
        assert answer["ok"] is ok, answer
        if not ok:
            assert answer["stage"] == "loss" and "shifts the targets a second time" in answer["error"]
            assert "causal_lm_loss" in answer["error"]
