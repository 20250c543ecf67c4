"""Parsing of the human forms the CLI accepts (simulate flags, chaos plans): "30s", "5m", "2h", "1.2M", "12B".

Pure functions raising ValueError with a short reason; the CLI turns that into a one-line usage
error naming the flag.
"""

from __future__ import annotations

import math
import re

_DURATION_UNITS = {"": 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_COUNT_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"


def parse_duration(text: str) -> float:
    """Seconds from "90", "800ms", "90s", "5m", "1.5h", "2d"."""
    m = re.fullmatch(_NUMBER + r"\s*([a-z]*)", text.strip().lower())
    if not m or m.group(2) not in _DURATION_UNITS:
        raise ValueError(f"{text!r} is not a duration (use seconds or 800ms, 30s, 5m, 2h, 1d)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def parse_quantity(text: str) -> float:
    """A positive amount from "1200000", "1.2M", "150k", "12B", "7e9" (k, M, B/G, T suffixes)."""
    if text.strip().startswith("-"):
        raise ValueError(f"{text!r} is negative (use a positive number such as 150000 or 1.2M)")
    m = re.fullmatch(_NUMBER + r"\s*([a-z]?)", text.strip().lower())
    if not m or m.group(2) not in _COUNT_UNITS:
        raise ValueError(f"{text!r} is not a number (use e.g. 150000, 150k, 1.2M, 12B)")
    value = float(m.group(1)) * _COUNT_UNITS[m.group(2)]
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def parse_count(text: str) -> int:
    """A whole count (chips, learners) in any form parse_quantity accepts."""
    value = parse_quantity(text)
    n = round(value)
    # "0.3M" is 300000.00000000006 in binary floating point: a whole number all the same.
    if abs(value - n) > 1e-9 * max(1.0, abs(value)):
        raise ValueError(f"{text!r} is not a whole number")
    return int(n)


def parse_count_list(text: str) -> list[int]:
    """ "1,2,4" -> [1, 2, 4]; each item as parse_count; order kept, duplicates dropped."""
    items = [part.strip() for part in text.split(",")]
    if not items or any(not part for part in items):
        raise ValueError(f"{text!r} is not a comma-separated list (use e.g. 1,2,4,8)")
    out: list[int] = []
    for part in items:
        n = parse_count(part)
        if n not in out:
            out.append(n)
    return out


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """ "chips=150000,300000" -> ("chips", [150000, 300000]); only chips can be swept."""
    key, sep, values = text.partition("=")
    key = key.strip().lower()
    if not sep or key != "chips":
        raise ValueError(f"{text!r} is not KEY=LIST with KEY chips (use chips=150000,300000,600000)")
    return key, parse_count_list(values)


def format_duration(seconds: float) -> str:
    """Short human form: 20s, 10m, 1.5h."""
    if seconds >= 3600 and seconds % 360 == 0:
        return f"{seconds / 3600:g}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


def format_count(n: float) -> str:
    """Short human form: 150k, 1.2M, 12B."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:g}{suffix}"
    return f"{n:g}"
