"""CLI: `dldctl events` — a run's events, filtered by kind, target and age; `-f` follows them."""

from __future__ import annotations

import os
import sys
import time

import typer

from dldctl import eventlog, rundir
from dldctl.commands.options import RunOpt, duration
from dldctl.interrupts import interruptible
from syncer.common import strictjson


def events(
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new events until interrupted."),
    kind: list[str] = typer.Option(
        [], "--kind", metavar="KIND", help="Only these kinds (repeat or comma-separate): death,restart."
    ),
    target: str | None = typer.Option(None, "--target", help="Only targets matching this glob: learner-*, syncer."),
    since: str | None = typer.Option(None, "--since", help="Only events of the last 5m, 2h, 30s."),
    tail: int = typer.Option(50, "--tail", help="How many past events to print first (0 = none, -1 = all)."),
    json_out: bool = typer.Option(False, "--json", help="JSON lines, one event each."),
    run: str | None = RunOpt,
) -> None:
    """Print (and with -f follow) the run's events: joins, deaths, restarts, checkpoints, faults.

    Example: dldctl events -f --kind death,restart --target 'learner-*'
    """
    kinds = frozenset(k.strip() for item in kind for k in item.split(",") if k.strip())
    start = time.time() - duration("--since", since) if since is not None else None
    keep = eventlog.Filter(kinds, target, start)
    path = rundir.resolve(run, live_only=False).events
    so_far, where = eventlog.past(path)
    matching = [r for r in so_far if keep(r)]
    shown = matching if tail < 0 else matching[len(matching) - tail :] if tail > 0 else []
    today = time.strftime("%Y-%m-%d")
    emit = (
        (lambda r: print(strictjson.dumps(eventlog.as_json(r)), flush=True))
        if json_out
        else (lambda r: print(eventlog.line(r, today), flush=True))
    )
    try:
        for record in shown:
            emit(record)
        if follow:
            with interruptible():  # a script stops it with `kill`
                for record in eventlog.follow(path, lambda: False, where):
                    if keep(record):
                        emit(record)
    except (KeyboardInterrupt, BrokenPipeError):  # stopped, or the reader left (`| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
