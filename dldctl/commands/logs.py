"""CLI: `dldctl logs` — the logs of one or several targets (learners, syncer, supervisor,
watchdog), on this machine or over SSH, printed or followed.

One target prints its log as it is (no prefix unless `--prefix`). Several (names or globs:
`'learner-*'`) print each line after its target's padded name: without `-f` the last `--tail`
lines of each, merged in time order (dldctl/observe/logmerge.py); with `-f` one thread per target
follows its log and the lines come out interleaved as they arrive. Ctrl-C (or SIGTERM) ends it.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from dataclasses import dataclass

import typer
from rich.console import Console
from rich.markup import escape

from dldctl import rundir
from dldctl.commands import complete
from dldctl.commands.options import RunOpt, duration
from dldctl.errors import DldError, UsageError
from dldctl.hostopen import host_for
from dldctl.hosts import Host, LocalHost, ProcRef
from dldctl.hosts.slurmjobs import JOB_TICKS
from dldctl.interrupts import interruptible
from dldctl.observe import logmerge
from syncer.common import jsonlread

err_console = Console(stderr=True, highlight=False, soft_wrap=True)
LOCAL_LOGS = {"supervisor": "supervisor.log", "watchdog": "watchdog.log"}  # in the run dir on this machine
RETRY_S = 5.0  # a followed log whose host stopped answering is tried again this often
ALL_LINES = 1 << 30


@dataclass(frozen=True)
class Source:
    """Where one target's log is: the host that has it (shared by targets on that host) and the path."""

    target: str
    host: Host
    path: str
    job: int | None = None  # a scheduler's job: its log is the job's output file
    unstarted: str | None = None  # why its last start failed (an sbatch refusal, say), if that is the newest news


def job_note(s: Source) -> str | None:
    """`learner-3 is slurm job 12: PENDING (Resources)`, as the scheduler says it now (its log
    stays empty until the job runs, and a job that never started says why only here)."""
    if s.job is None:
        return None
    try:
        info = s.host.describe([ProcRef(s.job, JOB_TICKS)]).get(s.job)
    except DldError as exc:
        return f"{s.target} is {s.host.scheduler} job {s.job}: {exc.line()}"
    says = info.describe() if info is not None else "ended (no longer listed)"
    return f"{s.target} is {s.host.scheduler} job {s.job}: {says}"


def logs(
    targets: list[str] = typer.Argument(
        ...,
        metavar="TARGET",
        help="learner-N, syncer (syncer-N: a shard), supervisor, watchdog, or a glob: 'learner-*'.",
        autocompletion=complete.log_targets,
    ),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines (of every target)."),
    tail: int | None = typer.Option(None, "--tail", help="Lines from the end of each log to start with (default 50)."),
    since: str | None = typer.Option(None, "--since", help="Only lines of the last 5m, 2h, 30s."),
    prefix: bool = typer.Option(False, "--prefix", help="Prefix each line with its target, even for one target."),
    run: str | None = RunOpt,
) -> None:
    """Print (or follow) the logs of learners, the syncer or the supervisor, one or many at once.

    Example: dldctl logs 'learner-*' syncer -f --tail 5
    """
    start = time.time() - duration("--since", since) if since is not None else None
    lines = tail if tail is not None else (ALL_LINES if start is not None and not follow else 50)
    r = rundir.resolve(run, live_only=False)
    sources = log_sources(r, targets)
    show_prefix = prefix or len(sources) > 1 or any(any(c in t for c in "*?[") for t in targets)
    width = logmerge.prefix_width(s.target for s in sources) if show_prefix else 0
    for note in filter(None, map(job_note, sources)):
        err_console.print(escape(note))
    try:
        with interruptible():  # a script stops `-f` with `kill`
            if follow:
                _follow(sources, lines, width, start)
            else:
                _print_tails(sources, lines, width, start)
    except (KeyboardInterrupt, BrokenPipeError):  # stopped, or the reader left (`| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    finally:
        for host in {id(s.host): s.host for s in sources}.values():
            host.close()


def _emit(target: str, line: str, width: int) -> None:
    print(logmerge.prefixed(target, line, width) if width else line, flush=True)


