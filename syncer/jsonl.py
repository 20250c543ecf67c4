"""Append-only JSON-lines logs (metrics.jsonl, events.jsonl), shared by several processes.

Each record is written with one `write()` on a file opened with O_APPEND, so lines from the
syncer, the supervisor and chaos commands never interleave mid-line. Reading tolerates a
truncated last line (a writer killed mid-write).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator


def append(path: Path, record: dict[str, Any]) -> None:
    """Append one record as a line (opens and closes the file: safe across processes)."""
    line = (json.dumps(record, separators=(",", ":"), default=_default) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class Writer:
    """A kept-open appender for a busy log (the syncer's metrics)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, separators=(",", ":"), default=_default) + "\n").encode()
        os.write(self._fd, line)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _default(value: Any) -> Any:
    if isinstance(value, float) and value != value:
        return None
    return str(value)


def read(path: Path, *, since: float | None = None) -> Iterator[dict[str, Any]]:
    """Records of a JSON-lines file, skipping a truncated or corrupt line."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        for raw in fh:
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict) and (since is None or record.get("t", 0) >= since):
                yield record


def tail(path: Path, count: int, max_bytes: int = 1 << 20) -> list[dict[str, Any]]:
    """The last `count` records (reads at most the last `max_bytes` of the file)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except FileNotFoundError:
        return []
    lines = data.splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first line is probably cut
    out = []
    for raw in lines[-count:]:
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
