"""`[run] init_from`: which files are model files (syncer/common/modelfile.py), the learner's
matching rules and its load (learner/initmodel.py), and the operator's side at `up`: a bad file
is one line naming the inventory, the key and the file; a good one is copied into the run
directory, named in config.json relative to it, and pushed with the run files."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from dldctl import inventory, rundir
from dldctl.errors import ConfigError
from dldctl.hosts import LocalHost
from dldctl.lifecycle import initmodel as up_side
from dldctl.lifecycle import plan, provision
from dldctl.lifecycle import up as up_mod
from learner import config as learner_config
from learner import initmodel
from learner.initmodel import Slot
from syncer.common import modelfile
from workload import gpt

INVENTORY = """
[run]
model = "gpt-tiny"
seq_len = 32
init_from = "{init}"
[[hosts]]
name = "a"
address = "local"
learners = 1
"""


class Tied(torch.nn.Module):
    """A model with a tied weight (as GPT's head) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.norm = torch.nn.LayerNorm(3)
        self.register_buffer("scale", torch.ones(3))


# -- the file: which layouts are model files ------------------------------------------------------
def test_a_plain_state_dict_and_a_final_model_unwrap() -> None:
    t = torch.zeros(2)
    plain = modelfile.unwrap({"w": t}, torch.is_tensor)
    assert plain.tensors == {"w": t} and not plain.exported and plain.origin() == "a plain state dict"
    final = modelfile.unwrap(
        {"state_dict": {"w": t}, "outer_steps": 88, "versions": [3], "run_id": "exp-1"}, torch.is_tensor
    )
    assert final.exported and final.tensors == {"w": t}
    assert final.origin() == "from run exp-1 at outer step 88"


@pytest.mark.parametrize(
    ("obj", "why"),
    [
        ([1, 2], "holds a list, not a state dict"),
        ({}, "holds no tensors"),
        ({"state_dict": {}}, "its 'state_dict' holds no tensors"),
        ({"w": torch.zeros(1), "epoch": 3}, "maps 'epoch' to a int, not a tensor"),
        ({"state_dict": {"w": [1.0]}}, "its 'state_dict' maps 'w' to a list"),
    ],
)
def test_what_is_not_a_model_file_says_why(obj: object, why: str) -> None:
    with pytest.raises(modelfile.ModelFileError, match=why):
        modelfile.unwrap(obj, torch.is_tensor)


class Opaque:
    """Pickled as an object: torch.load(weights_only=True) refuses it."""


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "ends early"),
        (b"hello, not a model\n", "not a torch file"),
        (Opaque(), "holds pickled objects, not only tensors"),
    ],
)
def test_read_a_bad_file_is_one_line_naming_it(tmp_path: Path, content: object, why: str) -> None:
    path = tmp_path / "bad.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save({"w": content}, path)
    with pytest.raises(modelfile.ModelFileError) as err:
        modelfile.read(path)
    assert str(err.value).startswith(f"{path}: ") and why in str(err.value) and "\n" not in str(err.value)


# -- the matching rules (pure) ---------------------------------------------------------------------
MODEL = {
    "emb.weight": Slot((5, 3), "E"),
    "head.weight": Slot((5, 3), "E"),  # tied to emb.weight
    "norm.weight": Slot((3,), "N"),
    "scale": Slot((3,), "S", parameter=False),
}


def test_a_file_that_matches_fits() -> None:
    assert initmodel.match({n: s.shape for n, s in MODEL.items()}, MODEL) == []


def test_a_tied_weight_may_be_missing_but_not_an_untied_one() -> None:
    assert initmodel.match({"head.weight": (5, 3), "norm.weight": (3,), "scale": (3,)}, MODEL) == []
    problems = initmodel.match({"emb.weight": (5, 3), "scale": (3,)}, MODEL)
    assert problems == ["the model's parameter 'norm.weight' [3] is not in the file (nor tied to a tensor that is)"]


def test_a_missing_buffer_only_in_a_file_down_exported() -> None:
    params = {"emb.weight": (5, 3), "norm.weight": (3,)}
    assert initmodel.match(params, MODEL, exported=True) == []
    assert initmodel.match(params, MODEL) == [
        "the model's buffer 'scale' [3] is not in the file (nor tied to a tensor that is)"
    ]


def test_a_wrong_shape_names_the_tensor_and_both_shapes() -> None:
    problems = initmodel.match({"emb.weight": (6, 3), "norm.weight": (3,), "scale": (3,)}, MODEL)
    assert problems == ["tensor 'emb.weight' is [6, 3] in the file but [5, 3] in the model"]


def test_an_unknown_name_is_named_with_the_close_one() -> None:
    problems = initmodel.match({"module.emb.weight": (5, 3), "norm.weight": (3,), "scale": (3,)}, MODEL)
    assert (
        problems[0] == "tensor 'module.emb.weight' [5, 3] of the file is not in the model (did you mean 'emb.weight'?)"
    )
    assert len(problems) == 2  # and emb.weight is missing


