"""The `dldctl` command: one Typer app composed from one module per command group.

Errors: every DldError, and every usage mistake the command line parser finds (a missing
argument, an unknown option, a bad value), is printed as one red line on stderr and exits with
its code (1 failed, 2 usage/configuration); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any, cast

import typer
from rich.console import Console
from rich.markup import escape

from dldctl.commands import chaos as cli_chaos
from dldctl.commands import events as cli_events
from dldctl.commands import export as cli_export
from dldctl.commands import learner as cli_learner
from dldctl.commands import logs as cli_logs
from dldctl.commands import run as cli_run
from dldctl.commands import runs as cli_runs
from dldctl.commands import simulate as cli_simulate
from dldctl.commands import status as cli_status
from dldctl.errors import DldError

app = typer.Typer(
    name="dldctl",
    help="Operate Decoupled DiLoCo training runs: bring a fleet up, break it on purpose, watch it heal.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
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


app.command()(cli_run.up)
app.command()(cli_run.down)
app.command()(cli_status.status)
app.command()(cli_runs.runs)
app.command()(cli_logs.logs)
app.command()(cli_events.events)
app.command()(cli_export.export)
app.command()(cli_run.check)
app.command()(cli_status.report)
app.add_typer(cli_chaos.app, name="chaos")
app.add_typer(cli_learner.app, name="learner")
app.add_typer(cli_simulate.app, name="simulate")


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
