"""A team's own model through the real CLI, on this machine and a real sshd host (127.0.0.2):

- `model = "hf:./tiny-llama"` (a transformers LlamaConfig directory with a tokenizer trained on
  the data) with `[model]` overrides: built by the learners on both hosts and by the syncer,
  scored by the syncer throughout (`loss.global` in `status --json`), exported with `dldctl
  export --format hf` and loaded back with `AutoModelForCausalLM` / `AutoTokenizer`;
- a factory in a `[run] workdir` (no PYTHONPATH anywhere: the workdir is shipped to every host),
  its `[model]` keys reaching the factory, the syncer importing it too;
- a factory that cannot be imported, refused by `check` and `up --dry-run` with the host named,
  before anything starts.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from dldctl.testing import DldctlHome
from tests import hfmodels
from tests.e2e.fleetutil import ROOT, host_entry, run_table
from tests.sshfleet import SSHFleet

pytestmark = [pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's project: text data, a tiny Llama config with its tokenizer, a factory package."""
    root = tmp_path_factory.mktemp("project")
    text = hfmodels.sample_text(root / "corpus.txt", 300_000)
    hfmodels.tiny_llama_dir(root / "tiny-llama", vocab_size=384, tokenizer_text=text)
    pkg = root / "code" / "myproj"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    source = (ROOT / "examples" / "custom_model.py").read_text()
    wide = source.replace("model = CharGRU().to(", "model = CharGRU(hidden=int(ctx.model_args['hidden'])).to(")
    assert wide != source
    (pkg / "gru.py").write_text(wide)
    (root / "code" / "data.bin").write_bytes(b"\0" * 1000)
    (root / "code" / ".dldctlignore").write_text("*.bin\n")
    return root


def header(fleet: SSHFleet, name: str, **run: object) -> str:
    first = fleet.hosts[0]
    return (
        run_table(name, **run)
        + f"""
[ssh]
user = "{first.user}"
identity_file = "{first.identity_file}"
known_hosts = "{first.known_hosts}"
use_ssh_config = false

[[hosts]]
name = "here"
address = "local"
learners = 1
"""
    )


def test_a_factory_that_cannot_be_imported_is_refused_before_anything_starts(
    ssh_fleet: SSHFleet, tmp_path: Path
) -> None:
    inv = tmp_path / "inventory.toml"
    inv.write_text(
        header(ssh_fleet, "noimport", model="nosuch.mod:factory")
        + host_entry("far", ssh_fleet.hosts[0], tmp_path / "w")
    )
    with DldctlHome(tmp_path / "home") as dl:
        out = dl("up", str(inv), "--dry-run", check=False)
        assert out.returncode == 1, out.stdout + out.stderr
        err = out.stderr.strip().splitlines()[-1]
        assert "the model does not build" in err and "cannot import module 'nosuch.mod'" in err, err
        assert re.search(r"host (here|far|local) \((learner|syncer)", err), err
        for host in ("here", "far"):  # every side named, the SSH host probed over SSH
            assert f"model on host {host}" in out.stdout, out.stdout
        checked = dl("check", str(inv), "--json", check=False)
        assert checked.returncode == 1 and "the model does not build" in checked.stderr
        record = json.loads(checked.stdout)
        assert record["ok"] is False and "cannot import module 'nosuch.mod'" in record["model_problems"][0]
        assert {p["host"] for p in record["model"]} >= {"here", "far"}
        assert not (tmp_path / "home" / "runs").exists() or not list((tmp_path / "home" / "runs").iterdir())


def test_an_hf_model_trains_on_two_hosts_scored_throughout_and_comes_back_to_transformers(
    ssh_fleet: SSHFleet, project: Path, tmp_path: Path
) -> None:
    inv = tmp_path / "inventory.toml"
    shutil.copytree(project / "tiny-llama", tmp_path / "tiny-llama")
    run = dict(model="hf:tiny-llama", data=str(project / "corpus.txt"), global_eval_every=4, seq_len=64)
    inv.write_text(
        header(ssh_fleet, "hfllama", **run)
        + host_entry("far", ssh_fleet.hosts[0], tmp_path / "w")
        + "\n[model]\nintermediate_size = 96\n"
    )
    with DldctlHome(tmp_path / "home") as dl:
        dry = dl("up", str(inv), "--dry-run").stdout
        assert "model on host far (learner): 20 tensors" in dry, dry
        dl("up", str(inv), "--wait", "--timeout", "240")
        snap = dl.wait(lambda s: s["loss"]["global"] is not None and s["syncer"]["outer_steps"] >= 8, 150, "a score")
        assert snap["loss"].get("global_off") is None
        config = dl.config()
        assert config.model_args == {"intermediate_size": 96} and config.model_dir == "hf_model"
        assert (dl.run_dir / "hf_model" / "tokenizer.json").is_file()
        summary = json.loads(dl("down", "--json").stdout)
        assert summary["loss_global"] is not None
        out = tmp_path / "exported"
        doc = json.loads(dl("export", summary["run"], "--format", "hf", "--out", str(out), "--json").stdout)
        assert dl.leftovers() == []
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.intermediate_size == 96
    assert AutoTokenizer.from_pretrained(str(out)).encode("def main():")
    assert doc["held_out_loss"] is not None and abs(doc["verified_loss"] - doc["held_out_loss"]) <= 1e-4


def test_a_factory_in_a_shipped_workdir_runs_everywhere_with_its_model_args(
    ssh_fleet: SSHFleet, project: Path, tmp_path: Path
) -> None:
    inv = tmp_path / "inventory.toml"
    run = dict(model="myproj.gru:factory", workdir=str(project / "code"), global_eval_every=4)
    inv.write_text(
        header(ssh_fleet, "workdir", **run)
        + host_entry("far", ssh_fleet.hosts[0], tmp_path / "w")
        + "\n[model]\nhidden = 48\n"
    )
    with DldctlHome(tmp_path / "home") as dl:
        up = dl("up", str(inv), "-d").stdout
        assert re.search(r"far: shipped 3 files", up), up
        dl.wait(lambda s: s["loss"]["global"] is not None and s["syncer"]["outer_steps"] >= 8, 150, "a score")
        code = {r.runtime.code for r in dl.state().hosts.values()}
        assert len({Path(c).name for c in code}) == 1 and all(c for c in code)  # one snapshot, on every host
        assert not any(Path(c, "data.bin").exists() for c in code)  # .dldctlignore
        summary = json.loads(dl("down", "--json").stdout)
        final = torch.load(summary["final_model"], weights_only=True)["state_dict"]
        assert tuple(final["rnn.weight_hh_l0"].shape) == (3 * 48, 48)  # [model] hidden reached the factory
        assert not any(name.startswith("transformer.") for name in final)  # the user's model, not a GPT
        assert dl.leftovers() == []
    assert "PYTHONPATH" not in inv.read_text() and str(project) not in sys.path
