"""One row per syncer shard for `dldctl status` (the snapshot's `shards` list, docs/status.md).

A sharded syncer (`[syncer] shards`, dldctl/shards.py) is S processes; the fleet, quorum, goodput
and throughput of the snapshot come from shard 0, as from an unsharded syncer. Each row says how
one shard is doing: up (its control socket answered), pid, epoch, outer steps and merges per
second, checkpoint age, CPU time and memory. Every shard's socket is asked at once, each within a
short timeout, and a shard that does not answer is a row with `up` false (and what its files last
said), never an error of the command. An unsharded run has one row, shard 0's.

    rows(run, config, state, first, alive, now)   # the I/O: sockets, shard files, /proc
    shard_row(shard, name, answer, proc, seen)    # pure: one row from what was gathered

The pure parts (`merge_rate`, `newest_checkpoint`, `parse_usage`, `shard_row`) are tested alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dldctl import shards
from dldctl.errors import DldError
from dldctl.rundir import RunDir
from dldctl.runstate import Proc, ProcStatus, RunState
from dldctl.syncerctl import SyncerControl
from syncer.common import ckptname, jsonlread
from syncer.common.resolved import ResolvedConfig

ASK_S = 1.0  # a shard that does not answer within this is not up (shard 0's own answer: snapshot.py)
STARTING_S = 30.0  # a shard (re)started this recently that does not answer yet is starting (as a learner is)
RATE_WINDOW_S = 10.0  # merges per second over the newest samples of this span (the syncer samples every 2 s)


@dataclass(frozen=True)
class Seen:
    """What the shard's files and its process say, whether it answers or not."""

    samples: tuple[tuple[float, int], ...] = ()  # (t, outer_steps) of its metrics' samples, oldest first
    checkpoint: tuple[int, float] | None = None  # (outer step, wall time) of its newest checkpoint
    usage: tuple[float, int] | None = None  # (CPU seconds, resident bytes) of its process, on this machine
    pid_alive: bool | None = None  # what its recorded pid says now (None: not checked, another host)
    now: float = 0.0


# -- pure ------------------------------------------------------------------------------------------
def merge_rate(samples: Iterable[tuple[float, int]], window_s: float = RATE_WINDOW_S) -> float | None:
    """Outer steps per second over the newest `window_s` of (t, outer_steps) samples, oldest first,
    counted since the shard's last restart (where the steps drop back); None with fewer than two."""
    points = list(samples)
    if len(points) < 2:
        return None
    t1, o1 = points[-1]
    t0, o0 = t1, o1
    for t, o in reversed(points[:-1]):
        if t1 - t > window_s or o > o0:
            break
        t0, o0 = t, o
    return (o1 - o0) / (t1 - t0) if t1 > t0 else None


def newest_checkpoint(names: Iterable[str], events: Iterable[Mapping[str, Any]] = ()) -> tuple[int, float] | None:
    """(outer step, wall time) of the newest checkpoint: from the file names (syncer/common/ckptname.py,
    ordered as the syncer orders them) if there are any, else from the `outer_step` field of the
    last `checkpoint` event that has one (an event of an older syncer, without it, says nothing)."""
    found = ckptname.newest(names)
    if found is not None:
        return found.outer_step, found.wall_s
    for event in reversed(list(events)):
        step, t = event.get("outer_step"), event.get("t")
        if event.get("kind") == "checkpoint" and isinstance(step, int) and isinstance(t, (int, float)):
            return step, float(t)
    return None


def parse_usage(stat: str, ticks_per_s: int, page_bytes: int) -> tuple[float, int] | None:
    """(CPU seconds, resident bytes) from one /proc/<pid>/stat line (utime + stime, rss); None if
    it is not one. The command name (field 2) may hold spaces and ')': split at the last ')'."""
    _, sep, rest = stat.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 22 or not all(f.isdigit() for f in (fields[11], fields[12], fields[21])):
        return None
    return (int(fields[11]) + int(fields[12])) / ticks_per_s, int(fields[21]) * page_bytes


def _state(proc: Proc | None, up: bool, seen: Seen) -> str:
    """running | starting (also: started less than STARTING_S ago, not answering yet) | restarting
    | dead | stopped | unreachable (its process, or its host, alive but silent)."""
    if up:
        return "running"
    if proc is None or proc.status in (ProcStatus.STOPPED, ProcStatus.FINISHED):
        return "stopped"
    if proc.status is ProcStatus.DEAD:
        return "restarting" if proc.next_start else "dead"
    if seen.pid_alive is False:
        return "dead"
    recently = proc.started_at is not None and seen.now - proc.started_at < STARTING_S
    if proc.status in (ProcStatus.PENDING, ProcStatus.STARTING) or (proc.status is ProcStatus.RUNNING and recently):
        return "starting"
    return "unreachable"


