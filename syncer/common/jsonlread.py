"""Reading the JSON-lines logs `jsonl` writes (metrics.jsonl, events.jsonl, procs.jsonl).

A log is its rotated segment NAME.1 (if any) and then NAME, oldest first (`segments`); `read`
streams every record of both, `tail` the last few without reading a large file whole. A line that
is not one whole JSON object (a truncated last line: a writer killed mid-write, or one cut short
by a full disk) is skipped, never raised.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def segments(path: Path) -> list[Path]:
    """The files of one log, oldest first: the rotated NAME.1 (if any), then NAME."""
    path = Path(path)
    return [path.with_name(path.name + ".1"), path]


def read(path: Path, *, since: float | None = None) -> Iterator[dict[str, Any]]:
    """Records of a JSON-lines log (its rotated segment first), skipping truncated or corrupt lines."""
    for part in segments(path):
        try:
            fh = open(part, "rb")  # noqa: SIM115 (a missing segment is skipped, not raised)
        except FileNotFoundError:
            continue
        with fh:
            for raw in fh:
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(record, dict) and (since is None or record.get("t", 0) >= since):
                    yield record


def tail(path: Path, count: int, max_bytes: int = 1 << 20) -> list[dict[str, Any]]:
    """The last `count` records (reads at most the last `max_bytes` of each segment; the rotated
    one only when the current one is short)."""
    old, new = segments(path)
    records, whole = _tail_one(new, count, max_bytes)
    if len(records) < count and whole:
        records = _tail_one(old, count - len(records), max_bytes)[0] + records
    return records


def _tail_one(path: Path, count: int, max_bytes: int) -> tuple[list[dict[str, Any]], bool]:
    """(the last `count` records of one file, whether the whole file was read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except FileNotFoundError:
        return [], True
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
    return out, size <= max_bytes
