"""CLI: `up`, `down`, `check` — bringing a run up and down (`logs` is dldctl/commands/logs.py)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dldctl import extras, inventory, rundir, syncermem, uplock
from dldctl.commands import complete
from dldctl.commands.options import RunOpt, duration, output_console
from dldctl.errors import DldError, OperationError, UsageError
from dldctl.inventory import Inventory
from dldctl.lifecycle import check as check_mod
from dldctl.lifecycle import converge, kernel, memcheck, modelprobe, plan
from dldctl.lifecycle import down as down_mod
from dldctl.lifecycle import resume as resume_mod
from dldctl.lifecycle import up as up_mod
from dldctl.observe import snapshot
from dldctl.observe.view_data import fmt_bytes, fmt_count, fmt_duration, fmt_float, fmt_pct
from syncer.common import jsonlread, strictjson, unscored

console = output_console()
err_console = Console(stderr=True, highlight=False, soft_wrap=True)
DOWN_SCHEMA = "dldctl.down/1"


def load_inventory(path: Path | None) -> Inventory:
    return inventory.load(path) if path is not None else inventory.default_inventory()


def up(
    inventory_file: Path | None = typer.Argument(
        None, metavar="INVENTORY", help="Inventory TOML; none = the built-in local default."
    ),
    detach: bool = typer.Option(
        False, "--detach", "-d", help="Return once the fleet is up instead of opening the live view."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and touch nothing."),
    timeout: str = typer.Option("3m", "--timeout", help="How long to wait for every process to run: 90s, 3m, 180."),
    resume: str | None = typer.Option(
        None,
        "--resume",
        metavar="RUN",
        autocompletion=complete.run_names,
        help="Continue a down or crashed run from its newest checkpoint.",
    ),
    wait: bool = typer.Option(
        False, "--wait", help="Return once the quorum is live and merges happened (up to --timeout more); implies -d."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the run id and endpoints as JSON; implies -d."),
    no_memory_check: bool = typer.Option(
        False,
        "--no-memory-check",
        help="Start even where a host's memory is below its shards' or CPU learners' need.",
    ),
) -> None:
    """Provision the hosts, start the syncer and every learner, keep them alive.

    Example: dldctl up inventory.toml --detach
    """
    wait_s = duration("--timeout", timeout)
    out = output_console(stderr=True) if json_out else console
    if resume is not None:
        run = _resume(resume, inventory_file, dry_run, out, wait_s, memory_check=not no_memory_check)
    else:
        inv = load_inventory(inventory_file)
        if dry_run:
            for line in plan.describe(inv):
                console.print(line, markup=False, highlight=False)
            answers = probe_model(inv)
            said = "no run was started; the model was probed on its hosts" if answers else "nothing was touched"
            console.print(f"[dim](dry run: {said})[/]")
            return
        run = _start_or_converge(inv, inventory_file, out, wait_s, memory_check=not no_memory_check)
    merging = _wait_merging(run, wait_s, out) if wait else None
    if json_out:
        print(strictjson.dumps(up_record(run, merging)))
        return
    console.print(
        f"\n[bold green]up:[/] {run.name}\n  dldctl status          live view\n"
        f"  dldctl logs learner-0  a learner's log\n  dldctl chaos kill learner-1\n  dldctl down"
    )
    if detach or wait:
        return
    if not sys.stdout.isatty():  # a pipe, a file, CI: nobody to watch the live view
        console.print("stdout is not a terminal: detached (`dldctl status --watch` streams the run)")
        return
    from dldctl.commands.status import live_view

    live_view(run, interval=1.0)


def _start_or_converge(
    inv: Inventory, inventory_file: Path | None, out: Console, wait_s: float, memory_check: bool = True
) -> rundir.RunDir:
    """A new run, or the live run of this name converged to the inventory (an orphan restarted)."""
    extras.require_for_run(inv)  # no torch here for a local learner or syncer: one line, nothing touched
    for risk in inv.run.risks(len(plan.learner_plans(inv))):
        err_console.print(f"[yellow]warning:[/] {risk}")
    with uplock.holding(inv.run.name):  # a second `up` of this run now is refused, not a second run
        return _start_or_converge_locked(inv, inventory_file, out, wait_s, memory_check)


def _start_or_converge_locked(
    inv: Inventory, inventory_file: Path | None, out: Console, wait_s: float, memory_check: bool
) -> rundir.RunDir:
    live = rundir.find_live(inv.run.name)
    orphan = None if live else rundir.find_orphan(inv.run.name)
    if orphan is not None:  # its supervisor died: bring it back, then converge
        out.print(f"[yellow]run {orphan.name} lost its supervisor; restarting it[/]")
        up_mod.start_supervisor(orphan)
        live = orphan
    if live is not None:
        converge.converge(live, inv, out, memory_check)
        return live
    return up_mod.up(inv, str(inventory_file) if inventory_file else None, out, wait_s, memory_check)


def _resume(
    name: str, inventory_file: Path | None, dry_run: bool, out: Console, wait_s: float, memory_check: bool = True
) -> rundir.RunDir:
    if inventory_file is not None or dry_run:
        raise UsageError(
            "--resume continues a run with its own inventory and settings",
            hint=f"drop {'INVENTORY' if inventory_file else '--dry-run'}; `dldctl runs` lists the runs",
        )
    target = rundir.resolve(name, live_only=False)
    if target.live():  # nothing to do: as a second `down` is
        out.print(f"run {target.name} is up already")
        return target
    stored = target.read_inventory()
    extras.require_for_run(stored)
    with uplock.holding(stored.run.name):
        if target.live():  # another `up --resume` brought it back meanwhile
            out.print(f"run {target.name} is up already")
            return target
        run, _ = resume_mod.resume(target, out, wait_s, memory_check)
    return run


def _wait_merging(run: rundir.RunDir, wait_s: float, out: Console) -> dict[str, Any]:
    """Until the quorum is live and the syncer merged since we began (OperationError after `wait_s`)."""
    out.print("waiting for the quorum and the first merges...")
    deadline = time.monotonic() + wait_s
    first: int | None = None
    snap = snapshot.collect(run)
    while True:
        steps = snap["syncer"].get("outer_steps") if snap["syncer"].get("alive") else None
        first = steps if first is None else first
        live, need = snap["quorum"]["live"], snap["quorum"]["min"]
        if steps is not None and first is not None and steps > first and live >= need:
            out.print(f"merging: outer step {steps}, {live} learners live (quorum {need})")
            off = global_off_settled(run, snap, min(SETTLE_S, max(0.0, deadline - time.monotonic())))
            if off:  # training works (exit 0), but nothing guards the global model
                out.print(f"[yellow]warning:[/] {escape(global_off_warning(off))}", highlight=False)
            return {"outer_steps": steps, "live": live, "quorum": need, "global_off": off}
        if time.monotonic() >= deadline:
            why = why_not_merging(snap, first, last_syncer_death(run))
            raise OperationError(f"run {run.name}: {why} after {wait_s:.0f} s", hint=WAIT_HINT)
        time.sleep(0.5)
        snap = snapshot.collect(run)


WAIT_HINT = "`dldctl status` shows the fleet and `dldctl logs learner-N` why a learner is not up; the run keeps going"
SETTLE_S = 10.0  # once merging, how long `up --wait` waits for a first score or the reason there is none


def global_off_settled(run: rundir.RunDir, snap: dict[str, Any], wait_s: float) -> str | None:
    """Why the global model is not scored (`loss.global_off`), once the syncer knows: a first score
    or a reason, or `wait_s` passed (None: it is scored, or not known yet)."""
    until = time.monotonic() + wait_s
    while True:
        loss = snap.get("loss") or {}
        off = loss.get("global_off")
        if off or loss.get("global") is not None or time.monotonic() >= until:
            return str(off) if off else None
        time.sleep(0.5)
        snap = snapshot.collect(run)


def global_off_warning(off: str) -> str:
    """`up --wait`'s warning line for a global model that is not scored (pure)."""
    fix = unscored.fix(off)
    return (
        f"the global model is not scored, so the quality guard is off: {off}"
        + (f"; {fix}" if fix else "")
        + ("" if unscored.on_purpose(off) else " (`dldctl status` shows it; training goes on)")
    )