def shard_row(shard: int, answer: Mapping[str, Any] | None, proc: Proc | None, seen: Seen) -> dict[str, Any]:
    """One shard's row: its own answer (`answer`: its status snapshot's `syncer` object, None if it
    did not answer), its process record and what its files say."""
    up = answer is not None and answer.get("alive") is True
    said: Mapping[str, Any] = answer if answer is not None and up else {}
    ckpt_step, ckpt_t = seen.checkpoint if seen.checkpoint else (None, None)
    last = seen.samples[-1][1] if seen.samples else None
    steps = said.get("outer_steps", max((v for v in (ckpt_step, last) if v is not None), default=None))
    recorded = proc.proc.pid if proc is not None and proc.proc is not None and seen.pid_alive is not False else None
    return {
        "shard": shard,
        "name": shards.proc_name(shard),
        "fragments": list(said["owned"]) if isinstance(said.get("owned"), list) else None,
        "up": up,
        "state": _state(proc, up, seen),
        "pid": said.get("pid", recorded),
        "epoch": said.get("epoch"),
        "outer_steps": steps,
        "checkpoint_outer_step": said.get("checkpoint_outer_step", ckpt_step),
        "merges_per_s": merge_rate(seen.samples) if up else 0.0,
        "checkpoint_age_s": max(0.0, seen.now - ckpt_t) if ckpt_t is not None else None,
        # its own answer first (a shard on another host reports them itself), else /proc here
        "cpu_s": said.get("cpu_s", seen.usage[0] if seen.usage else None) if up else None,
        "rss_bytes": said.get("rss_bytes", seen.usage[1] if seen.usage else None) if up else None,
        "restarts": proc.restarts if proc is not None else 0,
    }


# -- I/O ---------------------------------------------------------------------------------------------
def rows(
    run: RunDir,
    config: ResolvedConfig,
    state: RunState,
    first: Mapping[str, Any] | None,
    alive: Mapping[str, bool],
    now: float,
) -> list[dict[str, Any]]:
    """Every shard's row. `first`: shard 0's status snapshot as already asked (None: no answer);
    `alive`: name -> whether its recorded pid lives, for the processes on this machine."""
    count = config.syncer.shards
    names = shards.names(count)
    asked = [s for s in range(1, count) if _worth_asking(state.procs.get(names[s]), alive.get(names[s]))]
    answers: dict[int, Mapping[str, Any] | None] = {0: (first or {}).get("syncer")}
    if asked:
        with ThreadPoolExecutor(max_workers=min(8, len(asked))) as pool:
            for shard, answer in zip(asked, pool.map(lambda s: _ask(run, config, s), asked), strict=True):
                answers[shard] = answer
    out = []
    for shard, name in enumerate(names):
        seen = _seen(run.path, shard, state.procs.get(name), alive.get(name), now)
        out.append(shard_row(shard, answers.get(shard), state.procs.get(name), seen))
    return out


def _worth_asking(proc: Proc | None, pid_alive: bool | None) -> bool:
    """Whether a shard may answer: its process runs as far as the state (and its pid) says."""
    running = proc is not None and proc.status in (ProcStatus.RUNNING, ProcStatus.UNREACHABLE)
    return running and pid_alive is not False


def _ask(run: RunDir, config: ResolvedConfig, shard: int) -> Mapping[str, Any] | None:
    try:
        with SyncerControl.for_run(config, run.path, shard) as ctl:
            answer: Mapping[str, Any] | None = ctl.status(ASK_S).get("syncer")
            return answer
    except DldError:
        return None


def _seen(run_dir: Path, shard: int, proc: Proc | None, pid_alive: bool | None, now: float) -> Seen:
    """A shard's files in this run directory (a remote syncer's mirrored there) and its process."""
    directory = shards.local_dir(run_dir, shard)
    # samples every 2 s: 10 s of them
    records = jsonlread.tail(directory / "metrics.jsonl", 1 << 20, max_bytes=512 << 10)
    samples = tuple(
        (float(r["t"]), int(r["outer_steps"]))
        for r in records
        if r.get("kind") == "sample" and isinstance(r.get("t"), (int, float)) and isinstance(r.get("outer_steps"), int)
    )
    try:
        names = [p.name for p in (directory / "checkpoints").iterdir()]
    except OSError:
        names = []
    events = jsonlread.tail(directory / "events.jsonl", 500) if not names else []
    usage = _usage(proc.proc.pid) if pid_alive and proc is not None and proc.proc is not None else None
    return Seen(samples, newest_checkpoint(names, events), usage, pid_alive, now)


def _usage(pid: int) -> tuple[float, int] | None:
    """CPU seconds and resident bytes of a process on this machine (None: gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            line = fh.read()
        return parse_usage(line, os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        return None
