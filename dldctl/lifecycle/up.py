"""`dldctl up`: provision the hosts, write the run, start the supervisor, wait for the fleet.

    plan      inventory -> learner ids, ports, keys, config.json (a new run directory)
    hosts     in parallel, a progress line each: connect, copy wheel, set up python, copy config
    start     state.json with every process "pending"; the supervisor starts (and keeps) them
    wait      until the syncer and every reachable learner run

An unreachable host is reported on one line and its learners are left out, as long as the rest
of the fleet still reaches the minimum quorum. Re-running `up` on a live run converges to the
inventory (adds or removes learners) instead of starting a second run.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from dldctl import extras, hostopen, rundir, shards
from dldctl.errors import DldError, Interrupted, OperationError
from dldctl.hostruntime import HostRuntime
from dldctl.hosts import Host, LocalHost
from dldctl.hosts.slurm import SlurmHost
from dldctl.inventory import HostSpec, Inventory
from dldctl.lifecycle import codeship, initmodel, kernel, memcheck, modeldir, modelprobe, plan, provision, sites, wheel
from dldctl.rundir import RunDir
from dldctl.runstate import HostRecord, ProcStatus, RunState
from dldctl.supervise import reconcile, sinks, watchdog
from syncer.common import faultpoints
from syncer.common.resolved import ResolvedConfig


class Board:
    """One progress line per host (a live table on a terminal, plain lines otherwise)."""

    def __init__(self, console: Console, names: list[str]) -> None:
        self.console = console
        self.stages = dict.fromkeys(names, "waiting")
        self.lock = threading.Lock()
        self.live: Live | None = None

    def __enter__(self) -> Board:
        if self.console.is_terminal:
            self.live = Live(self.table(), console=self.console, refresh_per_second=8, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.update(self.table())
            self.live.__exit__(*exc)

    def table(self) -> Table:
        t = Table(show_header=True, header_style="bold", box=None)
        t.add_column("host")
        t.add_column("stage")
        for name, stage in self.stages.items():
            style = "red" if stage.startswith("failed") else ("green" if stage in ("ready", "running") else "")
            t.add_row(name, f"[{style}]{stage}[/]" if style else stage)
        return t

    def __call__(self, name: str, stage: str) -> None:
        with self.lock:
            if self.stages.get(name) == stage:
                return
            self.stages[name] = stage
            if self.live is not None:
                self.live.update(self.table())
            else:
                self.console.print(f"{name}: {stage}", highlight=False)


def _open_remote(inv: Inventory, board: Board) -> tuple[dict[str, Host], dict[str, DldError]]:
    """Connect to every remote host in parallel (the SSH layer bounds concurrency)."""
    hosts: dict[str, Host] = {}
    errors: dict[str, DldError] = {}

    def connect(spec: HostSpec) -> None:
        board(spec.name, "connect")
        host = hostopen.open_host(spec, inv.ssh)
        try:
            host.home()
            hosts[spec.name] = host
        except DldError as exc:
            errors[spec.name] = exc
            board(spec.name, f"failed: {exc.line()}")
            host.close()

    syncers = shards.hosts_of(inv.syncer.host, inv.syncer.shard_hosts, inv.syncer.shards)
    remote = [h for h in inv.hosts if not h.local and (h.learners > 0 or h.name in syncers)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(connect, remote))
    for spec in inv.hosts:
        if spec.local:
            hosts[spec.name] = hostopen.open_host(spec, inv.ssh)  # a site with login "local": its SlurmHost
    return hosts, errors


def advertise_address(hosts: dict[str, Host], console: Console | None = None) -> str:
    """The address remote learners dial back to this machine: our end of an SSH connection."""
    remote = False
    if any(isinstance(host, SlurmHost) and isinstance(host.login, LocalHost) for host in hosts.values()):
        return socket.getfqdn()  # sbatch from here: the compute nodes dial this machine by its name
    for host in hosts.values():
        local_end = getattr(host, "local_address", None)
        if callable(local_end):
            remote = True
            address = local_end()
            if address:
                return address
    if remote and console is not None:
        console.print(
            "[yellow]could not tell which address the hosts reach this machine at (a jump host in "
            "~/.ssh/config?); learners will dial 127.0.0.1: set [syncer] advertise if that is wrong[/]"
        )
    return "127.0.0.1"


def _check_quorum(inv: Inventory, errors: dict[str, DldError]) -> None:
    reachable = sum(h.learners for h in inv.hosts if h.name not in errors)
    if reachable < inv.run.quorum or reachable == 0:
        lines = "; ".join(e.line() for e in errors.values())
        raise OperationError(
            f"only {reachable} learners are on reachable hosts, fewer than quorum {inv.run.quorum}: {lines}",
            hint="fix the hosts above (`dldctl check` tells more) or lower [run] quorum",
        )


def _check_syncer_hosts(config: ResolvedConfig, errors: dict[str, DldError]) -> None:
    """Every syncer shard's host must be set up: a run cannot merge a fragment whose shard cannot start."""
    for shard, host in enumerate(config.syncer.hosts):
        if host in errors:
            what = f"syncer shard {shard} ({shards.proc_name(shard)})" if config.syncer.shards > 1 else "the syncer"
            raise OperationError(
                f"{what} runs on host {host}, which could not be set up: {errors[host].line()}",
                hint="fix the host (`dldctl check` tells more) or move it in [syncer] host / shard_hosts",
            )


