"""The `dldctl` command: one Typer app composed from one module per command group.

Errors: every DldError is printed as one red line on stderr and exits with its code (1 failed,
2 usage/configuration); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from dldctl import cli_chaos, cli_learner, cli_run, cli_simulate, cli_status
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


def main() -> None:
    """Console-script entry point."""
    command = typer.main.get_command(app)
    try:
        command.main(prog_name="dldctl", standalone_mode=True)
    except DldError as exc:
        Console(stderr=True, soft_wrap=True, highlight=False).print(f"[bold red]error:[/] {escape(exc.line())}")
        sys.exit(exc.exit_code)