# -- the learner's load -----------------------------------------------------------------------------
def test_slots_see_ties_and_buffers() -> None:
    got = initmodel.slots(Tied())
    assert got["emb.weight"].storage == got["head.weight"].storage != got["norm.weight"].storage
    assert got["emb.weight"].parameter and not got["scale"].parameter


def test_load_copies_a_final_model_into_the_model_and_its_tie(tmp_path: Path) -> None:
    torch.manual_seed(1)
    src = gpt.build("gpt-tiny", block_size=32)
    params = {n: p.detach().clone() for n, p in src.named_parameters()}  # as export_model: no lm_head
    assert "lm_head.weight" not in params
    path = tmp_path / "final_model.pt"
    torch.save({"state_dict": params, "outer_steps": 7, "versions": [1], "run_id": "prev-1"}, path)
    torch.manual_seed(0)
    model = gpt.build("gpt-tiny", block_size=32)
    said = initmodel.load(model, path, "/data/final_model.pt")
    assert said == f"initialized from final_model.pt ({len(params)} tensors, from run prev-1 at outer step 7)"
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert torch.equal(model.lm_head.weight, params["transformer.wte.weight"])


def test_load_of_another_model_is_one_line_naming_the_file_tensor_and_shapes(tmp_path: Path) -> None:
    path = tmp_path / "init_model.pt"
    torch.save(gpt.build("gpt-tiny", block_size=32).state_dict(), path)
    model = gpt.build("gpt-tiny", block_size=64)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(initmodel.InitModelError) as err:
        initmodel.load(model, path, "/data/x.pt")
    line = str(err.value)
    assert line == (
        f"init model {path} (init_from /data/x.pt): tensor 'transformer.wpe.weight' is [32, 64] in the file "
        "but [64, 64] in the model; init_from must hold this run's model"
    )
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())  # nothing half-copied
    with pytest.raises(initmodel.InitModelError, match="no such file"):
        initmodel.load(model, tmp_path / "gone.pt")


# -- the operator's side: `up` ----------------------------------------------------------------------
def inv_with(tmp_path: Path, init: str) -> inventory.Inventory:
    path = tmp_path / "inv.toml"
    path.write_text(INVENTORY.format(init=init))
    return inventory.load(path)


def test_up_refuses_a_bad_file_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "bad.pt").write_bytes(b"not a model")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    for name, why in (("bad.pt", "not a torch file"), ("list.pt", "holds a list"), ("gone.pt", "no such file")):
        with pytest.raises(ConfigError) as err:
            up_side.check(inv_with(tmp_path, name))
        line = err.value.line()
        assert line.startswith(f"{tmp_path / 'inv.toml'}: [run.init_from] {tmp_path / name}: "), line
        assert why in line and "\n" not in line and err.value.exit_code == 2


def test_up_checks_the_file_before_it_makes_a_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path / "home"))
    (tmp_path / "notes.pt").write_text("not a model\n")

    def too_early(*_: object) -> None:  # without the check, `up` would go on to start a fleet
        raise AssertionError("up made a run directory before it checked init_from")

    monkeypatch.setattr(up_mod, "create_run", too_early)
    with pytest.raises(ConfigError, match=r"\[run.init_from\] .*notes.pt: not a torch file"):
        up_mod.up(inv_with(tmp_path, "notes.pt"), None, Console(file=io.StringIO()))


def test_a_good_file_is_copied_named_in_the_config_and_pushed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path / "home"))
    torch.save({"w": torch.arange(4.0)}, tmp_path / "init.pt")
    inv = inv_with(tmp_path, "init.pt")
    assert up_side.check(inv) is not None
    assert any("init_from " + str(tmp_path / "init.pt") in line for line in plan.describe(inv))
    run = rundir.create(inv.run.name)
    config = plan.write(inv, run)
    assert config.init_model == "init_model.pt" and json.loads(run.config.read_text())["init_model"] == "init_model.pt"
    assert (run.path / "init_model.pt").read_bytes() == (tmp_path / "init.pt").read_bytes()
    assert learner_config.load(run.config, "learner-0").init_model == run.path.resolve() / "init_model.pt"
    remote = tmp_path / "remote" / "runs" / config.run_id
    provision.push_run_files(LocalHost("h"), run, str(remote), ["learner-0"], config)
    assert (remote / "init_model.pt").read_bytes() == (tmp_path / "init.pt").read_bytes()
    assert learner_config.load(remote / "config.json", "learner-0").init_model == remote.resolve() / "init_model.pt"


def test_without_init_from_nothing_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path / "home"))
    inv = inventory.default_inventory()
    assert up_side.check(inv) is None and not any("init_from" in line for line in plan.describe(inv))
    run = rundir.create(inv.run.name)
    config = plan.write(inv, run)
    assert config.init_model is None and "init_model" not in json.loads(run.config.read_text())
    assert not (run.path / "init_model.pt").exists()
    assert learner_config.load(run.config, "learner-0").init_model is None
