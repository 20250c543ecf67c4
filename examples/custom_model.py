"""A user's own model for dldctl: a byte-level GRU (a "char-RNN") on the built-in corpus.

Use it with ``model = "examples.custom_model:factory"`` in the inventory's ``[run]`` table, with
the repository root on the learners' ``sys.path`` (their working directory, or PYTHONPATH).
See docs/custom-model.md for the contract; in short, `factory(ctx)` returns a `Workload`:

- the model, already on ``ctx.device``, initialised only from torch's global RNG (seeded by
  `build_workload` before the call), on the CPU first so every learner gets identical weights;
- ``next_batch()``: this learner's next training batch, on the device;
- ``loss(model, batch)``: a scalar to minimise;
- ``tokens(batch)``: exactly how many tokens the batch trains on (it weights the merge);
- ``eval_batches``: fixed held-out batches, the same on every learner;
- ``embedding_names``: parameters merged by a plain mean (embedding tables).

Here the data side reuses dldctl's own pieces (corpus, shards, batches); a factory may just as
well bring its own data, as long as it keeps the rules above.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from workload import Workload, WorkloadContext, batch_seed, data


class CharGRU(nn.Module):
    """Bytes -> embedding -> one GRU layer -> logits over the next byte, at every position."""

    def __init__(self, vocab_size: int = 256, n_embd: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, n_embd)
        self.rnn = nn.GRU(n_embd, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T) int64 -> logits (B, T, vocab)."""
        h, _ = self.rnn(self.embed(x))  # (B, T, hidden); each step sees only the past
        return self.head(h)


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-byte cross-entropy."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def tokens(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """One target per position of x: B * T tokens."""
    return int(batch[0].numel())


def factory(ctx: WorkloadContext) -> Workload:
    """The workload for learner `ctx.learner_index` of `ctx.shards`."""
    s = ctx.settings
    seq_len = int(s.get("seq_len", 64))
    model = CharGRU().to(ctx.device)  # built on the CPU from the seeded RNG, then moved
    corpus = data.load_corpus(str(s.get("data", "builtin")))
    if corpus.vocab_size != 256:
        raise ValueError(f"examples.custom_model reads bytes; data {s.get('data')!r} has vocab {corpus.vocab_size}")
    shards, (ev0, ev1) = data.split(corpus, shards=ctx.shards)
    start, stop = shards[ctx.learner_index]
    train = data.Batches(
        corpus.tokens,
        start,
        stop,
        batch_size=ctx.batch_size,
        seq_len=seq_len,
        seed=batch_seed(ctx.seed, ctx.learner_index),
        device=ctx.device,
    )
    held_out = data.eval_batches(
        corpus.tokens,
        ev0,
        ev1,
        batch_size=int(s.get("batch_size", 16)),
        seq_len=seq_len,
        count=int(s.get("eval_batches", 2)),
        device=ctx.device,
    )
    return Workload(
        model=model,
        next_batch=train.next,
        loss=loss,
        tokens=tokens,
        eval_batches=held_out,
        embedding_names={"embed.weight"},
    )
