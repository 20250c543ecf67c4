"""The final model others can load, from a real local fleet: `dldctl down` writes
export/model.safetensors + config.json, the loader snippet of docs/model.md (run as written, in
its own Python) evaluates it to the held-out loss the syncer reported for it, and `dldctl export`
rebuilds the same tensors from final_model.pt and from the newest checkpoint.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dldctl.testing import DldctlHome, local_host, read_jsonl
from workload.presets import param_shapes

pytestmark = [pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
RUN = {  # gpt-tiny, plain averaging at H = 8, the global model scored every 2 outer steps
    "model": "gpt-tiny",
    "seq_len": 32,
    "batch_size": 8,
    "H": 8,
    "outer_lr": 1.0,
    "outer_momentum": 0.0,
    "eval_every": 20,
    "eval_batches": 2,
    "global_eval_every": 2,
    "quorum": 1,
    "warm_spares": False,
}


def loader_script() -> str:
    """The python blocks of docs/model.md's "Loading it" section, joined: the snippet as users read it."""
    text = (ROOT / "docs" / "model.md").read_text()
    section = text.split("## Loading it", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "docs/model.md: the loader and the evaluation snippet"
    return "\n".join(blocks)


def run_snippet(export_dir: Path, tmp_path: Path) -> float:
    script = tmp_path / "load_export.py"
    script.write_text(loader_script())
    proc = subprocess.run(
        [sys.executable, str(script), str(export_dir)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"held-out loss ([0-9.]+)", proc.stdout)
    assert match, proc.stdout
    return float(match.group(1))


def test_down_exports_a_model_the_documented_snippet_loads(tmp_path: Path) -> None:
    with DldctlHome(tmp_path / "home", name="export") as home:
        run = home.up(RUN, [local_host("here", 2)])
        home.wait(lambda s: s["loss"].get("global") is not None and s["syncer"]["outer_steps"] >= 8, 90, "scored")
        summary = home.down()
        weights, config_path = Path(summary["model_safetensors"]), Path(summary["model_config"])
        assert weights == run / "export" / "model.safetensors" and config_path == run / "export" / "config.json"
        config = json.loads(config_path.read_text())
        shapes = dict(param_shapes("gpt-tiny", vocab_size=256, block_size=32))
        with safe_open(str(weights), framework="pt") as f:
            assert set(f.keys()) == set(shapes) and f.metadata()["format"] == "pt"
            assert all(tuple(f.get_slice(n).get_shape()) == shapes[n] for n in shapes)
        assert config["gpt"]["n_head"] == 2 and config["gpt"]["block_size"] == 32 and config["vocab_size"] == 256
        assert config["params"] == sum(torch.Size(s).numel() for s in shapes.values())
        assert config["run"] == run.name and config["tokens_merged"] > 0
        # what the run reported for its final model: the syncer's last global-model evaluation
        final = [m for m in read_jsonl(run / "metrics.jsonl") if m.get("kind") == "global_eval"][-1]
        assert final["outer_step"] == config["outer_step"] and final["loss"] == config["held_out_loss"]
        assert abs(run_snippet(run / "export", tmp_path) - config["held_out_loss"]) < 1e-4

        exported = load_file(str(weights))
        copied = json.loads(home.dl("export", run.name, "--out", str(tmp_path / "copy"), "--json").stdout)
        assert copied["source"].startswith(str(run / "export")), copied
        assert load_file(copied["weights"]).keys() == exported.keys()
        for gone, source in ((["export"], "final_model.pt"), (["export", "final_model.pt"], "checkpoint")):
            for name in gone:
                _remove(run / name)
            doc = json.loads(home.dl("export", run.name, "--json").stdout)
            assert doc["schema"] == "dldctl.export/1" and source in doc["source"], doc
            again = load_file(doc["weights"])
            assert again.keys() == exported.keys() and all(torch.equal(again[k], exported[k]) for k in exported)
            assert doc["outer_step"] == config["outer_step"] and doc["held_out_loss"] == config["held_out_loss"]


def _remove(path: Path) -> None:
    if path.is_dir():
        for f in path.iterdir():
            f.unlink()
        path.rmdir()
    else:
        path.unlink()