def _print_tails(sources: list[Source], lines: int, width: int, start: float | None) -> None:
    """The last `lines` of each log, merged in time order; a missing log is a note (an error for one)."""
    now = time.time()
    streams: dict[str, list[tuple[float | None, str]]] = {}
    for s in sources:
        try:
            text = s.host.tail(s.path, lines)
        except DldError as exc:
            if s.unstarted is not None:  # no log because it never started: say why instead
                err_console.print(f"[yellow]{escape(s.target)} has not started:[/] {escape(s.unstarted)}")
                continue
            if len(sources) == 1 and (s.job is None or s.host.exists(s.path)):
                raise  # (a job's log appears once the job runs: the note above said where it is)
            err_console.print(f"[yellow]{escape(s.target)}:[/] {escape(exc.line())}")
            continue
        rows = logmerge.stamped(text.splitlines(), now)
        streams[s.target] = logmerge.since(rows, start) if start is not None else rows
    for target, line in logmerge.merge(streams):
        _emit(target, line, width)


def _follow(sources: list[Source], lines: int, width: int, start: float | None) -> None:
    """One thread per log; the main thread prints what they find until interrupted."""
    stop = threading.Event()
    found: queue.Queue[tuple[str, str]] = queue.Queue(maxsize=10000)
    threads = [threading.Thread(target=_follow_one, args=(s, lines, stop, found), daemon=True) for s in sources]
    for thread in threads:
        thread.start()
    try:
        while True:
            try:
                target, line = found.get(timeout=0.2)
            except queue.Empty:
                continue
            if start is not None and (t := logmerge.line_time(line, time.time())) is not None and t < start:
                continue
            _emit(target, line, width)
    finally:
        stop.set()
        deadline = time.monotonic() + 1.0  # one second for them all: a ^C must end it at once
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _follow_one(s: Source, lines: int, stop: threading.Event, found: queue.Queue[tuple[str, str]]) -> None:
    """Follow one log into `found`; a host that stops answering is a note and a retry, not the end."""
    first = True
    while not stop.is_set():
        try:
            for line in s.host.follow(s.path, from_end_lines=lines if first else 0, stop=stop.is_set):
                found.put((s.target, line))
            return
        except DldError as exc:
            err_console.print(f"[yellow]{escape(s.target)}:[/] {escape(exc.line())}; trying again in {RETRY_S:g} s")
        first = False
        stop.wait(RETRY_S)


def log_sources(run: rundir.RunDir, patterns: list[str]) -> list[Source]:
    """The log of every target the patterns name; UsageError naming the known targets if one names none."""
    state = run.read_state()
    known = [*state.procs, *LOCAL_LOGS]
    chosen, unmatched = logmerge.match_targets(patterns, known)
    if unmatched:
        names = ", ".join(logmerge.known_order(known))
        raise UsageError(
            f"no target named {' or '.join(repr(p) for p in unmatched)} in run {run.name}", hint=f"known: {names}"
        )
    hosts: dict[str, Host] = {}
    out = []
    failed = last_start_failures(run)
    for target in chosen:
        host, path = log_location(run, target, hosts)
        proc = state.procs.get(target)
        job = proc.job.job_id if proc is not None and proc.job is not None and host.scheduler else None
        out.append(Source(target, host, path, job, failed.get(target)))
    return out


def last_start_failures(run: rundir.RunDir) -> dict[str, str]:
    """target -> why its last start failed, for targets whose newest start news is a failure."""
    news: dict[str, str | None] = {}
    for record in jsonlread.tail(run.events, 2000):
        kind, target = record.get("kind"), str(record.get("target", ""))
        if kind in ("start", "restart"):
            news[target] = None
        elif kind == "start_failed":
            news[target] = str(record.get("detail", ""))
    return {target: why for target, why in news.items() if why is not None}


def log_location(run: rundir.RunDir, target: str, hosts: dict[str, Host] | None = None) -> tuple[Host, str]:
    """The host that has `target`'s log and its path; one connection per host, kept in `hosts`
    (none given: a new one, the caller closes it). UsageError for a name the run does not know."""
    hosts = {} if hosts is None else hosts
    if target in LOCAL_LOGS:
        return hosts.setdefault("", LocalHost("local")), str(run.path / LOCAL_LOGS[target])
    state = run.read_state()
    proc = state.procs.get(target)
    if proc is None:
        known = ", ".join(logmerge.known_order([*state.procs, *LOCAL_LOGS]))
        raise UsageError(f"no process named {target!r} in run {run.name}", hint=f"known: {known}")
    runtime = state.runtime_of(proc.host)
    if proc.host not in hosts:
        inv = run.read_inventory()
        hosts[proc.host] = host_for(inv, proc.host)
    return hosts[proc.host], f"{runtime.run_dir}/logs/{target}.log"
