"""The final model others can load: `export/model.safetensors` + `export/config.json` (a leaf).

Written by the syncer when `dldctl down` stops it (syncer/checkpoint.py `export_model`, next to
final_model.pt, which `init_from` still reads) and by `dldctl export RUN` (from final_model.pt or
the newest checkpoint, dldctl/lifecycle/export.py):

    <run>/export/model.safetensors   {parameter name: fp32 tensor}, named as in the model's
                                     named_parameters(); a tied weight once (GPT: no lm_head.weight)
    <run>/export/config.json         what the tensors are (CONFIG_SCHEMA, docs/model.md)

`model_config` (pure) builds the config record (a null `held_out_loss` comes with
`held_out_loss_missing`, why), `gpt_shape` reads a built-in GPT's shape off its tensor shapes,
`final_loss` says whether the guard's last score is the exported state's (`no_final_loss` why not), and
`checkpoint_body` checks a syncer checkpoint's header (MAGIC | sha256(body) | body) without torch.
`write` is the one write: safetensors is imported there, so importing this module needs neither
torch nor safetensors.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from syncer.common import strictjson, unscored
from syncer.common.atomic import atomic_write

EXPORT_DIR = "export"  # in the run directory
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
FINAL_MODEL = "final_model.pt"  # the torch file beside it (init_from reads it)
CONFIG_SCHEMA = "dldctl.model/1"
CHECKPOINT_MAGIC = b"DLDCKPT1"  # syncer/checkpoint.py MAGIC (a unit test keeps the two equal)
HELD_OUT_KEYS = ("data", "seq_len", "batch_size", "eval_batches")  # the settings that pick the held-out batches
_LAYER = re.compile(r"transformer\.h\.(\d+)\.ln_1\.weight")


class ExportError(ValueError):
    """An export file that cannot be read or written; the message names the file."""


def gpt_shape(shapes: Mapping[str, Sequence[int]]) -> dict[str, Any] | None:
    """vocab_size, block_size, n_layer, n_embd, bias of a built-in GPT's parameters (None: not one).
    n_head is not in the shapes: the preset table has it (dldctl completes the config with it)."""
    wte, wpe = shapes.get("transformer.wte.weight"), shapes.get("transformer.wpe.weight")
    if wte is None or wpe is None or len(wte) != 2 or len(wpe) != 2:
        return None
    layers = {int(m.group(1)) for n in shapes if (m := _LAYER.fullmatch(n))}
    return {
        "vocab_size": int(wte[0]),
        "block_size": int(wpe[0]),
        "n_layer": len(layers),
        "n_embd": int(wte[1]),
        "bias": "transformer.ln_f.bias" in shapes,
    }


def final_loss(guard_last: Mapping[str, Any] | None, outer_step: int) -> float | None:
    """The held-out loss of the state at `outer_step`, if the guard's last score is of it and good."""
    if not guard_last or guard_last.get("outer_step") != outer_step or not guard_last.get("good"):
        return None
    loss = guard_last.get("loss")
    return float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None


def no_final_loss(guard_last: Mapping[str, Any] | None, outer_step: int) -> str:
    """Why `final_loss` has none for the state at `outer_step` (pure)."""
    if not guard_last:
        return "the global model was never scored"
    if guard_last.get("outer_step") != outer_step:
        return f"the last score was of outer step {guard_last.get('outer_step')}, not of the exported {outer_step}"
    return f"the quality guard flagged this state's score ({guard_last.get('loss')})"


def model_config(
    *,
    run: str,
    settings: Mapping[str, Any],
    shapes: Mapping[str, Sequence[int]],
    outer_step: int,
    tokens_merged: int | None,
    held_out_loss: float | None,
    source: str,
    created: float,
    held_out_loss_missing: str | None = None,
) -> dict[str, Any]:
    """The config.json record of an export (pure). `source`: what the tensors were read from;
    `held_out_loss_missing`: why there is no loss (default: the settings' global_eval_every = 0,
    else "not scored")."""
    shape = gpt_shape(shapes)
    params = 0
    for dims in shapes.values():
        n = 1
        for d in dims:
            n *= int(d)
        params += n
    return {
        "schema": CONFIG_SCHEMA,
        "weights": WEIGHTS,
        "format": "safetensors",
        "dtype": "float32",
        "model": str(settings.get("model", "")),
        "shape": shape,  # None for a user's own model ("package.module:factory")
        "vocab_size": shape["vocab_size"] if shape else None,
        "params": params,
        "tensors": len(shapes),
        "tied": {"lm_head.weight": "transformer.wte.weight"} if shape else {},
        "run": run,
        "outer_step": int(outer_step),
        "tokens_merged": tokens_merged,
        "held_out_loss": held_out_loss,  # the syncer's global-model evaluation of exactly these weights
        "held_out_loss_missing": None if held_out_loss is not None else _missing(settings, held_out_loss_missing),
        "held_out": {k: settings.get(k) for k in HELD_OUT_KEYS},
        "source": source,
        "dldctl_version": version(),
        "created": created,
    }


def _missing(settings: Mapping[str, Any], said: str | None) -> str:
    every = settings.get("global_eval_every")
    if isinstance(every, int) and every <= 0:
        return unscored.EVERY_OFF
    return said or "not scored"


def version() -> str:
    """The installed dldctl distribution's version (metadata only: the syncer never imports dldctl)."""
    import importlib.metadata  # here: 10 ms of every command's start otherwise

    try:
        return importlib.metadata.version("dldctl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def checkpoint_body(data: bytes, name: str) -> bytes:
    """The torch.save body of a syncer checkpoint file's bytes; ExportError if it is not one."""
    head = len(CHECKPOINT_MAGIC) + 32
    if len(data) < head or data[: len(CHECKPOINT_MAGIC)] != CHECKPOINT_MAGIC:
        raise ExportError(f"{name}: not a checkpoint (bad magic or truncated)")
    if hashlib.sha256(data[head:]).digest() != data[len(CHECKPOINT_MAGIC) : head]:
        raise ExportError(f"{name}: checksum mismatch (truncated or corrupt)")
    return data[head:]


def write(directory: Path, tensors: Mapping[str, Any], described: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write model.safetensors, then config.json, into `directory` (each atomic); OSError or
    ImportError (no safetensors here) is the caller's to report. Returns (weights, config path)."""
    from safetensors.torch import save

    meta = {"format": "pt", "run": str(described.get("run")), "outer_step": str(described.get("outer_step"))}
    body = save({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, metadata=meta)
    directory.mkdir(parents=True, exist_ok=True)
    weights, cfg = directory / WEIGHTS, directory / CONFIG
    atomic_write(weights, body)
    write_config(cfg, described)
    return weights, cfg


def write_config(path: Path, config: Mapping[str, Any]) -> None:
    """Replace an export's config.json (atomic; OSError is the caller's)."""
    atomic_write(path, strictjson.dumps(dict(config), indent=1) + "\n")


def read_config(path: Path) -> dict[str, Any]:
    """An export's config.json; ExportError (one line naming the file) if it is not one."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: unreadable ({exc})") from None
    if not isinstance(record, dict) or record.get("schema") != CONFIG_SCHEMA:
        raise ExportError(f"{path}: not an export config (schema {CONFIG_SCHEMA!r} expected)")
    return record
