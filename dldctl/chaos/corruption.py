"""The modes of `dldctl chaos corrupt` and the checks on its input, pure (no I/O).

The learner does the damage (learner/corrupt.py, which dldctl never imports: the layering keeps
the operator's side free of the learner's torch code), so the mode names and default factors are
written here again; tests/unit/test_corrupt.py checks that both say the same.

    nan, scale                     the learner's own weights (WEIGHT_MODES)
    signflip, noise, bitflip       only the outer gradients it pushes
"""

from __future__ import annotations

import math

from dldctl.errors import UsageError

MODES = ("nan", "scale", "signflip", "noise", "bitflip")
WEIGHT_MODES = ("nan", "scale")  # refused for an island: only its rank 0 reads control.json
DEFAULT_FACTOR = {"scale": 1e6, "bitflip": 4.0}  # the other modes take no factor
WHAT = {  # what the fault does, as the event and the command say it
    "nan": "a NaN in its weights before every step",
    "scale": "its weights x{factor:g} before each push",
    "signflip": "its pushes negated",
    "noise": "its pushes replaced by noise of the same norm",
    "bitflip": "{factor:g} values of each push bit-flipped",
}


def check_mode(mode: str) -> None:
    """ValueError (one line: what is wrong, what to use) for a mode that is not one of MODES."""
    if mode not in MODES:
        raise ValueError(f"unknown corruption mode {mode!r}; use one of {', '.join(MODES)}")


def factor_of(mode: str, factor: float | None) -> float:
    """The factor `mode` runs with (its default where none is given); ValueError (one line) for a
    factor that is not positive and finite, a bitflip count that is not whole, or a factor given
    to a mode that takes none."""
    check_mode(mode)
    if factor is None:
        return DEFAULT_FACTOR.get(mode, 1.0)
    if mode not in DEFAULT_FACTOR:
        raise ValueError(f"{mode} takes no factor (only scale and bitflip do); leave it out")
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"must be a positive, finite number, got {factor:g}")
    if mode == "bitflip" and factor != int(factor):
        raise ValueError(f"bitflip flips a whole number of values (1, 2, ...), got {factor:g}")
    return float(factor)


def checked(mode: str, factor: float | None) -> float:
    """`factor_of` for the command line: UsageError (exit 2, one line) naming `--mode` or `--factor`."""
    try:
        check_mode(mode)
    except ValueError as exc:
        raise UsageError(f"--mode: {exc}") from None
    try:
        return factor_of(mode, factor)
    except ValueError as exc:
        raise UsageError(f"--factor: {exc}") from None


def describe(mode: str, factor: float) -> str:
    """`signflip corruption: its pushes negated`, `scale corruption: its weights x1e+06 before each push`."""
    return f"{mode} corruption: {WHAT[mode].format(factor=factor)}"
