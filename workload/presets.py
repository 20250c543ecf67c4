"""The built-in GPT presets and their parameter shapes, without torch (stdlib only).

The operator validates an inventory (`fragments` no more than the model's parameter tensors,
`seq_len` within its positions) on a machine that may have no torch at all; workload/gpt.py
builds the real modules from the same table, and a unit test checks that `param_shapes` here
equals the real model's `named_parameters()` shapes for every preset.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of one GPT; `block_size` is the number of learned positions."""

    vocab_size: int = 256  # bytes by default; 50304 for GPT-2 BPE (50257 padded to x64)
    block_size: int = 128  # longest sequence the position table allows
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # 0 for DiLoCo runs: the inner steps are short and data is plenty
    bias: bool = True  # biases in Linears and LayerNorms, like GPT-2


PRESETS: dict[str, GPTConfig] = {
    # tests: ~0.12M params at vocab 256, a forward+backward in a few ms on one CPU thread
    "gpt-tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128),
    # the CPU demo: ~0.8M params, trains visibly on 2 CPU cores in a minute at batch 16
    "gpt-small": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),
    # a small GPU host (or a patient CPU): ~10.8M params at vocab 256
    "gpt-medium": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256),
    # GPT-2 small shapes (124M params with vocab_size=50304): for GPU hosts
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024),
}


def config_for(name: str, *, vocab_size: int = 256, block_size: int | None = None) -> GPTConfig:
    """The preset `name` with its vocabulary and (optionally shorter) position table set."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    base = PRESETS[name]
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if block_size is None:
        block_size = base.block_size
    if not 1 <= block_size <= base.block_size:
        raise ValueError(
            f"block_size {block_size} is out of range for {name!r}: it allows 1..{base.block_size}"
            f" positions (set seq_len <= {base.block_size} or pick a larger preset)"
        )
    return replace(base, vocab_size=vocab_size, block_size=block_size)


def _linear(prefix: str, n_in: int, n_out: int, bias: bool) -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = [(f"{prefix}.weight", (n_out, n_in))]
    return out + ([(f"{prefix}.bias", (n_out,))] if bias else [])


def _layer_norm(prefix: str, n: int, bias: bool) -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = [(f"{prefix}.weight", (n,))]
    return out + ([(f"{prefix}.bias", (n,))] if bias else [])


def param_shapes(
    name: str, *, vocab_size: int = 256, block_size: int | None = None
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter in named_parameters() order (the LM head is tied to wte)."""
    c = config_for(name, vocab_size=vocab_size, block_size=block_size)
    e, b = c.n_embd, c.bias
    out: list[tuple[str, tuple[int, ...]]] = [
        ("transformer.wte.weight", (c.vocab_size, e)),
        ("transformer.wpe.weight", (c.block_size, e)),
    ]
    for i in range(c.n_layer):
        h = f"transformer.h.{i}"
        out += _layer_norm(f"{h}.ln_1", e, b)
        out += _linear(f"{h}.attn.c_attn", e, 3 * e, b) + _linear(f"{h}.attn.c_proj", e, e, b)
        out += _layer_norm(f"{h}.ln_2", e, b)
        out += _linear(f"{h}.mlp.c_fc", e, 4 * e, b) + _linear(f"{h}.mlp.c_proj", 4 * e, e, b)
    return out + _layer_norm("transformer.ln_f", e, b)
