"""Hugging Face `transformers` causal LMs as workloads: `model = "hf:DIR"`.

A team brings a config directory (config.json; optionally tokenizer.json; weights are not read
here: `[run] init_from` loads those, learner/initmodel.py). dldctl builds the model from the
config alone, in float32 (the master weights, whatever the config's dtype), on the CPU under the
seed `build_workload` set, so every learner starts bitwise equal, then trains it as any workload:

    load_config     AutoConfig, strictly local (no hub), with the inventory's [model] table as
                    field overrides (`num_hidden_layers = 4`); unknown fields, remote code and
                    non-causal-LM configs are refused with one line naming the directory
    build_model     AutoModelForCausalLM.from_config, float32, CPU
    causal_lm_loss  cross-entropy of the logits against y (already shifted: never `labels=`)
    hf_workload     the factory: model, data (workload/tokenized.py), batches, eval batches

`model_dir(ctx)` is where the directory is on this host: the run's copy (`ctx.model_dir`), or
the path written in `settings["model"]` (the operator's absolute path) when there is none.
transformers is imported inside the functions: the operator's machine imports `workload` without it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from syncer.common.settings import suggest

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from workload import Workload, WorkloadContext

PREFIX = "hf:"
_POSITION_FIELDS = ("max_position_embeddings", "n_positions")  # GPT-2 names it n_positions
_NOT_OVERRIDABLE = {"dtype", "torch_dtype", "auto_map", "model_type", "architectures", "transformers_version"}


def is_hf(spec: str) -> bool:
    """Whether a model setting names a Hugging Face config directory ("hf:DIR")."""
    return spec.startswith(PREFIX)


def spec_path(spec: str) -> str:
    """The directory of "hf:DIR" (`~` expanded); ValueError for anything else or an empty DIR."""
    if not is_hf(spec):
        raise ValueError(f"model {spec!r} is not a Hugging Face model: write it as 'hf:/path/to/config-dir'")
    path = spec[len(PREFIX) :].strip()
    if not path:
        raise ValueError(f"model {spec!r} names no directory: write it as 'hf:/path/to/config-dir'")
    return str(Path(path).expanduser())


def model_dir(ctx: WorkloadContext) -> str:
    """Where the model's directory is on this host: the run's copy, else the path in settings."""
    return ctx.model_dir or spec_path(str(ctx.settings["model"]))


def needs(model_dir: str, what: str = "transformers") -> ImportError:
    """The error for a host without transformers (or tokenizers): what to install, where."""
    return ImportError(
        f"model 'hf:{model_dir}' needs {what} on this host: pip install 'dldctl[hf]' "
        f"(or install {what} into the learner's Python)"
    )


def _raw_config(model_dir: str) -> dict[str, Any]:
    """config.json as a dict, checked before transformers sees it (clear errors, no remote code)."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model directory {model_dir}: no such directory (model = 'hf:{model_dir}')")
    config_json = path / "config.json"
    if not config_json.is_file():
        raise ValueError(
            f"model directory {model_dir} has no config.json: save the config there with config.save_pretrained(dir)"
        )
    try:
        raw = json.loads(config_json.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model directory {model_dir}: config.json is unreadable ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model directory {model_dir}: config.json is not a JSON object")
    if "auto_map" in raw:
        raise ValueError(
            f"model directory {model_dir}: config.json needs remote code (auto_map {sorted(raw['auto_map'])}), "
            "which dldctl does not run; use a model type transformers ships (model_type), or a "
            "'package.module:factory' that builds it"
        )
    return raw


def load_config(model_dir: str, model_args: Mapping[str, Any]) -> PretrainedConfig:
    """The directory's config (a PretrainedConfig) with `[model]` overrides applied; ValueError
    (one line, naming the directory or the key) for what dldctl cannot build and train."""
    _raw_config(model_dir)
    try:
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig
    except ImportError:
        raise needs(model_dir) from None
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().split("\n")[0][:300]
        raise ValueError(f"model directory {model_dir}: transformers cannot read config.json ({first})") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"model directory {model_dir}: {type(config).__name__} (model_type {config.model_type!r}) is not a "
            "causal language model AutoModelForCausalLM can build; dldctl trains next-token prediction"
        )
    _override(config, model_args)
    return config


