"""CLI: `learner add` (scavenged capacity joins mid-run) and `learner remove` (graceful leave)."""

from __future__ import annotations

from pathlib import Path

import typer

from dldctl import inventory, rundir
from dldctl.commands.options import output_console
from dldctl.lifecycle import converge

app = typer.Typer(help="Add or remove learners of a live run.", no_args_is_help=True)
console = output_console()
RunOpt = typer.Option(None, "--run", help="Run directory or run name (default: the most recent live run).")


@app.command("add")
def add(
    host: str = typer.Option(..., "--host", help="Name of the host to run the new learners on."),
    count: int = typer.Option(1, "--count", help="How many learners to add."),
    inventory_file: Path | None = typer.Option(
        None, "--inventory", help="An inventory that declares --host, for a host the run does not have yet."
    ),
    run: str | None = RunOpt,
) -> None:
    """Add learners mid-run; they join by fetching the current global state.

    Example: dldctl learner add --host gpu-c --count 2 --inventory inventory.toml
    """
    live = rundir.resolve(run)
    if inventory_file is not None:
        converge.adopt_host(live, inventory.load(inventory_file).host(host))
    converge.add(live, host, count, console)


@app.command("remove")
def remove(learner: str = typer.Argument(..., help="learner-N"), run: str | None = RunOpt) -> None:
    """Take a learner out gracefully: it sends its due fragments, says bye, is not restarted.

    Example: dldctl learner remove learner-3
    """
    converge.remove(rundir.resolve(run), learner, console)
