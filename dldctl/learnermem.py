"""What a learner on the CPU holds in memory, estimated before it starts (pure, no torch).

    need = BASE_B + STATE_B x parameters + activations(batch, seq_len)

BASE_B is an idle learner process (Python, torch's CPU runtime, the data reader); STATE_B the
bytes each parameter costs a learner: fp32 weights and gradients, AdamW's two moments, the
fragment marks of its last pushes, the latest global fragments and the push's residual. The
activations a GPT block keeps for its backward pass are linear in the tokens of a batch, about
ACT_B bytes per token, channel and layer (in fp32; Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", count 34 values at 16 bits; torch's CPU attention is
a flash kernel that keeps no seq x seq scores), plus the logits and their gradients:

    activations = n_layer x batch x seq x n_embd x ACT_B + 3 x 4 x batch x seq x vocabulary

The constants are fitted to, and checked against, real learners' peak resident sets by
`bench/learner_memory.py` (BENCHMARKS.md, Learner memory: within 10% from 0.1 M to 86 M
parameters and sequences of 32 to 1,024). A learner on a GPU keeps all this in the GPU's
memory, not the host's: it is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from dldctl.syncermem import DOES_NOT_FIT, FITS, MAY_NOT_FIT
from syncer.common.memfit import gb
from workload.presets import GPTConfig

BASE_B = 0.34e9  # an idle CPU learner: Python, torch, the data reader (bench/learner_memory.py)
STATE_B = 28.0  # weights, gradients, AdamW's moments, marks, the latest global fragments, the residual
ACT_B = 76.0  # activations kept per token, channel and layer


def activations(cfg: GPTConfig, batch: int, seq: int) -> float:
    """Bytes of fp32 activations a forward pass keeps for its backward pass."""
    return cfg.n_layer * batch * seq * cfg.n_embd * ACT_B + 3 * 4.0 * batch * seq * cfg.vocab_size


def learner_need(cfg: GPTConfig, params: int, batch: int, seq: int) -> float:
    """Peak bytes of one CPU learner process of this model, batch and sequence length."""
    return BASE_B + STATE_B * params + activations(cfg, batch, seq)


@dataclass(frozen=True)
class MachineNeed:
    """One machine's CPU learners (of one or more [[hosts]] entries that share its address)."""

    machine: str  # the entries' names, as the lines say it ("a", or "a, b")
    learners: int  # processes: learners x ranks
    each: tuple[float, ...]  # bytes of each process
    beside: float  # the floor of the syncer shards on the same machine (0 where none)

    @property
    def total(self) -> float:
        return sum(self.each) + self.beside


def verdict(need: MachineNeed, free: int | None, which: str, model: str) -> tuple[str, str]:
    """(FITS, MAY_NOT_FIT or DOES_NOT_FIT, one line): does not fit when the learners (and the
    syncer's floor beside them) need more than is free; may not when within 10% of it (the
    estimate's error on the measured points)."""
    low, high = min(need.each), max(need.each)
    each = gb(low) if gb(low) == gb(high) else f"{gb(low)} to {gb(high)}"
    plural = "s" if need.learners > 1 else ""
    line = f"{need.learners} CPU learner{plural} ({model}) need {gb(sum(need.each))}"
    line += f", {each} each" if need.learners > 1 else ""
    line += f", beside the syncer's {gb(need.beside)}" if need.beside else ""
    if free is None:
        return FITS, f"{line}; free memory unknown ({which})"
    line += f"; {gb(free)} free ({which})"
    if need.total > free:
        return DOES_NOT_FIT, line
    if need.total > 0.9 * free:
        return MAY_NOT_FIT, line + ": may not fit (the estimate is within 10% of what learners hold)"
    return FITS, line
