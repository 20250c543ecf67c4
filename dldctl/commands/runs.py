"""CLI: `dldctl runs` — every run, newest first: name, state, age, hosts, progress, last eval loss."""

from __future__ import annotations

import typer
from rich.table import Table

from dldctl.commands.options import output_console
from dldctl.observe import runs as runs_mod
from dldctl.observe.view_data import fmt_count, fmt_duration, fmt_int
from syncer.common import strictjson

STATE_STYLE = {"up": "green", "starting": "yellow", "crashed": "red", "stopping": "yellow", "unreadable": "red"}


def runs(json_out: bool = typer.Option(False, "--json", help="Print the runs as JSON.")) -> None:
    """List the runs under $DLDCTL_HOME/runs: state, age, hosts, outer steps, tokens, last eval loss.

    Example: dldctl runs --json
    """
    listing = runs_mod.collect()
    if json_out:
        print(strictjson.dumps(listing))
        return
    console = output_console()
    if not listing["runs"]:
        console.print("no runs yet (`dldctl up` starts one)")
        return
    table = Table(box=None, header_style="bold")
    for name in ("run", "state", "age", "hosts", "learners", "outer steps", "tokens merged", "eval loss"):
        table.add_column(name, no_wrap=True)
    for r in listing["runs"]:
        style = STATE_STYLE.get(r["state"], "")
        table.add_row(
            r["name"],
            f"[{style}]{r['state']}[/]" if style else r["state"],
            fmt_duration(r["age_s"]),
            ",".join(r["hosts"]) or "-",
            str(r["learners"]),
            fmt_int(r.get("outer_steps")),
            fmt_count(r.get("tokens_merged")),
            runs_mod.loss_cell(r),
        )
    console.print(table)
    console.print("[dim]dldctl up --resume RUN continues a down or crashed run; dldctl status --run RUN shows one[/]")
