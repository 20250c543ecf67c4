"""CLI: `status` (live view, `--once`, `--json`) and `report`."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.live import Live

from dldctl import rundir
from dldctl.chaos.runner import sigterm_interrupts
from dldctl.commands.options import duration, output_console
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
    json_out: bool = typer.Option(False, "--json", help="Print one snapshot as JSON (with --watch: JSON lines)."),
    watch: bool = typer.Option(
        False, "--watch", "-w", help="Without a terminal: print a snapshot every --interval until interrupted."
    ),
    interval: str = typer.Option("1s", "--interval", help="Time between refreshes of the live view: 2s, 500ms."),
) -> None:
    """Quorum, goodput, throughput, bandwidth, loss, learners and events of a run.

    Example: dldctl status --once
    """
    every_s = duration("--interval", interval)
    target = rundir.resolve(run, live_only=False)
    if watch:
        stream(target, every_s, json_out)
    elif json_out:
        print(strictjson.dumps(snapshot.collect(target)))
    elif once or not sys.stdout.isatty():  # a pipe or a file gets one snapshot, never a screen
        plain_console().print(render_plain(snapshot.collect(target), time.time()))
    else:
        live_view(target, every_s)


def plain_console() -> Console:
    """Plain text that a pipe or a file keeps whole: no colour codes, no wrapping at 80 columns."""
    return output_console()


def stream(run: RunDir, interval: float, as_json: bool) -> None:
    """A snapshot every `interval` s (JSON lines, or plain text blocks) until Ctrl-C or SIGTERM."""
    console = plain_console()
    try:
        with sigterm_interrupts():  # a script stops it with `kill`, and SIGINT may be ignored there
            _stream_loop(run, interval, as_json, console)
    except (KeyboardInterrupt, BrokenPipeError):
        # Stopped, or the reader left (`| head`): drop what is still buffered, so the flush at exit
        # neither blocks on a pipe nobody reads nor complains about a closed one.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _stream_loop(run: RunDir, interval: float, as_json: bool, console: Console) -> None:
    while True:
        snap = snapshot.collect(run)
        if as_json:
            print(strictjson.dumps(snap), flush=True)
        else:
            console.print(render_plain(snap, time.time()))
            console.print()
            sys.stdout.flush()
        time.sleep(interval)


def report(
    run: str | None = RunOpt,
    out: Path | None = typer.Option(None, "--out", help="Output directory (default: RUN/report)."),
    json_out: bool = typer.Option(False, "--json", help="Print the run, the output directory and the files as JSON."),
) -> None:
    """PNG plots and a markdown summary of a run, live or finished.

    Example: dldctl report --out /tmp/report
    """
    from dldctl.commands.report import report_command  # matplotlib takes a second to import

    report_command(rundir.resolve(run, live_only=False).path, out, json_out=json_out)