def _provision_all(
    inv: Inventory,
    run: RunDir,
    config: ResolvedConfig,
    hosts: dict[str, Host],
    errors: dict[str, DldError],
    board: Board,
    tree: codeship.Tree | None,
) -> dict[str, HostRuntime]:
    needs_wheel = any(not h.local for h in inv.hosts if h.name in hosts)
    built, digest = wheel.build(rundir.home() / "wheels") if needs_wheel else (Path(), "")
    by_host = provision.learners_by_host(config)
    runtimes: dict[str, HostRuntime] = {}
    # two entries for one machine share its work dir: set them up one after the other
    locks = {(h.address, h.port, h.workdir): threading.Lock() for h in inv.hosts}

    def one(spec: HostSpec) -> None:
        try:
            with locks[(spec.address, spec.port, spec.workdir)]:
                runtimes[spec.name] = provision.prepare(
                    hosts[spec.name], spec, run, config, built, digest, by_host.get(spec.name, []), board, tree
                )
            board(spec.name, "ready")
        except DldError as exc:
            errors[spec.name] = exc
            board(spec.name, f"failed: {exc.line()}")

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, [h for h in inv.hosts if h.name in hosts and h.name not in errors]))
    return runtimes


def initial_state(
    inv: Inventory,
    run: RunDir,
    config: ResolvedConfig,
    runtimes: dict[str, HostRuntime],
    errors: dict[str, DldError],
    tree: codeship.Tree | None = None,
) -> RunState:
    """Every process pending (the supervisor starts them): every syncer shard (`syncer`, `syncer-1`,
    ...: dldctl/shards.py) on its host, the learners; unreachable hosts' learners stopped."""
    names = shards.names(config.syncer.shards)
    procs = {name: reconcile.new_proc("syncer", host) for name, host in zip(names, config.syncer.hosts, strict=True)}
    for entry in config.learners:
        proc = reconcile.new_proc("learner", entry.host)
        if entry.host in errors:
            proc = replace(proc, status=ProcStatus.STOPPED, reason=errors[entry.host].line())
        procs[entry.id] = proc
    hosts = {name: HostRecord(rt) for name, rt in runtimes.items()}
    if "local" not in hosts:  # a syncer on this machine ("local" is no [[hosts]] entry)
        hosts["local"] = HostRecord(provision.local_runtime("local", run, tree))
    return RunState(
        run=inv.run.name,
        run_id=config.run_id,
        dir=str(run.path),
        status="starting",
        created=time.time(),
        procs=procs,
        hosts=hosts,
    )


