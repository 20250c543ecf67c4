"""A run's trained tensors as a directory `transformers.AutoModelForCausalLM.from_pretrained` loads,
and the proof that it scores what the run reported (`dldctl export RUN --format hf`).

dldctl never imports torch or transformers (tests/unit/test_layering.py): it runs this module as a
process and reads the one JSON line it prints on stdout (progress goes to stderr, `progress: ...`):

    python -m workload.hfexport --weights W.safetensors --run-config RUN/config.json --out DIR [--no-verify]

    W       the run's safetensors export: {named_parameters() name: fp32 tensor}, a tied weight once
            (syncer/common/modelexport.py)
    DIR     what it writes: config.json + model.safetensors (save_pretrained), and for an `hf:` model
            the tokenizer files of the run's model directory (AutoTokenizer.from_pretrained(DIR))

By the run's model:
- a built-in preset (nanoGPT-shaped: tied wte/lm_head, learned positions, pre-LN, biases, exact
  GELU, LayerNorm eps 1e-5, SDPA) is the same function as transformers' GPT2LMHeadModel, whose
  projections are Conv1D modules (weight stored (in, out), the transpose of nn.Linear's);
- an `hf:` model is its own class, built from the run's model dir and [model] args (workload/hf.py)
  and given the trained parameters;
- a user's `package.module:factory` has no transformers class: refused (dldctl says so first).

Verification loads DIR the way a user does and scores it on the run's held-out batches, built as
the syncer's evaluator builds them (syncer/evaluator.py `_build`); it also scores the same tensors
in the workload's own model with the workload's own loss (what the syncer computed), so a run with
no reported loss is still checked. dldctl compares the numbers; this module only measures.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from syncer.common import resolved
from workload.presets import PRESETS, GPTConfig, config_for

if TYPE_CHECKING:
    import torch

SCHEMA = "dldctl.hfexport/1"
GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
GPT2_EOS = 50256  # GPT-2's <|endoftext|>: only meaningful when the vocabulary is GPT-2's (BPE data)
# what save_pretrained writes itself, or weights the run's copy of a model dir never holds
NOT_TOKENIZER = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
    ".npz",
    ".index.json",
)


class HFExportError(Exception):
    """A conversion that cannot be done; `line` is what dldctl prints, `hint` what to do."""

    def __init__(self, line: str, hint: str | None = None, kind: str = "operation") -> None:
        super().__init__(line)
        self.line, self.hint, self.kind = line, hint, kind  # kind: "operation" (exit 1) | "usage" (2)


@dataclass(frozen=True)
class RunModel:
    """What the run trained, from its config.json: the `model` spec, settings, [model] args, model dir."""

    spec: str
    settings: dict[str, Any]
    model_args: dict[str, Any]
    model_dir: Path | None

    @classmethod
    def load(cls, config_path: Path) -> RunModel:
        try:
            cfg = resolved.load(config_path)
        except ValueError as exc:
            raise HFExportError(str(exc)) from None
        return cls(cfg.run.model, cfg.run.to_dict(), dict(cfg.model_args), cfg.model_dir_path(config_path.parent))


def progress(line: str) -> None:
    """One progress line for dldctl to show on a terminal (stderr: stdout holds only the result)."""
    print(f"progress: {line}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the preset -> GPT-2 mapping


def gpt2_config(cfg: GPTConfig) -> Any:
    """The transformers GPT2Config computing what workload/gpt.py's GPT with `cfg` computes."""
    from transformers import GPT2Config

    eos = GPT2_EOS if cfg.vocab_size > GPT2_EOS else None  # a byte vocabulary has no end-of-text token
    return GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.block_size,  # the trained position table: longer inputs have no embedding
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=None,  # 4 * n_embd, as the preset's MLP
        activation_function="gelu",  # exact (erf) GELU, nn.GELU(); GPT-2's own "gelu_new" is the tanh one
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        scale_attn_weights=True,  # 1/sqrt(head size), SDPA's default scale
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        tie_word_embeddings=True,  # the preset's head *is* its token table
        bos_token_id=eos,
        eos_token_id=eos,
        architectures=["GPT2LMHeadModel"],
    )


