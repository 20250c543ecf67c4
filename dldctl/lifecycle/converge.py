"""Changing a live run's fleet: `learner add`, `learner remove`, and `up` on a live run.

Adding learners (on a host of the run, or on a new one taken from an inventory file: scavenged
capacity): new keys and config entries, the host prepared (idempotent), the syncer told
the new declared fleet, the learners put in the state as "pending" (the supervisor starts them;
they join by fetching the global state). Removing: marked stopped (never restarted), SIGTERM
(the learner sends its due fragments and says bye), the syncer told.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from dldctl import extras, hostopen, inventory, rundir, shards, syncerctl
from dldctl.errors import RunError, UsageError
from dldctl.hosts import ProcRef
from dldctl.inventory import HostSpec, Inventory
from dldctl.lifecycle import codeship, memcheck, modelprobe, plan, provision, sites, wheel
from dldctl.rundir import RunDir
from dldctl.runstate import HostRecord, ProcStatus
from dldctl.supervise import reconcile
from syncer.common.resolved import ResolvedConfig


def _tell_syncer(run: RunDir, config: ResolvedConfig) -> None:
    """The declared fleet to every shard of the syncer (one that is down reads it from config.json)."""
    state = run.read_state()
    ids = state.learners(live=True)
    told = syncerctl.tell_every_shard(config, run.path, "fleet", 10.0, learners=sorted(ids))
    for shard, exc in told.items():
        if exc is not None:
            why = f"{exc.line()} (it reads the fleet from config.json on restart)"
            run.event("fleet_update_failed", shards.proc_name(shard), why)


def adopt_host(run: RunDir, spec: HostSpec) -> None:
    """Make a host the live run does not have yet part of it, with no learners yet (`add` follows).

    Scavenged capacity: the host comes from an inventory file (the one given to `up` or to
    `learner add --inventory`); the run's other settings and hosts stay as they are."""
    if not run.live():
        raise RunError(f"run {run.name} is not live", hint="start it with `dldctl up`")
    inv = run.read_inventory()
    if any(h.name == spec.name for h in inv.hosts):
        return
    merged = replace(inv, hosts=(*inv.hosts, replace(spec, learners=0)))
    inventory.validate(merged)
    run.write_inventory(merged)
    run.event("host_add", spec.name, f"{spec.address} joins run {run.name}")


def add(
    run: RunDir, host_name: str, count: int, console: Console, wait_s: float = 120.0, memory_check: bool = True
) -> list[str]:
    """Add `count` learners on inventory host `host_name` to a live run; returns their ids.
    `memory_check`: first refuse a host where they would not fit (memcheck.add_check)."""
    if count < 1:
        raise UsageError(f"--count must be >= 1, got {count}")
    if not run.live():
        raise RunError(f"run {run.name} is not live", hint="start it with `dldctl up`")
    inv = run.read_inventory()
    spec = inv.host(host_name)
    if spec.local:
        extras.require("torch", f"learners on {spec.name} (this machine) need")
    sites.preflight(inv, [spec.name])  # a site whose scheduler would refuse the jobs: before any is queued
    if memory_check and (warning := memcheck.add_check(inv, spec, count)) is not None:
        console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    config, new_ids = plan.add_learners(run, run.read_config(), spec, count)
    host = hostopen.open_host(spec, inv.ssh)
    try:
        # a local host runs from this checkout: prepare() never reads the wheel (as in up.py)
        built, digest = wheel.build(rundir.home() / "wheels") if not spec.local else (Path(), "")
        ids_here = [e.id for e in config.learners_on(spec.name)]
        say = lambda h, s: console.print(f"{h}: {s}", highlight=False)
        tree = _shipped_tree(run, inv)
        runtime = provision.prepare(host, spec, run, config, built, digest, ids_here, say, tree)
    finally:
        host.close()
    modelprobe.at_up(inv, config, {spec.name: runtime}, say)  # the model builds there too, before any joins
    _push_keys_to_remote_syncer(run, inv, config)
    run.write_inventory(inventory.with_host_learners(inv, spec.name, spec.learners + count))
    with run.update() as edit:
        old = edit.state.hosts.get(spec.name)
        edit.state = edit.state.with_host(spec.name, HostRecord(runtime, old.status if old else "ok"))
        for lid in new_ids:
            edit.state = edit.state.with_proc(lid, reconcile.new_proc("learner", spec.name))
    for lid in new_ids:
        run.event("learner_add", lid, f"scavenged capacity on {spec.name}")
    _tell_syncer(run, config)
    _wait(run, new_ids, wait_s, console)
    return new_ids


