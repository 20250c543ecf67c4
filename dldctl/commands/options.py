"""Flag values shared by the commands: durations with units ("3m", "2s", "800ms", plain seconds)."""

from __future__ import annotations

from dldctl.errors import UsageError
from dldctl.units import parse_duration


def duration(flag: str, text: str, *, positive: bool = True) -> float:
    """Seconds from a flag's value; a bad one is a UsageError naming the flag."""
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    if positive and seconds <= 0:
        raise UsageError(f"{flag} must be > 0 (got {text!r})")
    return seconds