def _override(config: PretrainedConfig, model_args: Mapping[str, Any]) -> None:
    """Set each [model] key on the config; a key the config does not have is a ValueError."""
    name = type(config).__name__
    fields = [k for k in config.to_dict() if not k.startswith("_") and k not in _NOT_OVERRIDABLE]
    fields += list(getattr(config, "attribute_map", {}))  # GPT-2 also answers to hidden_size, ...
    for key, value in model_args.items():
        if key in ("dtype", "torch_dtype"):
            raise ValueError(f"[model] {key}: dldctl trains float32 master weights; remove {key} from [model]")
        if key not in fields:
            close = suggest(key, fields)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise ValueError(f"[model] {key}: {name} has no such field{hint}")
        setattr(config, key, value)


def build_from_config(config: PretrainedConfig) -> torch.nn.Module:
    """AutoModelForCausalLM.from_config in float32 on the CPU, from torch's global RNG (seeded
    by the caller): the same seed gives bitwise-identical parameters."""
    import torch
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM  # from_config is untyped in transformers
    try:
        model = auto.from_config(config, dtype=torch.float32, trust_remote_code=False)
    except (ValueError, TypeError, RuntimeError) as exc:  # e.g. an override that breaks a shape
        first = str(exc).strip().split("\n")[0][:300]
        raise ValueError(f"cannot build {type(config).__name__} from {config.name_or_path}: {first}") from None
    module: torch.nn.Module = model.float()  # master weights: never the config's bf16
    return module


def build_model(model_dir: str, model_args: Mapping[str, Any]) -> torch.nn.Module:
    """The directory's causal LM, `[model]` overrides applied, float32, on the CPU (seed first)."""
    return build_from_config(load_config(model_dir, model_args))


def embedding_names(model: torch.nn.Module) -> set[str]:
    """Names (as named_parameters() gives them) of every nn.Embedding's weight: token and
    position tables. A tied LM head is the same parameter, listed once under one name; an
    untied lm_head is a Linear, not an embedding."""
    import torch

    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {name for name, p in model.named_parameters() if id(p) in tables}


def causal_lm_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy of (x, y), y being x shifted by one already. Not `labels=`:
    transformers would shift y once more and train each position on the token after next."""
    import torch.nn.functional as F

    x, y = batch
    logits = model(input_ids=x, use_cache=False).logits.float()  # (B, T, V); fp32 for the softmax
    loss: torch.Tensor = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    return loss


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest sequence the config's position embeddings allow, when it says."""
    for name in _POSITION_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def hf_workload(ctx: WorkloadContext) -> Workload:
    """The factory of "hf:DIR": the config's causal LM on the run's data, one shard per learner."""
    import torch

    from workload import Workload, batch_tokens, shard_batches
    from workload import tokenized as tokenized_mod

    directory = model_dir(ctx)
    config = load_config(directory, ctx.model_args)
    seq_len = int(ctx.settings.get("seq_len", 128))
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"model directory {directory}: seq_len {seq_len} is longer than the model's {limit} positions "
            f"({type(config).__name__}); set seq_len <= {limit}, or raise max_position_embeddings in [model]"
        )
    if not 0 <= ctx.learner_index < ctx.shards:
        raise ValueError(f"learner_index {ctx.learner_index} is outside 0..{ctx.shards - 1} (shards={ctx.shards})")
    # data first (numpy only, never torch's RNG): a vocabulary mismatch fails before a long build
    corpus = tokenized_mod.load(directory, str(ctx.settings.get("data", "builtin")), int(config.vocab_size))
    model = build_from_config(config)  # on the CPU: CPU and CUDA generators draw differently
    device = torch.device(ctx.device)
    model.to(device)
    next_batch, held_out = shard_batches(ctx, corpus, seq_len, device)
    return Workload(
        model=model,
        next_batch=next_batch,
        loss=causal_lm_loss,
        tokens=batch_tokens,
        eval_batches=held_out,
        embedding_names=embedding_names(model),
    )
