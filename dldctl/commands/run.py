"""CLI: `up`, `down`, `logs`, `check` — bringing a run up and down and looking inside it."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from dldctl import inventory, rundir
from dldctl.commands.options import duration, output_console
from dldctl.errors import DldError, UsageError
from dldctl.hosts import LocalHost
from dldctl.inventory import Inventory
from dldctl.lifecycle import check as check_mod
from dldctl.lifecycle import converge, kernel, plan
from dldctl.lifecycle import down as down_mod
from dldctl.lifecycle import up as up_mod
from dldctl.lifecycle.provision import HostRuntime, open_host
from syncer.common import strictjson

console = output_console()
err_console = Console(stderr=True, highlight=False, soft_wrap=True)
RunOpt = typer.Option(None, "--run", help="Run directory or run name (default: the most recent live run).")


def load_inventory(path: Path | None) -> Inventory:
    return inventory.load(path) if path is not None else inventory.default_inventory()


def up(
    inventory_file: Path | None = typer.Argument(
        None, metavar="[INVENTORY]", help="Inventory TOML; none = the built-in local default."
    ),
    detach: bool = typer.Option(
        False, "--detach", "-d", help="Return once the fleet is up instead of opening the live view."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and touch nothing."),
    timeout: str = typer.Option("3m", "--timeout", help="How long to wait for every process to run: 90s, 3m, 180."),
) -> None:
    """Provision the hosts, start the syncer and every learner, keep them alive.

    Example: dldctl up inventory.toml --detach
    """
    wait_s = duration("--timeout", timeout)
    inv = load_inventory(inventory_file)
    if dry_run:
        for line in plan.describe(inv):
            console.print(line)
        console.print("[dim](dry run: nothing was touched)[/]")
        return
    for risk in inv.run.risks(len(plan.learner_plans(inv))):
        err_console.print(f"[yellow]warning:[/] {risk}")
    live = rundir.find_live(inv.run.name)
    orphan = None if live else rundir.find_orphan(inv.run.name)
    if orphan is not None:  # its supervisor died: bring it back, then converge
        console.print(f"[yellow]run {orphan.name} lost its supervisor; restarting it[/]")
        up_mod.start_supervisor(orphan)
        live = orphan
    if live is not None:
        converge.converge(live, inv, console)
        run = live
    else:
        run = up_mod.up(inv, str(inventory_file) if inventory_file else None, console, wait_s)
    console.print(
        f"\n[bold green]up:[/] {run.name}\n  dldctl status          live view\n"
        f"  dldctl logs learner-0  a learner's log\n  dldctl chaos kill learner-1\n  dldctl down"
    )
    if not detach and not sys.stdout.isatty():  # a pipe, a file, CI: nobody to watch the live view
        console.print("stdout is not a terminal: detached (`dldctl status --watch` streams the run)")
    elif not detach:
        from dldctl.commands.status import live_view

        live_view(run, interval=1.0)


def down(
    run: str | None = RunOpt, json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON.")
) -> None:
    """Stop everything on every host: final checkpoint, final model, a summary.

    Example: dldctl down --run default
    """
    target = rundir.resolve(run, live_only=False)
    done = down_mod.already_down(target)
    if done is not None:  # a second `down`: say so, touch nothing, log no event
        if json_out:
            print(strictjson.dumps(done))
        else:
            console.print(f"run {done['run']} is already down; final model: {done['final_model'] or 'none'}")
        return
    summary = down_mod.down(target, output_console(stderr=True) if json_out else console)
    if json_out:
        print(strictjson.dumps(summary))
        return
    table = Table(title=f"run {summary['run']} is down", show_header=False, box=None)
    for key, value in summary.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        table.add_row(key, str(value))
    console.print(table)


def logs(
    target: str = typer.Argument(..., help="learner-N, syncer or supervisor"),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines."),
    tail: int = typer.Option(50, "--tail", help="Lines from the end to start with."),
    run: str | None = RunOpt,
) -> None:
    """Print (or follow) the log of a learner, the syncer or the supervisor.

    Example: dldctl logs learner-2 -f
    """
    r = rundir.resolve(run, live_only=False)
    host, path = _log_location(r, target)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        if not follow:
            print(host.tail(path, tail))
            return
        for line in host.follow(path, from_end_lines=tail, stop=stop.is_set):
            print(line, flush=True)
    finally:
        host.close()


def _log_location(run: rundir.RunDir, target: str) -> tuple:
    if target == "supervisor":
        return LocalHost("local"), str(run.supervisor_log)
    state = run.read_state()
    proc = state.procs.get(target)
    if proc is None:
        known = ", ".join(sorted(state.procs)) + ", supervisor"
        raise UsageError(f"no process named {target!r} in run {run.name}", hint=f"known: {known}")
    runtime = HostRuntime.from_dict(dict(state.runtime_of(proc.host)))
    inv = inventory.parse(json.loads((run.path / "inventory.json").read_text()), str(run.inventory))
    spec = next((h for h in inv.hosts if h.name == proc.host), None)
    host = LocalHost("local") if spec is None or spec.local else open_host(spec, inv.ssh)
    return host, f"{runtime.run_dir}/logs/{target}.log"


def check(
    inventory_file: Path | None = typer.Argument(
        None, metavar="[INVENTORY]", help="Inventory TOML; none = the built-in default."
    ),
) -> None:
    """Check every host: SSH, host key, Python, torch, device, and the syncer's port; and the
    syncer's native merge kernel on this machine.

    Example: dldctl check inventory.toml
    """
    inv = load_inventory(inventory_file)
    results = check_mod.check(inv)
    table = Table(title=f"dldctl check {inv.path}")
    table.add_column("host")
    columns = ["ssh", "python", "torch", "device", "port"]
    for col in columns:
        table.add_column(col, overflow="fold")
    for res in results:
        cells = []
        for col in columns:
            if col in res.items:
                passed, detail = res.items[col]
                cells.append(f"[{'green' if passed else 'red'}]{'ok' if passed else 'FAIL'}[/] {detail}")
            else:
                cells.append("[dim]-[/]")
        table.add_row(f"[{'green' if res.ok else 'red'}]{res.name}[/]", *cells)
    console.print(table)
    native = kernel.build()
    console.print(f"[{'green' if native.ok else 'yellow'}]syncer (this machine):[/] {native.line()}", highlight=False)
    bad = [r.name for r in results if not r.ok]
    if bad:
        raise DldError(f"{len(bad)} of {len(results)} hosts failed the check: {', '.join(bad)}")
