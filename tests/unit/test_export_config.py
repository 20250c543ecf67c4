"""The export's pure parts: config.json's contents (syncer/common/modelexport.py), the preset
completion (dldctl/lifecycle/export.py `complete`), the checkpoint header check, and the extra
fields final_model.pt now carries (syncer/common/modelfile.py)."""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

import pytest

from dldctl.lifecycle.export import complete
from syncer import checkpoint
from syncer.common import modelexport, modelfile
from workload.presets import PRESETS, param_shapes

SETTINGS = {"model": "gpt-tiny", "data": "builtin", "seq_len": 32, "batch_size": 8, "eval_batches": 2, "lr": 3e-3}


def config(model: str = "gpt-tiny", shapes: dict | None = None, loss: float | None = 2.5) -> dict:
    return modelexport.model_config(
        run="exp-20260101-000000",
        settings={**SETTINGS, "model": model},
        shapes=shapes if shapes is not None else dict(param_shapes("gpt-tiny", block_size=32)),
        outer_step=40,
        tokens_merged=12_800,
        held_out_loss=loss,
        source="final_model.pt",
        created=1.0,
    )


def test_config_says_what_the_tensors_are_and_how_far_the_run_got() -> None:
    c = config()
    shapes = dict(param_shapes("gpt-tiny", block_size=32))
    assert c["schema"] == "dldctl.model/1" and c["weights"] == "model.safetensors" and c["dtype"] == "float32"
    assert c["shape"] == {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_embd": 64, "bias": True}
    assert c["params"] == sum(math.prod(s) for s in shapes.values())
    assert c["tensors"] == len(shapes) and c["vocab_size"] == 256
    assert c["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    assert (c["run"], c["outer_step"], c["tokens_merged"], c["held_out_loss"]) == (
        "exp-20260101-000000",
        40,
        12_800,
        2.5,
    )
    assert c["held_out"] == {"data": "builtin", "seq_len": 32, "batch_size": 8, "eval_batches": 2}
    assert c["source"] == "final_model.pt" and c["dldctl_version"] not in ("", None)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_completed_to_the_config_that_builds_it(name: str) -> None:
    shapes = dict(param_shapes(name, vocab_size=512, block_size=64))
    done = complete(config(name, shapes))
    p = PRESETS[name]
    assert done["gpt"] == {
        "vocab_size": 512,
        "block_size": 64,
        "n_layer": p.n_layer,
        "n_head": p.n_head,
        "n_embd": p.n_embd,
        "dropout": p.dropout,
        "bias": p.bias,
    }


def test_a_users_model_has_no_gpt_shape_and_a_wrong_shape_is_refused() -> None:
    custom = config("mypkg.model:factory", {"encoder.weight": (4, 4), "head.bias": (4,)})
    assert custom["shape"] is None and custom["tied"] == {} and custom["params"] == 20
    assert complete(custom)["gpt"] is None
    small = dict(param_shapes("gpt-small", block_size=32))  # named gpt-tiny, shaped gpt-small
    with pytest.raises(ValueError, match=r"preset 'gpt-tiny'.*n_layer, n_embd"):
        complete(config("gpt-tiny", small))


@pytest.mark.parametrize(
    ("last", "expected"),
    [
        ({"outer_step": 40, "loss": 2.5, "good": True}, 2.5),
        ({"outer_step": 39, "loss": 2.5, "good": True}, None),  # a score of an earlier state
        ({"outer_step": 40, "loss": 9.0, "good": False}, None),  # flagged: rolled back, not this state
        (None, None),
    ],
)
def test_the_held_out_loss_is_only_the_exported_states(last: dict | None, expected: float | None) -> None:
    assert modelexport.final_loss(last, 40) == expected


def test_the_checkpoint_header_is_the_syncers() -> None:
    assert modelexport.CHECKPOINT_MAGIC == checkpoint.MAGIC
    body = b"torch body"
    data = checkpoint.MAGIC + hashlib.sha256(body).digest() + body
    assert modelexport.checkpoint_body(data, "ckpt-1.pt") == body
    with pytest.raises(modelexport.ExportError, match=r"ckpt-1\.pt: checksum mismatch"):
        modelexport.checkpoint_body(data[:-1], "ckpt-1.pt")
    with pytest.raises(modelexport.ExportError, match=r"ckpt-1\.pt: not a checkpoint"):
        modelexport.checkpoint_body(b"PK\x03\x04", "ckpt-1.pt")


def test_final_model_carries_tokens_and_loss() -> None:
    obj = {"state_dict": {"w": 1}, "outer_steps": 40, "run_id": "r", "tokens_merged": 7, "held_out_loss": 2.5}
    got = modelfile.unwrap(obj, lambda v: isinstance(v, int))
    assert (got.outer_steps, got.tokens_merged, got.held_out_loss) == (40, 7, 2.5)
    older = modelfile.unwrap({"state_dict": {"w": 1}, "outer_steps": 40}, lambda v: isinstance(v, int))
    assert older.tokens_merged is None and older.held_out_loss is None


def test_read_config_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"schema": "other"}')
    with pytest.raises(modelexport.ExportError, match=re.escape(f"{path}: not an export config")):
        modelexport.read_config(path)
    with pytest.raises(modelexport.ExportError, match="no such file"):
        modelexport.read_config(tmp_path / "none.json")