def gpt2_tensors(tensors: Mapping[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The preset's parameters under GPT2LMHeadModel's names (the same names; Conv1D weights
    transposed). A preset without biases gets zero biases: GPT-2 always has them, zero adds nothing."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        out[name] = t.t().contiguous() if name.endswith(GPT2_CONV1D) and t.dim() == 2 else t
    if not cfg.bias:
        widths = {"ln_1": cfg.n_embd, "ln_2": cfg.n_embd, "attn.c_attn": 3 * cfg.n_embd, "attn.c_proj": cfg.n_embd}
        widths |= {"mlp.c_fc": 4 * cfg.n_embd, "mlp.c_proj": cfg.n_embd}
        for i in range(cfg.n_layer):
            for part, width in widths.items():
                out.setdefault(f"transformer.h.{i}.{part}.bias", torch.zeros(width))
        out.setdefault("transformer.ln_f.bias", torch.zeros(cfg.n_embd))
    return out


def preset_config(spec: str, tensors: Mapping[str, torch.Tensor]) -> GPTConfig:
    """The preset's GPTConfig at the trained vocabulary and positions (read off the tensors)."""
    wte, wpe = tensors.get("transformer.wte.weight"), tensors.get("transformer.wpe.weight")
    if wte is None or wpe is None:
        raise HFExportError(f"the tensors are not a {spec} GPT's: no transformer.wte.weight / transformer.wpe.weight")
    try:
        return config_for(spec, vocab_size=int(wte.shape[0]), block_size=int(wpe.shape[0]))
    except ValueError as exc:
        raise HFExportError(f"the tensors do not fit preset {spec}: {exc}") from None


def gpt2_model(spec: str, tensors: Mapping[str, torch.Tensor]) -> Any:
    """A GPT2LMHeadModel holding a preset's trained parameters (float32, CPU, eval mode)."""
    from transformers import GPT2LMHeadModel

    cfg = preset_config(spec, tensors)
    model: Any = GPT2LMHeadModel(gpt2_config(cfg))  # transformers' own annotations are partial
    load_parameters(model, gpt2_tensors(tensors, cfg), f"preset {spec} as GPT2LMHeadModel")
    return model.eval()


# --------------------------------------------------------------------------- loading parameters


def load_parameters(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Copy `tensors` into `model`'s parameters by name. Every parameter must be there, except
    that of a tied group (one tensor under several names) one name is enough; a tensor the model
    has no parameter for, or of another shape, is an error naming it."""
    import torch

    groups: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append((name, p))
    known = {name for group in groups.values() for name, _ in group}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise HFExportError(f"{what}: the trained tensors hold {unknown[0]!r}, which the model has no parameter for")
    with torch.no_grad():
        for group in groups.values():
            present = [(n, p) for n, p in group if n in tensors]
            if not present:
                raise HFExportError(f"{what}: no trained tensor for parameter {group[0][0]!r}")
            for name, p in present:
                t = tensors[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise HFExportError(
                        f"{what}: tensor {name!r} has shape {tuple(t.shape)}, the model's parameter {tuple(p.shape)}"
                    )
                p.copy_(t.to(p.dtype))


def hf_model(run: RunModel, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The run's `hf:` model (its own transformers class, built from the run's model dir and
    [model] args exactly as the learners built it) holding the trained parameters."""
    from workload import hf

    if run.model_dir is None or not run.model_dir.is_dir():
        raise HFExportError(
            f"model {run.spec!r}: the run's copy of the model directory ({run.model_dir}) is missing",
            hint="export on the operator machine that ran `dldctl up`, in the run's own directory",
        )
    model = hf.build_model(str(run.model_dir), run.model_args)
    load_parameters(model, tensors, f"model {run.spec!r} ({type(model).__name__})")
    return model.eval()


def tokenizer_files(model_dir: Path) -> list[Path]:
    """The files of a model dir to ship beside the weights: tokenizer, generation config, ...;
    not config.json (save_pretrained writes the one the run trained) and never weights."""
    return sorted(
        p for p in model_dir.iterdir() if p.is_file() and p.name != "config.json" and not p.name.endswith(NOT_TOKENIZER)
    )


def write(model: Any, out: Path, model_dir: Path | None) -> list[str]:
    """save_pretrained (safetensors, float32) into `out`, then the model dir's other files; the
    names written."""
    import torch

    model.to(torch.float32)
    model.config.architectures = [type(model).__name__]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    for path in tokenizer_files(model_dir) if model_dir is not None else []:
        shutil.copyfile(path, out / path.name)  # the user's generation_config.json wins over the derived one
    return sorted(p.name for p in out.iterdir())


# --------------------------------------------------------------------------- verification


def held_out(run: RunModel) -> Any:
    """The run's workload as the syncer's evaluator builds it (learner 0 of 1 shard, the run's batch
    size and seed, on the CPU): its model, loss and fixed eval batches. A str: why it cannot be
    built on this machine (its data is elsewhere)."""
    from workload import build_workload, scoring_context

    ctx = scoring_context(run.settings, run.model_args, None if run.model_dir is None else str(run.model_dir))
    try:
        return build_workload(ctx)
    except OSError as exc:  # FileNotFoundError for a data path that is not on this machine
        return f"the run's held-out data is not readable on this machine ({exc})"


def held_out_loss(model: Any, batches: list[Any]) -> float:
    """Mean over the batches of `hf.causal_lm_loss` (the loss an `hf:` run trains and scores by)."""
    import torch

    from workload.hf import causal_lm_loss

    with torch.no_grad():
        losses = [float(causal_lm_loss(model, batch)) for batch in batches]
    return sum(losses) / max(1, len(losses))


def reference_loss(workload: Any, tensors: Mapping[str, torch.Tensor], spec: str) -> float:
    """The same tensors scored in the workload's own model with its own loss: the syncer's score."""
    import torch

    model = workload.model
    load_parameters(model, tensors, f"model {spec!r} (the workload's own)")
    model.eval()
    with torch.no_grad():
        losses = [float(workload.loss(model, b)) for b in workload.eval_batches]
    return sum(losses) / max(1, len(losses))


def load_back(out: Path) -> Any:
    """`out` as a user loads it: AutoModelForCausalLM.from_pretrained; a weight it had to make up
    (missing, or of another shape) is an error naming it, not a warning."""
    from transformers import AutoModelForCausalLM

    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    except (OSError, ValueError, KeyError) as exc:
        raise HFExportError(f"AutoModelForCausalLM.from_pretrained({str(out)!r}) fails: {exc}") from None
    model, info = loaded  # (model, {"missing_keys", "unexpected_keys", "mismatched_keys", ...})
    for key in ("missing_keys", "mismatched_keys"):
        found = sorted(str(k) for k in info.get(key) or [])
        if found:
            raise HFExportError(f"from_pretrained({str(out)!r}) reports {key.replace('_', ' ')}: {', '.join(found)}")
    return model.eval()


def tokenizer_class(out: Path) -> str | None:
    """The class AutoTokenizer loads from `out`; None when `out` ships no tokenizer."""
    if not any((out / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return type(AutoTokenizer.from_pretrained(str(out))).__name__
    except (OSError, ValueError) as exc:
        raise HFExportError(f"AutoTokenizer.from_pretrained({str(out)!r}) fails: {exc}") from None


def verify(out: Path, run: RunModel, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Score `out`, loaded back, on the run's held-out batches; and the tensors in the workload's
    own model. The numbers only: dldctl judges them."""
    progress("verifying: building the run's held-out batches")
    workload = held_out(run)
    if isinstance(workload, str):
        return {"verification": "skipped", "why": workload, "tokenizer": tokenizer_class(out)}
    reference = reference_loss(workload, tensors, run.spec)
    batches = workload.eval_batches
    del workload  # its model: one copy fewer in memory while the exported one is scored
    progress(f"verifying: loading {out} with AutoModelForCausalLM and scoring {len(batches)} batches")
    model = load_back(out)
    loss = held_out_loss(model, batches)
    return {
        "verification": "done",
        "loaded_class": type(model).__name__,
        "verified_loss": loss if math.isfinite(loss) else None,
        "reference_loss": reference if math.isfinite(reference) else None,
        "eval_batches": len(batches),
        "tokenizer": tokenizer_class(out),
    }


# --------------------------------------------------------------------------- the process


def model_kind(spec: str) -> str:
    """ "preset", "hf" or "factory" (a user's `package.module:factory`)."""
    from workload.hf import is_hf

    if is_hf(spec):
        return "hf"
    return "preset" if spec in PRESETS else "factory"


def convert(weights: Path, config: Path, out: Path, *, check: bool) -> dict[str, Any]:
    """Write `out` from the tensors in `weights` for the run of `config`; the result record."""
    run = RunModel.load(config)
    kind = model_kind(run.spec)
    if kind == "factory":
        raise HFExportError(
            f"model {run.spec!r} is a user's own module: transformers has no class for it", kind="usage"
        )
    progress("loading torch and transformers")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights))
    except (OSError, SafetensorError) as exc:
        raise HFExportError(f"{weights}: cannot read the tensors ({exc})") from None
    model = gpt2_model(run.spec, tensors) if kind == "preset" else hf_model(run, tensors)
    progress(f"writing {out}")
    try:
        files = write(model, out, run.model_dir if kind == "hf" else None)
    except OSError as exc:
        raise HFExportError(f"cannot write {out}: {exc.strerror or exc}") from None
    result: dict[str, Any] = {"class": type(model).__name__, "model_type": model.config.model_type, "files": files}
    del model
    result |= verify(out, run, tensors) if check else {"verification": "off"}
    return result


def main(argv: list[str] | None = None) -> int:
    """The entry point: one JSON line on stdout ({"ok": true, ...} or {"ok": false, "error", ...})."""
    parser = argparse.ArgumentParser(
        prog="python -m workload.hfexport", description="A run's model as a from_pretrained directory."
    )
    parser.add_argument("--weights", type=Path, required=True, help="the run's model.safetensors")
    parser.add_argument("--run-config", type=Path, required=True, help="the run's config.json")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write")
    parser.add_argument("--no-verify", action="store_true", help="do not load it back and score it")
    args = parser.parse_args(argv)
    try:
        result = convert(args.weights, args.run_config, args.out, check=not args.no_verify)
    except HFExportError as exc:
        print(json.dumps({"schema": SCHEMA, "ok": False, "error": exc.line, "hint": exc.hint, "kind": exc.kind}))
        return 1
    print(json.dumps({"schema": SCHEMA, "ok": True, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