def last_syncer_death(run: rundir.RunDir) -> str | None:
    """How the syncer last died: the end of its log, as its `syncer_death` event quotes it."""
    for event in reversed(jsonlread.tail(run.events, 500)):
        if event.get("kind") == "syncer_death":
            detail = str(event.get("detail", ""))
            return detail.partition("its log ends: ")[2] or detail
    return None


def why_not_merging(snap: dict[str, Any], first: int | None, died: str | None = None) -> str:
    """The reason `up --wait` gave up, from a status snapshot and how the syncer last died (pure)."""
    if not snap["syncer"].get("alive"):
        return "the syncer is not answering" + (f" (it died: {died.strip()})" if died else "")
    live, need = snap["quorum"]["live"], snap["quorum"]["min"]
    if live < need:
        down = [
            f"{r['id']} {r['state']}" for r in snap.get("learners", []) if r.get("state") not in ("running", "slow")
        ]
        return f"only {live} of the {need} learners the quorum needs are live" + (
            f" (not live: {', '.join(down)})" if down else ""
        )
    return f"no merge yet (outer step {first}), though {live} learners are live"


def up_record(run: rundir.RunDir, merging: dict[str, Any] | None) -> dict[str, Any]:
    """What `up --json` prints: the run, where its syncer listens, its processes."""
    config, state = run.read_config(), run.read_state()
    return {
        "schema": "dldctl.up/1",
        "run": run.name,
        "run_id": config.run_id,
        "dir": str(run.path),
        "syncer": {"host": config.syncer.host, "address": config.syncer.address, "control": config.syncer.control},
        "processes": {name: {"host": p.host, "status": p.status.value} for name, p in state.procs.items()},
        "not_running": [n for n, p in state.procs.items() if p.status.value not in ("running", "stopped", "finished")],
        "merging": merging,
    }


