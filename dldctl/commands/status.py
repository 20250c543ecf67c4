"""CLI: `status` (live view, `--once`, `--json`) and `report`."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import typer
from rich.console import Console, RenderableType

from dldctl import extras, rundir
from dldctl.chaos.inject import Chaos
from dldctl.commands.logs import log_location as _log_location
from dldctl.commands.options import RunOpt, duration, output_console
from dldctl.errors import DldError
from dldctl.interrupts import interruptible
from dldctl.observe import snapshot
from dldctl.observe.view import render_plain
from dldctl.observe.view_keys import Command
from dldctl.observe.view_tty import KeyReader, Sources, drive
from dldctl.rundir import RunDir
from syncer.common import strictjson

VIEW = "the live view"  # who a kill confirmed in the view is attributed to


def live_view(run: RunDir, interval: float = 1.0) -> None:
    """Full-screen view refreshed every `interval` s, driven by keys (`?` lists them); `q`, Ctrl-C
    or SIGTERM leave the view, not the run."""
    console = Console()
    logs = _LogTails(run)
    sources = Sources(collect=lambda: snapshot.take(run), log=logs.lines, act=lambda c: _act(run, c))
    try:
        with interruptible(), KeyReader() as keys:
            drive(sources, interval, console, keys)
    except KeyboardInterrupt:
        pass
    finally:
        logs.close()
    console.print(f"left the live view; run {run.name} keeps running (`dldctl down` stops it)")


class _LogTails:
    """A learner's newest log lines, read as `dldctl logs` does; hosts kept open while the view is."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.where: dict[str, tuple] = {}

    def lines(self, target: str, count: int = 40) -> list[str]:
        try:
            if target not in self.where:
                self.where[target] = _log_location(self.run, target)
            host, path = self.where[target]
            return host.tail(path, count).splitlines()
        except DldError as exc:
            return [f"(no log: {exc.message})"]
        except (OSError, ValueError) as exc:  # the run's files, or a host's connection
            return [f"(no log: {exc})"]

    def close(self) -> None:
        for host, _ in self.where.values():
            host.close()


def _act(run: RunDir, command: Command) -> str:
    """Run a kill or pause confirmed in the view, behind chaos's quorum guard (which refuses here:
    the view asked already); the line to show."""
    try:
        chaos = Chaos(run)
        try:
            chaos.guard(command.action, command.target, False, None)
            if command.action == "kill":
                done = chaos.kill(command.target, by=VIEW)
            else:
                done = chaos.fault(command.action, command.target, command.seconds)
        finally:
            chaos.close()
    except DldError as exc:
        return f"{exc.message} (`dldctl chaos {command.action} {command.target} --force` insists)"
    return f"{command.action} {command.target}: {done.detail}"


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
        print_plain(plain_console(), render_plain(snapshot.take(target), time.time()))
    else:
        live_view(target, every_s)


def plain_console() -> Console:
    """Plain text that a pipe or a file keeps whole: no colour codes, no wrapping at 80 columns."""
    return output_console()


def print_plain(console: Console, renderable: RenderableType) -> None:
    """Print `renderable`; without a terminal (a pipe, a file) its lines end where their text does,
    not padded with spaces to the console's width (tables pad every cell to its column)."""
    if console.is_terminal:
        console.print(renderable)
        return
    with console.capture() as captured:
        console.print(renderable)
    console.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def stream(run: RunDir, interval: float, as_json: bool) -> None:
    """A snapshot every `interval` s (JSON lines, or plain text blocks) until Ctrl-C or SIGTERM."""
    console = plain_console()
    try:
        with interruptible():  # a script stops it with `kill`, and SIGINT may be ignored there
            _stream_loop(run, interval, as_json, console)
    except (KeyboardInterrupt, BrokenPipeError):
        # Stopped, or the reader left (`| head`): drop what is still buffered, so the flush at exit
        # neither blocks on a pipe nobody reads nor complains about a closed one.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _stream_loop(run: RunDir, interval: float, as_json: bool, console: Console) -> None:
    while True:
        snap = snapshot.take(run)
        if as_json:
            print(strictjson.dumps(snap.to_json()), flush=True)
        else:
            print_plain(console, render_plain(snap, time.time()))
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
    extras.require("matplotlib", "dldctl report draws its plots with")
    from dldctl.commands.report import report_command  # matplotlib takes a second to import

    report_command(rundir.resolve(run, live_only=False).path, out, json_out=json_out)
