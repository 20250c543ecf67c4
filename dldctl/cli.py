"""The `dldctl` command: one Typer app composed from one module per command group.

Errors: every DldError, and every usage mistake the command line parser finds (a missing
argument, an unknown option, a bad value), is printed as one red line on stderr and exits with
its code (1 failed, 2 usage/configuration); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from dldctl.commands import chaos as cli_chaos
from dldctl.commands import learner as cli_learner
from dldctl.commands import run as cli_run
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
app.command()(cli_run.up)
app.command()(cli_run.down)
app.command()(cli_status.status)
app.command()(cli_run.logs)
app.command()(cli_run.check)
app.command()(cli_status.report)
app.add_typer(cli_chaos.app, name="chaos")
app.add_typer(cli_learner.app, name="learner")
app.add_typer(cli_simulate.app, name="simulate")


try:  # typer >= 0.16 carries its own copy of click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - older typer on the real click
    # click itself is not installed beside a typer that carries its own copy (as here)
    from click.exceptions import ClickException  # type: ignore[import-not-found,no-redef]


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
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError":  # `dldctl` or `dldctl chaos` alone: the help
            exc.show()
        else:
            _error(exc.format_message() + (f" (`{ctx.command_path} -h` for help)" if ctx is not None else ""))
        sys.exit(exc.exit_code)
    except typer.Abort:
        _error("aborted")
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
