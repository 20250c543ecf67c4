"""Bringing a remote syncer's records home: its events.jsonl and metrics.jsonl (and those of
every other shard of a sharded syncer, in `shard-N/`, from whichever host each shard runs on)
are appended to the run directory on the operator machine (whole lines only, from remembered
offsets), so status, report and chaos verdicts work the same wherever the syncer runs."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from dldctl import shards
from dldctl.hostruntime import HostRuntime
from dldctl.hosts import Host
from dldctl.rundir import RunDir
from dldctl.runstate import RunState

FILES = ("events.jsonl", "metrics.jsonl")
CHUNK = 1 << 20


def mirror(
    host: Host, runtime: HostRuntime, run: RunDir, offsets: dict[str, int], which: int | Iterable[int] = 1
) -> dict[str, int]:
    """Append what the remote files gained since `offsets` (of the syncer shards `which` runs on
    `host`, or shards 0..which-1: shard s's into `shard-s/`, dldctl/shards.py); returns the new
    offsets (keyed by path in the run directory, so one dict serves every host)."""
    out = dict(offsets)
    for shard in range(which) if isinstance(which, int) else which:
        if shard:
            (run.path / shards.subdir(shard)).mkdir(exist_ok=True)
        for name in FILES:
            rel = f"{shards.subdir(shard)}/{name}" if shard else name  # offsets' key: the path in the run dir
            offset = _copy_new(host, f"{runtime.run_dir}/{rel}", run.path / rel, out.get(rel, 0))
            if offset is not None:
                out[rel] = offset
    return out


def _copy_new(host: Host, remote: str, local: Any, offset: int) -> int | None:
    """Append the whole lines `remote` gained past `offset` to `local`; the new offset (None: no such file)."""
    size = host.size(remote)
    if size is None:
        return None
    if size < offset:  # replaced (a new syncer run): start over
        offset = 0
    while offset < size:
        data = host.read_bytes(remote, offset, min(CHUNK, size - offset))
        whole = data[: data.rfind(b"\n") + 1]
        if not whole:
            break  # a line still being written
        _append(local, whole)
        offset += len(whole)
    return offset


def _append(path: Any, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def remote_syncer(state: RunState) -> tuple[str, HostRuntime] | None:
    """(host name, runtime) of the syncer (shard 0) if it runs on another host, else None."""
    proc = state.procs.get("syncer")
    if not proc or proc.host == "local":
        return None
    return proc.host, state.runtime_of(proc.host)


def remote_shards(state: RunState, run: RunDir) -> list[tuple[str, HostRuntime, tuple[int, ...]]]:
    """(host name, runtime, the shards on it) of every other host a syncer shard runs on (a
    [[hosts]] entry for this machine whose run directory is this one has nothing to bring home)."""
    by_host: dict[str, list[int]] = {}
    for name, proc in state.procs.items():
        shard = shards.shard_of(name)
        if proc.kind == "syncer" and shard is not None and proc.host != "local":
            by_host.setdefault(proc.host, []).append(shard)
    out = []
    for host, found in sorted(by_host.items()):
        runtime = state.runtime_of(host)
        if runtime.run_dir != str(run.path):
            out.append((host, runtime, tuple(sorted(found))))
    return out
