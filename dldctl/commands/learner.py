"""CLI: `learner add` (scavenged capacity joins mid-run) and `learner remove` (graceful leave).

`--json` prints one `"schema": "dldctl.learner/1"` object on stdout (docs/operations.md); the
progress (host preparation, the wait for the new learners) goes to stderr then.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from dldctl import inventory, rundir
from dldctl.chaos.inject import quorum_left
from dldctl.commands import complete
from dldctl.commands.options import App, LiveRunOpt, output_console
from dldctl.errors import UsageError
from dldctl.lifecycle import converge
from dldctl.observe.snapshot import collect
from dldctl.rundir import RunDir
from dldctl.runstate import RunState
from syncer.common import strictjson

app = App(help="Add or remove learners of a live run.", no_args_is_help=True)
console = output_console()
err_console = output_console(stderr=True)
JsonOpt = typer.Option(False, "--json", help="Print what was done as one JSON object (messages go to stderr).")
SCHEMA = "dldctl.learner/1"
JOIN_TIMEOUT_S = 120.0  # how long `add` waits for its learners to run


def added(run: str, host: str, ids: list[str], state: RunState, now: float) -> dict[str, Any]:
    """The document of `learner add --json`: each new learner, and whether it ran in time."""
    rows = []
    for lid in ids:
        proc = state.procs.get(lid)
        status = None if proc is None else proc.status.value
        pid = None if proc is None or proc.proc is None else proc.proc.pid
        rows.append({"id": lid, "status": status, "pid": pid, "running": status == "running"})
    return {
        "schema": SCHEMA,
        "run": run,
        "action": "add",
        "host": host,
        "added": list(ids),
        "learners": rows,
        "all_running": all(r["running"] for r in rows),
        "timeout_s": JOIN_TIMEOUT_S,
        "t": now,
    }


def removed(run: str, done: converge.Removed, now: float) -> dict[str, Any]:
    """The document of `learner remove --json`: `result` is `leaving` (SIGTERM delivered: it
    sends its due fragments, says bye, exits) or `stopped` (no process was left to tell)."""
    return {
        "schema": SCHEMA,
        "run": run,
        "action": "remove",
        "learner": done.learner,
        "host": done.host,
        "pid": done.pid,
        "result": "leaving" if done.signalled else "stopped",
        "t": now,
    }


@app.command("add")
def add(
    host: str | None = typer.Option(None, "--host", help="Name of the host to run the new learners on."),
    site: str | None = typer.Option(None, "--site", help="Name of the scheduler site to submit the new learners to."),
    count: int = typer.Option(1, "--count", help="How many learners to add."),
    inventory_file: Path | None = typer.Option(
        None, "--inventory", help="An inventory that declares --host, for a host the run does not have yet."
    ),
    no_memory_check: bool = typer.Option(
        False, "--no-memory-check", help="Add them even where the host's free memory cannot hold them (CPU learners)."
    ),
    run: str | None = LiveRunOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Add learners mid-run; they join by fetching the current global state.

    Example: dldctl learner add --host gpu-c --count 2 --inventory inventory.toml
    Example: dldctl learner add --site cluster-a --count 2   (two more Slurm jobs)
    """
    if (host is None) == (site is None):
        raise UsageError("name where the learners go: --host HOST or --site SITE (one of them)")
    name = str(host or site)
    live: RunDir = rundir.resolve(run)
    if inventory_file is not None:
        converge.adopt_host(live, inventory.load(inventory_file).host(name))
    spec = live.read_inventory().host(name)
    if site is not None and not spec.site:
        raise UsageError(f"{name} is a host, not a scheduler site", hint=f"use --host {name}")
    out = err_console if json_out else console
    ids = converge.add(live, name, count, out, wait_s=JOIN_TIMEOUT_S, memory_check=not no_memory_check)
    if json_out:
        print(strictjson.dumps(added(live.name, name, ids, live.read_state(), time.time())), flush=True)


@app.command("remove")
def remove(
    learner: str = typer.Argument(..., help="learner-N", autocompletion=complete.learner_ids),
    run: str | None = LiveRunOpt,
    json_out: bool = JsonOpt,
    force: bool = typer.Option(False, "--force", help="Remove it even if the live fleet falls below the quorum."),
) -> None:
    """Take a learner out gracefully: it sends its due fragments, says bye, is not restarted.
    Refused (unless --force) when the live learners left would be fewer than the minimum quorum.

    Example: dldctl learner remove learner-3
    """
    live = rundir.resolve(run)
    after, quorum = quorum_left(collect(live), learner) if not force else (0, 0)
    if after < quorum:
        raise UsageError(
            f"refused: removing {learner} would leave {after} live learners, below the minimum quorum {quorum}"
            " (the global model would stop progressing)",
            hint="add a learner first (`dldctl learner add`), or pass --force to remove it anyway",
        )
    done = converge.remove(live, learner, err_console if json_out else console)
    if json_out:
        print(strictjson.dumps(removed(live.name, done, time.time())), flush=True)