def runtimes_of(state: RunState, errors: dict[str, DldError]) -> dict[str, HostRuntime]:
    """The runtime of every host of `state` that was set up ("local": a syncer here)."""
    records = {name: r for name, r in state.hosts.items() if name not in errors}
    return {name: record.runtime for name, record in records.items()}


def start_supervisor(run: RunDir) -> None:
    """The supervisor and its watchdog, each of which restarts the other (dldctl/supervise/watchdog.py);
    one already alive is left alone (an orphaned run whose watchdog lives on)."""
    started = {role: watchdog.respawn(run, role) for role in watchdog.ROLES}
    with run.update() as edit:
        edit.state = edit.state.with_status("up")
        records = {role: edit.state.daemon(role) for role in watchdog.ROLES}
    pids = {role: record.pid if record else None for role, record in records.items()}
    said = ", ".join(
        f"{role} pid {pids[role]}{'' if started[role] else ' (already running)'}" for role in watchdog.ROLES
    )
    run.event("up", "run", said)


def wait_running(run: RunDir, board: Board, timeout: float) -> list[str]:
    """Wait until every non-stopped process runs; returns the names still not running."""
    deadline = time.monotonic() + timeout
    pending: list[str] = []
    while time.monotonic() < deadline:
        state = run.read_state()
        done = (ProcStatus.RUNNING, ProcStatus.STOPPED, ProcStatus.FINISHED)
        pending = [n for n, p in state.procs.items() if p.status not in done]
        for name, proc in state.procs.items():
            if proc.status is ProcStatus.RUNNING:
                board(name, "running")
        if not pending:
            return []
        time.sleep(0.3)
    return pending


def create_run(inv: Inventory, source: str | None) -> RunDir:
    run = rundir.create(inv.run.name)
    run.write_inventory(inv)
    if source:
        shutil.copyfile(source, run.inventory)
    return run


def prepare_fleet(
    inv: Inventory,
    run: RunDir,
    board: Board,
    make_config: Callable[[str], ResolvedConfig],
    tree: codeship.Tree | None = None,
) -> tuple[ResolvedConfig, dict[str, HostRuntime], dict[str, DldError]]:
    """Connect to the hosts, write the configuration (`make_config(advertise address)`), set up
    every reachable host (with the run's code `tree`); (config, runtimes, unreachable hosts).
    Fails below the quorum."""
    hosts, errors = _open_remote(inv, board)
    try:
        _check_quorum(inv, errors)
        config = make_config(advertise_address(hosts, board.console))
        runtimes = _provision_all(inv, run, config, hosts, errors, board, tree)
        _check_quorum(inv, errors)
        _check_syncer_hosts(config, errors)
    finally:
        for host in hosts.values():
            host.close()
    return config, runtimes, errors


def start_fleet(
    inv: Inventory, run: RunDir, board: Board, state: RunState, timeout: float
) -> tuple[list[str], kernel.KernelStatus]:
    """Build the native kernel (a syncer here), write the state, start the supervisor, wait for the
    processes; (the names still not running, the kernel)."""
    if extras.syncer_here(inv):  # a syncer on another host builds its own when it starts
        board("syncer", "building the native merge kernel")
    native = kernel.for_syncer(inv)
    if not native.elsewhere:
        board("syncer", "kernel ready" if native.ok else "no native kernel: torch merge")
    with run.locked():
        run.write_state(state)
    start_supervisor(run)
    faultpoints.hit("up_started")
    return wait_running(run, board, timeout), native


def interrupted(run: RunDir) -> Interrupted:
    """What a Ctrl-C during `up` leaves: before the supervisor started, nothing (the run directory
    goes; nothing runs); after, the run, which the supervisor goes on starting."""
    try:
        started = run.read_state().supervisor is not None
    except DldError:
        started = False
    if not started:
        shutil.rmtree(run.path, ignore_errors=True)
        return Interrupted(
            f"interrupted before run {run.name} started: nothing runs, and its directory is removed",
            hint="`dldctl up` again starts over",
        )
    return Interrupted(
        f"interrupted: run {run.name} is up to its supervisor, which goes on starting it",
        hint=f"`dldctl status --run {run.name}` follows it; `dldctl down --run {run.name}` stops it",
    )