def _shipped_tree(run: RunDir, inv: Inventory) -> codeship.Tree | None:
    """The workdir for a host that joins a live run: the very snapshot the fleet runs (recorded
    in any host's runtime) when the directory still hashes to it, else it as it is now."""
    tree = codeship.scan(inv.run, inv.path)
    running = {r.runtime.code for r in run.read_state().hosts.values()} - {""}
    if tree is not None and running and not any(p.endswith("/" + tree.digest) for p in running):
        run.event("workdir_changed", "run", f"{inv.run.workdir} changed since up: the new host gets it as it is now")
    return tree


def _push_keys_to_remote_syncer(run: RunDir, inv: Inventory, config: ResolvedConfig) -> None:
    """A syncer (or shard) on another host must learn the new learners' public keys (and config)."""
    for name in sorted(set(config.syncer.hosts) - {"local"}):
        runtime = run.read_state().runtime_of(name)
        host = hostopen.open_host(inv.host(name), inv.ssh)
        try:
            host.put_bytes(run.config.read_bytes(), runtime.config, 0o600)
            provision.push_syncer_keys(host, run, runtime.run_dir, config)
        finally:
            host.close()


def _wait(run: RunDir, ids: list[str], timeout: float, console: Console) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = run.read_state()
        waiting = [i for i in ids if state.procs[i].status is not ProcStatus.RUNNING]
        if not waiting:
            console.print(f"started {', '.join(ids)}; they join by fetching the global state")
            return
        time.sleep(0.3)
    console.print(f"[yellow]not running yet after {timeout:.0f} s: {', '.join(waiting)}[/] (`dldctl logs` tells why)")


@dataclass(frozen=True)
class Removed:
    """What `remove` did: the learner, its host, its pid (None: it had no process) and whether
    the SIGTERM reached a process (False: already gone; it is stopped all the same)."""

    learner: str
    host: str
    pid: int | None
    signalled: bool


def remove(run: RunDir, lid: str, console: Console) -> Removed:
    """Gracefully take one learner out of a live run (it is not restarted)."""
    with run.update() as edit:
        proc = edit.state.procs.get(lid)
        if proc is None or not proc.learner:
            raise UsageError(f"no learner named {lid!r} in run {run.name}")
        edit.state = edit.state.with_proc(lid, replace(proc, status=ProcStatus.STOPPED))
        ref = proc.proc
        host_name = proc.host
    signalled = False
    if ref:
        inv = run.read_inventory()
        host = hostopen.host_for(inv, host_name)
        try:
            signalled = host.signal(ProcRef(ref.pid, ref.start_ticks), signal.SIGTERM, group=True)
        finally:
            host.close()
    run.event("learner_remove", lid, "graceful leave: its due fragments are sent, then it exits")
    _tell_syncer(run, run.read_config())
    if signalled:
        console.print(f"{lid} is leaving (SIGTERM sent; it will not be restarted)")
    else:
        console.print(f"{lid} is stopped (its process was already gone; it will not be restarted)")
    return Removed(lid, host_name, ref.pid if ref else None, signalled)


def converge(run: RunDir, inv: Inventory, console: Console, memory_check: bool = True) -> None:
    """Bring a live run's fleet to the inventory's learner counts (settings cannot change live);
    learners added as `add` adds them (`memory_check`: refused where they would not fit)."""
    stored = run.read_inventory()
    if inventory.to_dict(stored)["run"] != inventory.to_dict(inv)["run"]:
        console.print(
            "[yellow]the \\[run] table differs from the live run's; settings cannot change on a live run "
            "(`dldctl down`, then `dldctl up` for a new run). Converging the fleet only.[/]"
        )
    if stored.syncer.shards != inv.syncer.shards:
        console.print(
            f"[yellow]\\[syncer] shards = {inv.syncer.shards}, but the live run has {stored.syncer.shards}: "
            "the syncer's shards cannot change on a live run (`dldctl down`, then `dldctl up`).[/]"
        )
    state = run.read_state()
    current: dict[str, list[str]] = {}
    for lid in state.learners(live=True):
        current.setdefault(state.procs[lid].host, []).append(lid)
    changed = False
    for spec in inv.hosts:
        have = sorted(current.get(spec.name, []), key=lambda x: int(x.rsplit("-", 1)[1]))
        if spec.learners > len(have):
            adopt_host(run, spec)
            add(run, spec.name, spec.learners - len(have), console, memory_check=memory_check)
            changed = True
        for lid in have[spec.learners :]:
            remove(run, lid, console)
            changed = True
    console.print(
        f"run {run.name} is live; " + ("converged to the inventory" if changed else "already matches the inventory")
    )
