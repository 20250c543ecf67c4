"""The run's model as the operator sees it, torch-free: which kind it is, its `[model]` table, its
code directory, and the checks that need neither torch nor transformers.

    model = "gpt-small"              a built-in preset (workload/presets.py): shapes known here
    model = "pkg.module:factory"     a user's factory, imported from `[run] workdir` on each host
    model = "hf:./my-llama"          a `transformers` causal LM built from that directory's
                                     config.json (the learners and the syncer build it; the run
                                     keeps a copy of the directory without its weights)
    [model]                          free-form keys handed to the factory as `ctx.model_args`
                                     (for `hf:`: overrides of the config's fields)

What needs the model itself (importing the factory, building the manifest) is the probe's job
(dldctl/lifecycle/modelprobe.py), run on each host before anything starts.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dldctl.errors import ConfigError
from syncer.common.settings import RunSettings, SettingsError, suggest

HF = "hf:"
# the files of an `hf:` directory that are weights: the run's copy leaves them out (they start a
# run only through `[run] init_from`), so a config + tokenizer directory travels in kilobytes
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz")
HF_COPY_MAX_MB = 256.0  # a config + tokenizer directory bigger than this is a mistake (weights under another name?)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")


def kind(model: str) -> str:
    """ "hf", "factory" or "preset" (an unknown preset name is "preset": validation names it)."""
    if model.startswith(HF):
        return "hf"
    return "factory" if ":" in model else "preset"


def hf_path(model: str) -> str:
    """The directory an `hf:` model names (as written)."""
    return model[len(HF) :]


def model_table(raw: Any) -> dict[str, Any]:
    """The inventory's `[model]` table: any keys, values TOML can write except dates and times
    (config.json carries them as JSON)."""
    if not isinstance(raw, dict):
        raise SettingsError("model", f"must be a table, got {type(raw).__name__}", "write it as [model]")
    _check_values(raw, "model")
    return dict(raw)


def _check_values(value: Any, key: str) -> None:
    if isinstance(value, (datetime.date, datetime.time)):
        raise SettingsError(key, f"is a {type(value).__name__}, which config.json cannot carry", "write it as a string")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_values(v, f"{key}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_values(v, f"{key}[{i}]")


def absolute(run: RunSettings, base: Path) -> RunSettings:
    """`run` with its local paths (`init_from`, `workdir`, an `hf:` directory) made absolute: `~`
    expanded, a relative one taken from `base` (the inventory file's directory). A relative `data`
    or `tokenizer` that exists there is made absolute too (the processes run in the run directory);
    one that does not is left as written, a path on each learner's host."""
    from dataclasses import replace

    def fix(value: str) -> str:
        if not value.strip():
            return value
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else base.absolute() / path)

    def beside(value: str) -> str:  # a path that exists beside the inventory (a "#field" suffix aside)
        path = value.rsplit("#", 1)[0] if "#" in value and not (base / value).exists() else value
        if value in ("", "builtin") or Path(path).expanduser().is_absolute() or not (base / path).exists():
            return value
        return fix(value)

    model = HF + fix(hf_path(run.model)) if kind(run.model) == "hf" else run.model
    return replace(
        run,
        init_from=fix(run.init_from),
        workdir=fix(run.workdir),
        model=model,
        data=beside(run.data),
        tokenizer=beside(run.tokenizer),
    )


def validate(run: RunSettings, model_args: Mapping[str, Any], path: str) -> None:
    """What the operator can check of the model without building it."""
    if run.workdir:
        _validate_workdir(run, path)
    k = kind(run.model)
    if k == "hf":
        _validate_hf(run, model_args, path)
    elif k == "preset":
        if model_args:
            raise ConfigError(
                path, "model", f"{run.model} is a built-in preset: it takes no [model] keys", "remove the [model] table"
            )
        _validate_preset(run, path)


def _validate_workdir(run: RunSettings, path: str) -> None:
    where = Path(run.workdir)
    if not where.is_dir():
        problem = "is a file, not a directory" if where.exists() else "no such directory"
        raise ConfigError(path, "run.workdir", f"{where}: {problem}", "point workdir at the directory of your code")


def hf_config(model: str) -> dict[str, Any]:
    """The config.json of an `hf:` model's directory, read as JSON (no transformers); ValueError
    naming the directory when it is not one."""
    where = Path(hf_path(model))
    if not where.is_dir():
        raise ValueError(f"{where}: {'not a directory' if where.exists() else 'no such directory'}")
    config = where / "config.json"
    try:
        data = json.loads(config.read_text())
    except FileNotFoundError:
        raise ValueError(f"{where} has no config.json (save one with config.save_pretrained(dir))") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config}: not a readable JSON config ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(f"{config} has no model_type: not a transformers config (config.save_pretrained writes one)")
    return data


def _validate_hf(run: RunSettings, model_args: Mapping[str, Any], path: str) -> None:
    if not hf_path(run.model).strip():
        raise ConfigError(path, "run.model", "hf: names no directory", 'write model = "hf:./my-model"')
    try:
        fields = {**hf_config(run.model), **model_args}
    except ValueError as exc:
        fix = 'point model = "hf:DIR" at a transformers model directory'
        raise ConfigError(path, "run.model", str(exc), fix) from None
    if fields.get("auto_map"):
        raise ConfigError(
            path,
            "run.model",
            f"{hf_path(run.model)} needs its own modeling code (auto_map): dldctl builds only transformers' classes",
            'wrap it in a factory (model = "pkg.module:factory", docs/huggingface.md)',
        )
    positions = next((fields[k] for k in POSITION_KEYS if isinstance(fields.get(k), int)), None)
    if positions is not None and run.seq_len > positions:
        raise ConfigError(
            path,
            "run.seq_len",
            f"{run.seq_len} is longer than the model's {positions} positions",
            f"set seq_len <= {positions}",
        )


def _validate_preset(run: RunSettings, path: str) -> None:
    """fragments <= parameter tensors, seq_len <= positions, for the built-in models."""
    from workload import presets  # torch-free: the operator may have no torch

    name = run.model
    if name not in presets.PRESETS:
        close = suggest(name, list(presets.PRESETS))
        fix = (
            f"did you mean {close!r}?"
            if close
            else f"use one of {', '.join(presets.PRESETS)}, 'hf:DIR' or 'package.module:factory'"
        )
        raise ConfigError(path, "run.model", f"unknown model {name!r}", fix)
    preset = presets.PRESETS[name]
    if run.seq_len > preset.block_size:
        raise ConfigError(
            path,
            "run.seq_len",
            f"{run.seq_len} is longer than {name}'s {preset.block_size} positions",
            f"set seq_len <= {preset.block_size}",
        )
    tensors = len(presets.param_shapes(name, block_size=run.seq_len))
    if run.fragments > tensors:
        raise ConfigError(
            path,
            "run.fragments",
            f"{run.fragments} fragments but {name} has only {tensors} parameter tensors",
            f"set fragments <= {tensors}",
        )