def down(
    run: str | None = RunOpt,
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask, even on a terminal, which run to stop."),
) -> None:
    """Stop everything on every host: final checkpoint, final model, a summary.

    Without --run, on a terminal, it asks before stopping the most recent live run.

    Example: dldctl down --run default
    """
    target = rundir.resolve(run, live_only=False)
    done = down_mod.already_down(target)
    if done is not None:  # a second `down`: say so, touch nothing, log no event
        if json_out:
            print(strictjson.dumps({"schema": DOWN_SCHEMA, **done}))
        else:
            console.print(f"run {done['run']} is already down; final model: {done['final_model'] or 'none'}")
        return
    if run is None and not yes and sys.stdin.isatty():  # the target was picked for the user: ask
        typer.confirm(f"stop run {target.name} ({_describe(target)})?", default=False, abort=True)
    summary = down_mod.down(target, output_console(stderr=True) if json_out else console)
    if json_out:
        print(strictjson.dumps({"schema": DOWN_SCHEMA, **summary}))
        return
    table = Table(title=f"run {summary['run']} is down", show_header=False, box=None)
    for key, value in summary_rows(summary):
        table.add_row(key, value)
    console.print(table)


SUMMARY_WORDS: dict[str, Callable[[Any], str]] = {  # `down`'s figures for people (`--json`: raw)
    "goodput": fmt_pct,
    "tokens_trained": fmt_count,
    "tokens_merged": fmt_count,
    "loss_train": lambda v: fmt_float(v, 4),
    "loss_eval": lambda v: fmt_float(v, 4),
    "loss_global": lambda v: fmt_float(v, 4),
    "bytes_up": fmt_bytes,
    "bytes_down": fmt_bytes,
    "ddp_equivalent": fmt_bytes,
    "uptime_s": fmt_duration,
    "shards": lambda rows: shard_words(rows or []),  # a sharded syncer's shards: how each stopped, at which step
}


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """`down`'s summary as (key, words) rows (pure): percentages, MB/GB, durations, 5.2M tokens,
    and "none" for a list or a file that is empty."""
    rows = []
    for key, value in summary.items():
        if key in SUMMARY_WORDS:  # an unknown figure (None) reads "-", as in the live view
            words = SUMMARY_WORDS[key](value)
        elif value is None or value == []:
            words = "none"
        elif isinstance(value, list):
            words = ", ".join(map(str, value))
        else:
            words = f"{value:.4g}" if isinstance(value, float) else str(value)
        rows.append(("uptime" if key == "uptime_s" else key, words))
    return rows


