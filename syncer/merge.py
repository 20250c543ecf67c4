"""The syncer's pure core: token weights, merge rules, Nesterov outer step, grace window, round
closing, robust clipping. No I/O; the clock is passed in as plain numbers.

Shapes: every delta is a flat fp32 fragment vector of n values; `segments` lists the
(offset, numel, kind) of each tensor piece in it (see fragments.FragmentPlan.segments).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np
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
    deltas: Sequence[torch.Tensor],
    weights: Sequence[float],
    segments: Segments,
    rule: str = "rda",
    *,
    factors: Sequence[float] | None = None,
    scale: float = 1.0,
    sqnorms: Sequence[Sequence[float]] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Merge outer gradients of one fragment: RDA per tensor (mean for embeddings) or plain mean.

    `factors` (robust clipping) and `scale` (fleet scale) give the result of merging
    `[d * f for d, f in zip(deltas, factors)]` and multiplying it by `scale`, without copying the
    deltas: RDA is invariant to a positive factor's effect on a direction and only scales the
    norm, the mean takes it as a weight. `sqnorms[m][s]` (squared norm of delta m on segment s,
    before any factor) may be passed when already computed (see `segment_sqnorms`).
    Each output element is written by one weighted sum over the deltas, then one scaling. `out`
    receives the result (default: a new tensor); it may be `deltas[0]` itself, which saves a
    fragment-sized allocation when the caller has no further use for that delta.
    """
    if not deltas:
        raise ValueError("nothing to merge")
    if float(sum(weights)) <= 0:
        weights = [1.0] * len(deltas)
    factors = [1.0] * len(deltas) if factors is None else list(factors)
    total = float(sum(weights))
    if rule == "mean" or len(deltas) == 1:
        return _weighted_sum(deltas, [w * f * scale / total for w, f in zip(weights, factors)], out)
    if rule != "rda":
        raise ValueError(f"unknown merge rule {rule!r}")
    if sqnorms is None:
        sqnorms = segment_sqnorms(deltas, segments)
    out = torch.empty_like(deltas[0]) if out is None else out
    for s, (offset, numel, kind) in enumerate(segments):
        parts = [d[offset : offset + numel] for d in deltas]
        target = out[offset : offset + numel]
        if kind == "embedding":
            _weighted_sum(parts, [w * f * scale / total for w, f in zip(weights, factors)], target)
        else:
            _rda_into(parts, weights, factors, [sq[s] for sq in sqnorms], scale, target)
    return out


