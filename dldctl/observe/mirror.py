"""Bringing a remote syncer's records home: its events.jsonl and metrics.jsonl are appended to
the run directory on the operator machine (whole lines only, from remembered offsets), so
status, report and chaos verdicts work the same wherever the syncer runs."""

from __future__ import annotations

import os
from typing import Any

from dldctl.hosts import Host
from dldctl.lifecycle.provision import HostRuntime
from dldctl.rundir import RunDir
from dldctl.runstate import RunState

FILES = ("events.jsonl", "metrics.jsonl")
CHUNK = 1 << 20


def mirror(host: Host, runtime: HostRuntime, run: RunDir, offsets: dict[str, int]) -> dict[str, int]:
    """Append what the remote files gained since `offsets`; returns the new offsets."""
    out = dict(offsets)
    for name in FILES:
        remote = f"{runtime.run_dir}/{name}"
        size = host.size(remote)
        if size is None:
            continue
        offset = out.get(name, 0)
        if size < offset:  # replaced (a new syncer run): start over
            offset = 0
        while offset < size:
            data = host.read_bytes(remote, offset, min(CHUNK, size - offset))
            whole = data[: data.rfind(b"\n") + 1]
            if not whole:
                break  # a line still being written
            _append(run.path / name, whole)
            offset += len(whole)
        out[name] = offset
    return out


def _append(path: Any, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def remote_syncer(state: RunState) -> tuple[str, HostRuntime] | None:
    """(host name, runtime) of the syncer if it runs on another host, else None."""
    proc = state.procs.get("syncer")
    if not proc or proc.host == "local":
        return None
    return proc.host, HostRuntime.from_dict(dict(state.runtime_of(proc.host)))
