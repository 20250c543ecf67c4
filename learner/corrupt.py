"""What `dldctl chaos corrupt` does to a learner's tensors: pure tensor code (no I/O, no clock).

A learner under the fault ("goes bad" while it keeps running) passes one tensor through
`corrupt` at the point its mode names, seeded by the step and the fragment index, so the same
fault at the same step does the same damage:

    nan       its weights: one element (of the fragment) set to NaN before an inner step; its
              loss turns non-finite (and the learner reloads the global model)
    scale     its weights of the fragment x factor (1e6) just before it takes the fragment's
              outer gradient: a damaged model, a huge push
    signflip  the outer gradient it pushes, negated (a learner that climbs the loss)
    noise     the outer gradient it pushes, replaced by Gaussian noise of the same L2 norm
    bitflip   `factor` (4) values of the outer gradient it pushes get one high exponent bit
              flipped: IEEE fp32 bit 30 where the result stays finite, else bit 29 (silent data
              corruption: finite, absurdly large or small values)

`WEIGHT_MODES` damage the learner's own model; `PUSH_MODES` change only what it sends.
"""

from __future__ import annotations

import random

import torch

MODES = ("nan", "scale", "signflip", "noise", "bitflip")
WEIGHT_MODES = ("nan", "scale")
PUSH_MODES = ("signflip", "noise", "bitflip")
DEFAULT_FACTOR = {"scale": 1e6, "bitflip": 4.0}  # the other modes take no factor
_BIT30, _BIT29 = 1 << 30, 1 << 29
_EXPONENT = 0x7F800000  # fp32: all ones here is inf or NaN


def default_factor(mode: str) -> float:
    return DEFAULT_FACTOR.get(mode, 1.0)


def seed_of(step: int, p: int) -> int:
    """The seed of the damage done at `step` to fragment `p`: the same fault, the same damage."""
    return (step * 1_000_003 + p + 1) & 0x7FFF_FFFF_FFFF


def corrupt(x: torch.Tensor, mode: str, factor: float, seed: int) -> torch.Tensor:
    """A corrupted copy of `x` (a flat fragment of weights, or an outer gradient); `x` is untouched."""
    if mode == "nan":
        out = x.detach().clone()
        if out.numel():
            out.view(-1)[random.Random(seed).randrange(out.numel())] = float("nan")
        return out
    if mode == "scale":
        return x.detach() * factor
    if mode == "signflip":
        return -x.detach()
    if mode == "noise":
        return _noise(x.detach(), seed)
    if mode == "bitflip":
        return bitflip(x.detach(), int(factor), seed)
    raise ValueError(f"unknown corruption mode {mode!r}; use one of {', '.join(MODES)}")


def _noise(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Gaussian noise with the L2 norm of `x` (zeros for a zero `x`), drawn on its device."""
    gen = torch.Generator(device=x.device).manual_seed(seed)
    noise = torch.randn(x.shape, generator=gen, device=x.device, dtype=torch.float32)
    norm = torch.linalg.vector_norm(noise)
    scale = torch.linalg.vector_norm(x.float()) / norm if float(norm) > 0 else torch.zeros((), device=x.device)
    return (noise * scale).to(x.dtype)


def bitflip(x: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """fp32 `x` with `count` distinct values (or all, if fewer) flipped at bit 30, or at bit 29
    where bit 30 would make the value inf or NaN; always finite where `x` was."""
    out = x.to(torch.float32, copy=True).contiguous()
    n = min(max(0, count), out.numel())
    if n == 0:
        return out
    where = torch.tensor(random.Random(seed).sample(range(out.numel()), n), device=out.device)
    bits = out.view(-1).view(torch.int32)
    picked = bits[where]
    flip30 = picked ^ _BIT30
    finite = (flip30 & _EXPONENT) != _EXPONENT
    bits[where] = torch.where(finite, flip30, picked ^ _BIT29)
    return out
