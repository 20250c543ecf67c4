"""`dldctl events`: a run's events.jsonl, filtered, printed and followed (as `kubectl get events -w`).

`Filter` and `line` are pure; `follow` reads new records as they are appended, across the log's
rotation (events.jsonl -> events.jsonl.1 past `max_log_mb`: a new file is read from its start).
"""

from __future__ import annotations

import fnmatch
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "dldctl.event/1"


@dataclass(frozen=True)
class Filter:
    """Which events to show: kinds (any of them; empty = all), a target glob, not before `since`."""

    kinds: frozenset[str] = frozenset()
    target: str | None = None
    since: float | None = None

    def __call__(self, record: dict[str, Any]) -> bool:
        if self.kinds and record.get("kind") not in self.kinds:
            return False
        if self.target is not None and not fnmatch.fnmatchcase(str(record.get("target", "")), self.target):
            return False
        t = record.get("t")
        return self.since is None or (isinstance(t, (int, float)) and t >= self.since)


def line(record: dict[str, Any], today: str) -> str:
    """One event as a line: the time (with the date unless it is `today`), kind, target, detail."""
    t = record.get("t")
    if isinstance(t, (int, float)):
        day = time.strftime("%Y-%m-%d", time.localtime(t))
        clock = time.strftime("%H:%M:%S", time.localtime(t))
        when = clock if day == today else f"{day} {clock}"
    else:
        when = "-"
    return f"{when}  {record.get('kind', '?')!s:<18} {record.get('target', '')!s:<12} {record.get('detail', '')}"


def as_json(record: dict[str, Any]) -> dict[str, Any]:
    return {"schema": SCHEMA, **record}


def past(path: Path) -> tuple[list[dict[str, Any]], tuple[int | None, int]]:
    """Every record so far (the rotated segment first) and where they end in the current file
    (its inode and the offset after the last whole line): `follow` goes on from exactly there."""
    records: list[dict[str, Any]] = []
    rotated = path.with_name(path.name + ".1")
    try:
        records += parse_lines(rotated.read_bytes().split(b"\n"))
    except OSError:
        pass
    try:
        with open(path, "rb") as fh:
            data, inode = fh.read(), os.fstat(fh.fileno()).st_ino
    except OSError:
        return records, (None, 0)
    whole = data[: data.rfind(b"\n") + 1]
    return records + list(parse_lines(whole.split(b"\n"))), (inode, len(whole))


def follow(
    path: Path, stop: Callable[[], bool], where: tuple[int | None, int], poll_s: float = 0.5
) -> Iterator[dict[str, Any]]:
    """Records appended to `path` after `where` (from `past`), until `stop()`; a rotated or replaced
    file is read again from its start. A line still being written waits for its newline."""
    inode, offset = where
    fh = _open_at(path, inode, offset)
    pending = b""
    while not stop():
        chunk = fh.read() if fh is not None else b""
        if chunk:
            pending += chunk
            *complete, pending = pending.split(b"\n")
            yield from parse_lines(complete)
            continue
        time.sleep(poll_s)
        current = inode_of(path)
        if current is not None and current != inode:  # rotated: the new file, from its start
            if fh is not None:
                fh.close()
            fh, inode, pending = _open_at(path, current, 0), current, b""
    if fh is not None:
        fh.close()


def parse_lines(raw_lines: list[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects among `raw_lines` (a torn or foreign line is skipped)."""
    for raw in raw_lines:
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield record


def inode_of(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _open_at(path: Path, inode: int | None, offset: int) -> Any:
    """The file at `offset`, if it is still the one `inode` names (else None: read it from the
    start once it shows up as a new inode)."""
    try:
        fh = open(path, "rb")  # noqa: SIM115 (kept open while following)
    except FileNotFoundError:
        return None
    if os.fstat(fh.fileno()).st_ino != inode:
        fh.close()
        return None
    fh.seek(offset)
    return fh
