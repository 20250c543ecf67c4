"""What the commands share: durations with units ("3m", "2s", "800ms", plain seconds), and the
console they print to (whole lines when the output is not a terminal)."""

from __future__ import annotations

from rich.console import Console

from dldctl.errors import UsageError
from dldctl.units import parse_duration

PIPE_WIDTH = 200  # the width tables get when the output is not a terminal


def duration(flag: str, text: str, *, positive: bool = True) -> float:
    """Seconds from a flag's value; a bad one is a UsageError naming the flag."""
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    if positive and seconds <= 0:
        raise UsageError(f"{flag} must be > 0 (got {text!r})")
    return seconds


def output_console(*, stderr: bool = False) -> Console:
    """The console a command prints to: as is on a terminal; without one (a pipe, a file, CI) no
    line is ever wrapped or cut and tables get room, so a script reads whole keys and paths."""
    console = Console(stderr=stderr, highlight=False)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=PIPE_WIDTH)