def coefficients(
    grams: torch.Tensor,
    weights: Sequence[float],
    kinds: Sequence[str],
    rule: str = "rda",
    *,
    factors: Sequence[float] | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """(segments, M) fp32: merged segment s = sum_m coef[s, m] * v_m, the same merge as `merge`.

    `grams` (segments, M, M) holds the Gram matrix <v_m, v_n> of the contributions per segment:
    its diagonal gives the norms, and the RDA direction sum_m c_m v_m has norm sqrt(c^T G c), so
    the final scaling folds into the coefficients and the merge is one weighted sum per element.
    In float64, every segment at once (numpy: a few microseconds per operation on these sizes).
    """
    count = len(weights)
    if float(sum(weights)) <= 0:
        weights = [1.0] * count
    factors = [1.0] * count if factors is None else list(factors)
    if rule not in ("mean", "rda"):
        raise ValueError(f"unknown merge rule {rule!r}")
    total = float(sum(weights))
    w, f = np.array(weights, dtype=np.float64), np.array(factors, dtype=np.float64)
    rows = np.empty((len(kinds), count), dtype=np.float64)
    rows[:] = w * f * (scale / total)  # the weighted mean (embeddings, rule "mean", one contribution)
    rda = np.array([kind != "embedding" for kind in kinds], dtype=bool)
    if rule == "rda" and count > 1 and rda.any():
        rows[rda] = _rda_coefficients(grams.to(torch.float64).numpy()[rda], w, f, total, scale)
    return torch.from_numpy(rows.astype(np.float32))


def _rda_coefficients(g: np.ndarray, w: np.ndarray, f: np.ndarray, total: float, scale: float) -> np.ndarray:
    """RDA of segments from their Gram matrices g (S, M, M): c_m = w_m / (|v_m| total), times
    mean norm / |sum c v| (a row of zeros where either is 0)."""
    norms = np.sqrt(np.maximum(np.einsum("smm->sm", g), 0.0))  # (S, M)
    mean_norm = norms @ (w * f) / total  # (S,)
    with np.errstate(divide="ignore", invalid="ignore"):  # the zero norms are masked out
        c = np.where(norms > 0, w / (norms * total), 0.0)
        dnorm = np.sqrt(np.maximum(np.einsum("sm,smn,sn->s", c, g, c), 0.0))
        k = np.where((dnorm > 0) & (mean_norm > 0), mean_norm * scale / dnorm, 0.0)
    result: np.ndarray = c * k[:, None]
    return result


def segment_sqnorms(deltas: Sequence[torch.Tensor], segments: Segments) -> list[list[float]]:
    """[m][s]: squared L2 norm of delta m on segment s (one read of every delta, no temporaries)."""
    return [[_sqnorm(d[o : o + n]) for o, n, _ in segments] for d in deltas]


def _weighted_sum(
    vectors: Sequence[torch.Tensor], coefs: Sequence[float], out: torch.Tensor | None = None
) -> torch.Tensor:
    """sum_m coefs[m] * vectors[m], into `out` (a new tensor when None)."""
    out = torch.mul(vectors[0], coefs[0], out=out) if out is not None else vectors[0] * coefs[0]
    for v, c in zip(vectors[1:], coefs[1:]):
        out.add_(v, alpha=c)
    return out


def _rda_into(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    factors: Sequence[float],
    sqnorms: Sequence[float],
    scale: float,
    out: torch.Tensor,
) -> None:
    """RDA of `f_m * parts[m]` times `scale`, written into `out` (see rda_tensor)."""
    total = float(sum(weights))
    norms = [math.sqrt(sq) for sq in sqnorms]
    mean_norm = sum(w * f * n for w, f, n in zip(weights, factors, norms)) / total
    coefs = [w / (n * total) if n > 0 else 0.0 for w, n in zip(weights, norms)]
    _weighted_sum(parts, coefs, out)
    dnorm = math.sqrt(_sqnorm(out))
    if dnorm == 0 or mean_norm == 0:
        out.zero_()
    else:
        out.mul_(mean_norm * scale / dnorm)


def _sqnorm(v: torch.Tensor) -> float:
    """Squared L2 norm as a Python float: a dot product (no |v|^2 temporary); vector_norm if it overflows."""
    if not v.numel():
        return 0.0
    sq = float(torch.dot(v, v))
    return float(torch.linalg.vector_norm(v)) ** 2 if math.isinf(sq) else sq


def nesterov_step(
    theta: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, lr: float = 0.7, momentum: float = 0.9
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGD with Nesterov momentum (torch.optim.SGD semantics, dampening 0), new tensors returned.

    buf' = momentum * buf + grad;  theta' = theta - lr * (grad + momentum * buf')
    """
    new_buf = buf * momentum + grad
    update = grad + new_buf * momentum
    return theta - update * lr, new_buf


def partial_momentum(momentum: float, share: float) -> tuple[float, float]:
    """(decay, lookahead) of the Nesterov step of a round that holds `share` of one sync period.

    A full round (share 1) is DiLoCo's step: the buffer decays by `momentum` and the lookahead
    adds `momentum` times it. A round of a partial window (a learner's last steps as it finishes,
    its first after a join) carries a small outer gradient, but a whole step's lookahead would
    still move the model by ~lr * momentum^2 * buf: several periods' worth of progress that no
    training backs. So the buffer decays by momentum^share and the lookahead is momentum * share;
    two rounds of half a period each then move the model about as one whole round does.
    """
    share = min(1.0, max(0.0, share))
    if share >= 1.0:
        return momentum, momentum
    return momentum**share, momentum * share


def nesterov_change_(
    change: torch.Tensor,
    grad: torch.Tensor,
    buf: torch.Tensor,
    lr: float = 0.7,
    momentum: float = 0.9,
    share: float = 1.0,
) -> torch.Tensor:
    """`nesterov_step` in place, as the parameter change: no theta needed, nothing allocated.

    buf <- grad + decay * buf (torch.optim.SGD's buffer update, in one pass), then
    change <- change - lr * grad - lr * look * buf', i.e. change + (theta' - theta), where
    (decay, look) = partial_momentum(momentum, share): both `momentum` for a whole round.
    Returns `change`. Three passes over the fragment; the results agree with `nesterov_step` to
    fp32 rounding (the order of the roundings differs, not the arithmetic).
    """
    decay, look = partial_momentum(momentum, share)
    torch.add(grad, buf, alpha=decay, out=buf)
    return change.add_(grad, alpha=-lr).add_(buf, alpha=-lr * look)


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
