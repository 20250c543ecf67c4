"""A nanoGPT-style decoder-only transformer: the built-in model every learner trains.

The shape follows karpathy/nanoGPT `model.py`: token + position embeddings, `n_layer` pre-LN
blocks (causal self-attention, then a GELU MLP, each inside a residual connection), a final
LayerNorm and an LM head whose weight *is* the token embedding (weight tying). This module
imports only torch and the torch-free preset table (workload/presets.py), so a learner host needs
nothing else to build it.

Why it matters for Decoupled DiLoCo:
- Every learner and the syncer must agree on the parameter manifest (names, shapes, order):
  `param_shapes` builds the model on the meta device (no memory, no RNG) to get it cheaply.
- Every learner must start from the same weights: the init draws only from torch's global RNG
  in a fixed order, so `torch.manual_seed(s)` before `GPT(config)` gives bitwise-identical
  parameters. Build on the CPU and move to the device afterwards (a CUDA RNG draws differently).
- The embedding tables (wte, wpe) are merged by a plain mean, not by RDA: `embedding_names`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from workload.presets import PRESETS as PRESETS  # re-exported: callers read gpt.PRESETS
from workload.presets import GPTConfig as GPTConfig
from workload.presets import config_for as config_for


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd={config.n_embd} must be a multiple of n_head={config.n_head}")
        # query, key and value projections for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()  # batch, sequence length, embedding width
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs): heads become a batch dimension
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        # flash/memory-efficient kernels where available; is_causal masks the future
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
        out: Tensor = self.resid_dropout(self.c_proj(y))  # Module.__call__ is typed Any
        return out


class MLP(nn.Module):
    """Position-wise feed-forward: widen 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # Module.__call__ is typed Any
        return out


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # communicate between positions
        x = x + self.mlp(self.ln_2(x))  # compute at each position
        return x


class GPT(nn.Module):
    """The decoder: (B, T) token ids -> (B, T, vocab) logits, and the mean loss given targets."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.vocab_size < 1 or config.block_size < 1:
            raise ValueError(f"vocab_size and block_size must be >= 1, got {config}")
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embedding
                wpe=nn.Embedding(config.block_size, config.n_embd),  # position embedding
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: the head shares the token table, so named_parameters() lists it once,
        # as transformer.wte.weight (registered first)
        self.transformer["wte"].weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth (two residual additions per block)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # modules are visited in a fixed order, so a fixed seed gives fixed weights
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """idx, targets: (B, T) int64. Returns logits (B, T, vocab) and the mean cross-entropy."""
        _B, T = idx.size()
        if self.config.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        # indexed, not attributes: ModuleDict's attributes are typed Tensor | Module, its items Module
        parts = self.transformer
        tok_emb = parts["wte"](idx)  # (B, T, C)
        pos_emb = parts["wpe"](pos)  # (T, C), broadcast over the batch
        x = parts["drop"](tok_emb + pos_emb)
        blocks = parts["h"]
        assert isinstance(blocks, nn.ModuleList)  # built as one in __init__
        for block in blocks:
            x = block(x)
        x = parts["ln_f"](x)
        logits = self.lm_head(x)  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def embedding_names(self) -> set[str]:
        """Names (as in named_parameters()) of the embedding tables: merged by a plain mean."""
        return {"transformer.wte.weight", "transformer.wpe.weight"}

    def num_params(self) -> int:
        """Parameter count (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())


def build(name: str, *, vocab_size: int = 256, block_size: int | None = None) -> GPT:
    """The preset `name`, initialised from torch's global RNG (seed it first), on the CPU."""
    return GPT(config_for(name, vocab_size=vocab_size, block_size=block_size))


def param_shapes(
    name: str, *, vocab_size: int = 256, block_size: int | None = None
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter in named_parameters() order, without allocating them."""
    config = config_for(name, vocab_size=vocab_size, block_size=block_size)
    with torch.device("meta"):
        model = GPT(config)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]