def report_start(
    console: Console, timeout: float, missing: list[str], native: kernel.KernelStatus, errors: dict[str, DldError]
) -> None:
    """What did not come up, and why, after `start_fleet`."""
    if missing:
        console.print(
            f"[yellow]still starting after {timeout:.0f} s: {', '.join(missing)}[/] "
            f"(the supervisor keeps trying; `dldctl logs <target>` shows why)"
        )
    if not native.ok:
        console.print(f"[yellow]{escape(native.line())}[/]", highlight=False)
    for name, exc in errors.items():
        console.print(f"[red]left out host {name}:[/] {exc.line()}", highlight=False)


def fleet_names(inv: Inventory) -> list[str]:
    """The lines of the progress board: the hosts, the syncer (each shard), the learners."""
    return [h.name for h in inv.hosts] + shards.names(inv.syncer.shards) + [p.id for p in plan.learner_plans(inv)]


def up(
    inv: Inventory, source: str | None, console: Console, timeout: float = 180.0, memory_check: bool = True
) -> RunDir:
    """Bring a new run up; returns its directory (processes keep running after we return)."""
    initmodel.check(inv)  # [run] init_from: a bad model file fails here, before any host or run directory
    sinks.preflight(inv)  # [metrics] prometheus_port in use: likewise
    plan.check_fixed_ports(inv)  # [syncer] port, control_port in use: likewise
    sites.preflight(inv)  # a Slurm site's partition, account, time limit: before any job is queued
    tree = codeship.scan(inv.run, inv.path)  # [run] workdir: missing or over its size limit fails here
    modeldir.check(inv)  # an hf: model's directory: what travels is config and tokenizer, not more
    for warning in memcheck.preflight(inv) if memory_check else []:  # shards that cannot fit: refused
        console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    run = create_run(inv, source)
    console.print(f"run [bold]{run.name}[/] in {run.path}", highlight=False)
    try:
        with Board(console, fleet_names(inv)) as board:
            faultpoints.hit("up_created")
            make = lambda advertise: plan.write(inv, run, advertise)
            config, runtimes, errors = prepare_fleet(inv, run, board, make, tree)
            state = initial_state(inv, run, config, runtimes, errors, tree)
            modelprobe.at_up(inv, config, runtimes_of(state, errors), board)
            missing, native = start_fleet(inv, run, board, state, timeout)
    except KeyboardInterrupt:
        raise interrupted(run) from None
    report_start(console, timeout, missing, native, errors)
    report_metrics(console, inv, run)
    return run


def report_metrics(console: Console, inv: Inventory, run: RunDir) -> None:
    """Where the [metrics] exporters the supervisor starts will put the run (docs/metrics.md)."""
    m = inv.metrics
    if m.tensorboard:
        console.print(f"metrics: tensorboard --logdir {run.path / 'tensorboard'}", highlight=False)
    if m.prometheus_port:
        console.print(f"metrics: Prometheus on http://{m.prometheus_bind}:{m.prometheus_port}/metrics", highlight=False)
    if m.wandb:
        console.print(f"metrics: W&B {m.wandb_mode} run {run.name} in {run.path / 'wandb'}", highlight=False)
    a = inv.alerts
    if a.active:
        hook = urlsplit(a.webhook)
        where = [f"`{a.command}`"] if a.command.strip() else []
        where += [f"{hook.scheme}://{hook.netloc}/..."] if a.webhook.strip() else []  # a hook's path may be its secret
        console.print(f"alerts: {', '.join(a.on)} to {' and '.join(where)} (docs/alerts.md)", highlight=False)
