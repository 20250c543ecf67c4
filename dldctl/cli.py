"""The `dldctl` command: one Typer app composed from one module per command group.

Errors: every DldError, and every usage mistake the command line parser finds (a missing
argument, an unknown option, a bad value), is printed as one red line on stderr and exits with
its code (1 failed, 2 usage/configuration); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, MutableMapping
from typing import Any, cast

import typer
from rich.console import Console
from rich.markup import escape

from dldctl.commands.options import App, Group
from dldctl.errors import DldError

# command -> (module, attribute): a function is one command, a Typer a group. A module is imported
# when its command runs (or a help page lists it): `dldctl status` does not pay for the simulator's
# numpy or the SSH hosts' paramiko, and a command starts in about half the time.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("dldctl.commands.run", "up"),
    "down": ("dldctl.commands.run", "down"),
    "status": ("dldctl.commands.status", "status"),
    "runs": ("dldctl.commands.runs", "runs"),
    "logs": ("dldctl.commands.logs", "logs"),
    "events": ("dldctl.commands.events", "events"),
    "export": ("dldctl.commands.export", "export"),
    "check": ("dldctl.commands.run", "check"),
    "report": ("dldctl.commands.status", "report"),
    "chaos": ("dldctl.commands.chaos", "app"),
    "learner": ("dldctl.commands.learner", "app"),
    "simulate": ("dldctl.commands.simulate", "app"),
}


def load_command(name: str) -> Any:
    """The parser's command for `name` (COMMANDS), built from its module on first use."""
    module, attribute = COMMANDS[name]
    target = getattr(importlib.import_module(module), attribute)
    if isinstance(target, typer.Typer):
        command: Any = typer.main.get_group(target)  # a group, without the root's completion options
    else:
        single = App(add_completion=False)
        single.command(name=name)(target)
        command = typer.main.get_command(single)
    command.name = name
    return command


class _LazyCommands(MutableMapping[str, Any]):
    """The root group's commands: the names of COMMANDS, each built when first looked up."""

    def __init__(self) -> None:
        self._built: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            if name not in COMMANDS:
                raise KeyError(name)
            self._built[name] = load_command(name)
        return self._built[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._built[name] = command

    def __delitem__(self, name: str) -> None:
        raise TypeError("dldctl's commands are fixed")

    def __iter__(self) -> Iterator[str]:
        return iter(COMMANDS)

    def __len__(self) -> int:
        return len(COMMANDS)


class _RootGroup(Group):
    """dldctl's group, with its commands looked up in COMMANDS on demand."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.commands = _LazyCommands()


app = typer.Typer(
    cls=_RootGroup,
    name="dldctl",
    help="Operate Decoupled DiLoCo training runs: bring a fleet up, break it on purpose, watch it heal.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        import importlib.metadata  # 30 ms that only --version needs

        try:
            version = importlib.metadata.version("dldctl")
        except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
            version = "unknown (not installed)"
        typer.echo(f"dldctl {version}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print dldctl's version and exit."
    ),
) -> None:
    """Operate Decoupled DiLoCo training runs: bring a fleet up, break it on purpose, watch it heal."""


def _parser_error_class() -> type[Exception]:
    """The command-line parser's exception base, reached through typer's public `BadParameter`.

    typer >= 0.16 carries its own copy of click and older typer re-exports click's; the base is
    `ClickException` in both, and neither needs a private import.
    """
    base = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    return cast("type[Exception]", base)


ClickException = _parser_error_class()


def _error(text: str) -> None:
    Console(stderr=True, soft_wrap=True, highlight=False).print(f"[bold red]error:[/] {escape(text)}")


def main() -> None:
    """Console-script entry point: one red line for every mistake, the help for a bare group."""
    command = typer.main.get_command(app)
    try:
        code = command.main(prog_name="dldctl", standalone_mode=False)
    except DldError as exc:
        _error(exc.line())
        sys.exit(exc.exit_code)
    except ClickException as exc:
        parser_error: Any = exc  # a ClickException: format_message, show, exit_code, ctx
        ctx = getattr(parser_error, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError":  # `dldctl` or `dldctl chaos` alone: the help
            parser_error.show()
        else:
            _error(parser_error.format_message() + (f" (`{ctx.command_path} -h` for help)" if ctx is not None else ""))
        sys.exit(parser_error.exit_code)
    except typer.Abort:
        _error("aborted")
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