def shard_words(rows: list[dict[str, Any]]) -> str:
    """`0: 120 outer steps; 1: 118 outer steps (dead: its newest checkpoint)` (pure)."""
    why = {"dead": " (dead: its newest checkpoint)", "unreachable": " (did not answer)", "killed": " (killed)"}
    return "; ".join(
        f"{r.get('shard')}: {r.get('outer_steps') if r.get('outer_steps') is not None else '?'} outer steps"
        f"{why.get(str(r.get('state')), '')}"
        for r in rows
    )


def _describe(run: rundir.RunDir) -> str:
    """A few words on a run, for the question `down` asks."""
    from dldctl.observe.runs import row

    r = row(run, time.time())
    age = "-" if r["age_s"] is None else f"{r['age_s'] / 60:.0f} min"
    return f"{r['state']}, {r['learners']} learners on {', '.join(r['hosts']) or 'no host'}, age {age}"


def check(
    inventory_file: Path | None = typer.Argument(
        None, metavar="INVENTORY", help="Inventory TOML; none = the built-in default."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON (the exit code says pass/fail)."),
) -> None:
    """Check every host: SSH, host key, Python, torch, device, and the syncer's port; and the
    syncer's native merge kernel on this machine.

    Example: dldctl check inventory.toml
    """
    inv = load_inventory(inventory_file)
    results = check_mod.check(inv)
    native = kernel.for_syncer(inv)
    memory = memcheck.assess(inv)
    learners = memcheck.assess_learners(inv, memory)
    fits = all(m.ok for m in memory or []) and all(m.ok for m in learners or [])
    answers, problems = modelprobe.before_run(inv) if fits else ([], [])  # no model built where it cannot fit
    if json_out:
        record = check_record(inv, results, native, memory, learners)
        print(strictjson.dumps({**record, **model_record(answers, problems, record["ok"])}))
    else:
        _print_check(inv, results, native)
        _print_memory(memory, learners)
        _print_probes(answers)
    _refuse_model(problems)
    bad = [r.name for r in results if not r.ok]
    if bad:
        raise DldError(f"{len(bad)} of {len(results)} hosts failed the check: {', '.join(bad)}")
    if not native.runnable:
        raise DldError(native.line())
    short = [m for m in memory or [] if not m.ok]
    if short:
        raise DldError(f"host {short[0].need.host}: {short[0].line}", hint=memcheck.HINT)
    crowded = [m for m in learners or [] if not m.ok]
    if crowded:
        raise DldError(f"host {crowded[0].need.machine}: {crowded[0].line}", hint=memcheck.LEARNER_HINT)


CHECK_COLUMNS = ["ssh", "python", "torch", "device", "port"]


def check_record(
    inv: Inventory,
    results: list[check_mod.HostCheck],
    native: kernel.KernelStatus,
    memory: list[memcheck.HostMemory] | None = None,
    learners: list[memcheck.LearnerMemory] | None = None,
) -> dict[str, Any]:
    """What `check --json` prints: per host and item, passed and the detail; the syncer hosts'
    and the CPU learners' memory (null for a model from a user's factory: counted only when
    learners join)."""
    fits = all(m.ok for m in memory or []) and all(m.ok for m in learners or [])
    return {
        "schema": "dldctl.check/1",
        "inventory": str(inv.path),
        "ok": all(r.ok for r in results) and native.runnable and fits,
        "hosts": [
            {
                "name": r.name,
                "ok": r.ok,
                "checks": {col: {"ok": passed, "detail": detail} for col, (passed, detail) in r.items.items()},
            }
            for r in results
        ],
        "syncer_kernel": {"ok": native.ok, "detail": native.line()},
        "syncer_memory": None if memory is None else [m.to_dict() for m in memory],
        "learner_memory": None if learners is None else [m.to_dict() for m in learners],
    }


def probe_model(inv: Inventory) -> list[modelprobe.Answer]:
    """A factory or `hf:` model built on every host that runs learners or the syncer, each side
    a line; OperationError naming the first problem (`up --dry-run`)."""
    answers, problems = modelprobe.before_run(inv)
    _print_probes(answers)
    _refuse_model(problems)
    return answers


def _print_probes(answers: list[modelprobe.Answer]) -> None:
    for a in answers:
        colour = "green" if a.ok else ("yellow" if a.unprobed else "red")
        console.print(f"[{colour}]model on {escape(a.target.where)}:[/] {escape(a.line())}", highlight=False)


def _refuse_model(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more above)" if len(problems) > 1 else ""
        raise OperationError(f"{modelprobe.refusal(problems[0])}: {problems[0]}{more}")


def model_record(answers: list[modelprobe.Answer], problems: list[str], ok: bool) -> dict[str, Any]:
    """`check --json`'s part on the model: one entry per probe (null for a built-in preset, which
    needs none), the problems, and `ok` with them counted."""
    probes = [
        {"host": a.target.host, "roles": list(a.target.roles), "ok": a.ok, "probed": not a.unprobed, "detail": a.line()}
        | {k: a.data[k] for k in ("tensors", "params", "manifest", "python", "torch", "transformers") if k in a.data}
        for a in answers
    ]
    return {"ok": ok and not problems, "model": probes or None, "model_problems": problems}


def _print_memory(memory: list[memcheck.HostMemory] | None, learners: list[memcheck.LearnerMemory] | None) -> None:
    """One line per syncer host: its shards' memory against what the host has free; one per
    machine with CPU learners: theirs."""
    if memory is None:
        console.print("[dim]syncer memory: a model from a factory is counted when the first learner joins[/]")
        return
    colour = {syncermem.FITS: "green", syncermem.MAY_NOT_FIT: "yellow", syncermem.DOES_NOT_FIT: "red"}
    rows = [("syncer", m.need.host, m.status, m.line) for m in memory]
    rows += [("learner", m.need.machine, m.status, m.line) for m in learners or []]
    for who, where, status, line in rows:
        console.print(f"[{colour[status]}]{who} memory ({escape(where)}):[/] {escape(line)}", highlight=False)


def _print_check(inv: Inventory, results: list[check_mod.HostCheck], native: kernel.KernelStatus) -> None:
    table = Table(title=f"dldctl check {inv.path}")
    table.add_column("host")
    columns = CHECK_COLUMNS + (["slurm"] if any("slurm" in r.items for r in results) else [])  # a site's scheduler
    for col in columns:
        table.add_column(col, overflow="fold")
    for res in results:
        cells = []
        for col in columns:
            if col in res.items:
                passed, detail = res.items[col]
                cells.append(f"[{'green' if passed else 'red'}]{'ok' if passed else 'FAIL'}[/] {escape(detail)}")
            else:
                cells.append("[dim]-[/]")
        table.add_row(f"[{'green' if res.ok else 'red'}]{res.name}[/]", *cells)
    console.print(table)
    where = escape(native.elsewhere or "this machine")
    console.print(
        f"[{'green' if native.ok else 'yellow'}]syncer ({where}):[/] {escape(native.line())}", highlight=False
    )
