"""What the commands share: their help pages' face, the `--run` option, durations with units
("3m", "2s", "800ms", plain seconds), and the console they print to (whole lines when the output
is not a terminal).

The face: every dldctl command and group is built by `App` with `Command` and `Group`, which show
help as an operator reads it: a flag shows no type (typer >= 0.20 writes `<bool>` after it), and
the usage line writes an argument as click always has (`TARGET`, `[INVENTORY]`, `TARGET...`),
not `{target}`.
"""

from __future__ import annotations

from typing import Any

import typer
import typer.core
from rich.console import Console

from dldctl.commands import complete
from dldctl.errors import UsageError
from dldctl.units import parse_duration

PIPE_WIDTH = 200  # the width tables get when the output is not a terminal


def run_option(default: str = "the most recent live run, else the most recent run") -> Any:
    """`--run NAME`, completed from the runs directory; `default` says which run is taken without it."""
    return typer.Option(
        None, "--run", help=f"Run directory or run name (default: {default}).", autocompletion=complete.run_names
    )


RunOpt = run_option()
LiveRunOpt = run_option("the most recent live run")


def _plain_metavars(params: list[Any]) -> list[Any]:
    """The parameters, each flag with an empty metavar (a flag takes no value, so it shows no type)
    and each other one without a metavar of its own named as click names it (`--out OUT`, not
    typer's Python type `<path>`)."""
    for param in params:
        if param.metavar is None and param.param_type_name == "option":
            param.metavar = "" if getattr(param, "is_flag", False) else (param.name or "value").upper()
    return params


def _usage_piece(argument: Any) -> str:
    """An argument on the usage line: its metavar or upper-case name, [bracketed] when optional."""
    name = argument.metavar or argument.name.upper()
    if not argument.required:
        name = f"[{name}]"
    return name + ("..." if argument.nargs != 1 else "")


class Command(typer.core.TyperCommand):
    """A dldctl command: flags without a type, arguments written as click writes them."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_metavars(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        arguments = [p for p in self.get_params(ctx) if p.param_type_name == "argument"]
        return pieces + [_usage_piece(a) for a in arguments]


class Group(typer.core.TyperGroup):
    """A dldctl command group: flags without a type."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_metavars(super().get_params(ctx))


class App(typer.Typer):
    """typer.Typer whose groups are `Group`s and whose commands are `Command`s."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("cls", Group)
        super().__init__(**kwargs)

    def command(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("cls", Command)
        return super().command(*args, **kwargs)


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
