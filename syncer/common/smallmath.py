"""Numeric helpers both ends share (a leaf: stdlib only)."""

from __future__ import annotations


def ema(previous: float | None, value: float, beta: float = 0.9) -> float:
    """Exponential moving average; the first value seeds it."""
    return value if previous is None else beta * previous + (1 - beta) * value
