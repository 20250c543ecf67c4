"""CLI: `status` (live view, `--once`, `--json`) and `report`."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console
from rich.live import Live

from dldctl import rundir
from dldctl.commands.options import duration
from dldctl.observe import snapshot
from dldctl.observe.view import History, render_live, render_plain
from dldctl.rundir import RunDir
from syncer.common import strictjson

RunOpt = typer.Option(None, "--run", help="Run directory or run name (default: the most recent live run).")


def live_view(run: RunDir, interval: float = 1.0) -> None:
    """Full-screen view refreshed every `interval` s; Ctrl-C leaves the view, not the run."""
    history = History()
    console = Console()
    try:
        with Live(console=console, screen=True, auto_refresh=False, transient=True) as live:
            while True:
                snap = snapshot.collect(run)
                history.add(snap)
                live.update(render_live(snap, history, time.time()), refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        console.print(f"left the live view; run {run.name} keeps running (`dldctl down` stops it)")


def status(
    run: str | None = RunOpt,
    once: bool = typer.Option(False, "--once", help="Print one plain snapshot (no screen control)."),
    json_out: bool = typer.Option(False, "--json", help="Print one snapshot as JSON."),
    interval: str = typer.Option("1s", "--interval", help="Time between refreshes of the live view: 2s, 500ms."),
) -> None:
    """Quorum, goodput, throughput, bandwidth, loss, learners and events of a run.

    Example: dldctl status --once
    """
    every_s = duration("--interval", interval)
    target = rundir.resolve(run, live_only=False)
    if json_out:
        print(strictjson.dumps(snapshot.collect(target)))
        return
    if once:
        Console(highlight=False).print(render_plain(snapshot.collect(target), time.time()))
        return
    live_view(target, every_s)


def report(
    run: str | None = RunOpt,
    out: Path | None = typer.Option(None, "--out", help="Output directory (default: RUN/report)."),
) -> None:
    """PNG plots and a markdown summary of a run, live or finished.

    Example: dldctl report --out /tmp/report
    """
    from dldctl.commands.report import report_command  # matplotlib takes a second to import

    report_command(rundir.resolve(run, live_only=False).path, out)
