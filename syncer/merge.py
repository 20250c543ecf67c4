"""The syncer's pure core: token weights, merge rules, Nesterov outer step, grace window, round
closing, robust clipping. No I/O; the clock is passed in as plain numbers.

Shapes: every delta is a flat fp32 fragment vector of n values; `segments` lists the
(offset, numel, kind) of each tensor piece in it (see fragments.FragmentPlan.segments).
"""

from __future__ import annotations

import statistics
from typing import Sequence

import torch

Segments = Sequence[tuple[int, int, str]]


def token_weight(c_tokens: int, c_steps: int) -> float:
    """w = c_tokens * (c_tokens / c_steps): data seen times data per step."""
    if c_steps <= 0 or c_tokens <= 0:
        return 0.0
    return float(c_tokens) * (float(c_tokens) / float(c_steps))


def weighted_mean(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_m w_m v_m / sum_m w_m."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    out = vectors[0] * (weights[0] / total)
    for v, w in zip(vectors[1:], weights[1:]):
        out.add_(v, alpha=w / total)
    return out


def rda_tensor(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Radial-directional average: mean of the norms times the unit of the mean of the units."""
    if len(vectors) == 1:
        return vectors[0].clone()
    total = float(sum(weights))
    norms = [float(torch.linalg.vector_norm(v)) for v in vectors]
    mean_norm = sum(w * n for w, n in zip(weights, norms)) / total
    direction = torch.zeros_like(vectors[0])
    for v, w, n in zip(vectors, weights, norms):
        if n > 0:
            direction.add_(v, alpha=w / (n * total))
    dnorm = float(torch.linalg.vector_norm(direction))
    if dnorm == 0 or mean_norm == 0:
        return direction.zero_()
    return direction.mul_(mean_norm / dnorm)


def merge(
    deltas: Sequence[torch.Tensor], weights: Sequence[float], segments: Segments, rule: str = "rda"
) -> torch.Tensor:
    """Merge outer gradients of one fragment: RDA per tensor (mean for embeddings) or plain mean."""
    if not deltas:
        raise ValueError("nothing to merge")
    if float(sum(weights)) <= 0:
        weights = [1.0] * len(deltas)
    if rule == "mean" or len(deltas) == 1:
        return weighted_mean(deltas, weights)
    if rule != "rda":
        raise ValueError(f"unknown merge rule {rule!r}")
    out = torch.empty_like(deltas[0])
    for offset, numel, kind in segments:
        parts = [d[offset : offset + numel] for d in deltas]
        merged = weighted_mean(parts, weights) if kind == "embedding" else rda_tensor(parts, weights)
        out[offset : offset + numel] = merged
    return out


def nesterov_step(
    theta: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, lr: float = 0.7, momentum: float = 0.9
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGD with Nesterov momentum (torch.optim.SGD semantics, dampening 0), new tensors returned.

    buf' = momentum * buf + grad;  theta' = theta - lr * (grad + momentum * buf')
    """
    new_buf = buf * momentum + grad
    update = grad + new_buf * momentum
    return theta - update * lr, new_buf


def grace_window(gamma: float, tau: int, t_step: float, t_quorum: float, t_sync: float) -> float:
    """gamma * max(0, tau * t_step - (t_quorum + t_sync)): the wait the overlap pays for."""
    slack = tau * t_step - (t_quorum + t_sync)
    return gamma * max(0.0, slack)


def should_close(
    now: float,
    contributors: int,
    quorum: int,
    quorum_at: float | None,
    grace_s: float,
    all_live_in: bool,
) -> bool:
    """A round closes once quorum is in and either every live learner is in or grace expired."""
    if contributors < quorum or quorum_at is None:
        return False
    if all_live_in:
        return True
    return now >= quorum_at + grace_s


def clip_factors(norms: Sequence[float], history: Sequence[float], multiple: float) -> list[float]:
    """Per-contribution scale factors that clip each norm to `multiple` x the median norm.

    The median is taken over this round's norms and the recent accepted ones (`history`), so a
    single broken learner cannot drag the reference up. multiple <= 0 disables clipping.
    """
    if multiple <= 0 or not norms:
        return [1.0] * len(norms)
    reference = statistics.median(list(norms) + list(history))
    if reference <= 0:
        return [1.0] * len(norms)  # nothing to compare against (all-zero history)
    limit = multiple * reference
    return [1.0 if n <= limit or n == 0 else limit / n for n in norms]


def fleet_fraction(round_tokens: float, period_tokens: float) -> float:
    """Share of one sync period's fleet-wide tokens that a round merges (capped at 1).

    Synchronous DiLoCo takes one outer step per sync period with every learner in it. With a
    quorum below M, a fragment sees about M/contributors rounds per period; scaling each
    round's outer gradient by this share keeps the outer step per period (momentum included)
    what it is in the synchronous case instead of M times larger, which diverges.
    """
    if period_tokens <= 0:
        return 1.0
    return max(0.0, min(1.0, round_tokens / period_tokens))


def ema(previous: float | None, value: float, beta: float = 0.9) -> float:
    """Exponential moving average; the first value seeds it."""
    return value if previous is None else beta * previous + (1 - beta) * value
