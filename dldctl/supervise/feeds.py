"""The supervisor's reading of its run's records for the metrics sinks and the alerts (each a `Sink`).

Each loop, `Feeds.poll` reads what events.jsonl and metrics.jsonl gained (whole lines only) and
hands the new records to every sink, in order. Where it stopped is kept in `feeds.json` in the run
directory, so a restarted supervisor goes on from there: nothing is handed over twice, nothing
skipped (a record can be handed over again only if the supervisor dies between the two). A file
that rotated (NAME -> NAME.1, syncer/common/jsonl.py) is read to its end under its new name,
then the new file from its start. A sink that raises is dropped from that call only and counted;
reading never raises: an unreadable file is tried again next time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dldctl.eventlog import inode_of, parse_lines
from syncer.common.atomic import atomic_write

FILES = ("events.jsonl", "metrics.jsonl")
STATE = "feeds.json"
MAX_READ = 4 << 20  # bytes per file per poll: a big backlog is caught up over a few loops


class Sink(Protocol):
    """Something fed with a run's records (a metrics sink, the alerts)."""

    def on_events(self, records: list[dict[str, Any]]) -> None: ...
    def on_metrics(self, records: list[dict[str, Any]]) -> None: ...
    def tick(self, now: float) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Position:
    """Where the reading of one file stopped: its inode and the offset after a whole line."""

    inode: int | None = None
    offset: int = 0


def read_new(path: Path, at: Position, limit: int = MAX_READ) -> tuple[list[dict[str, Any]], Position]:
    """Records appended to `path` since `at`, and where they end. If `path` is now another file
    (rotated), the rest of the old one is read from `path`.1 first, and the new file next time."""
    current = inode_of(path)
    if at.inode is not None and current != at.inode:
        rotated = path.with_name(path.name + ".1")
        if inode_of(rotated) == at.inode:
            records, end = _read(rotated, at.offset, limit)
            if end > at.offset:
                return records, Position(at.inode, end)
        return [], Position(current, 0)  # the old file is read to its end (or gone): the new one
    if current is None:
        return [], at
    records, end = _read(path, at.offset, limit)
    return records, Position(current, end)


def _read(path: Path, offset: int, limit: int) -> tuple[list[dict[str, Any]], int]:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read(limit)
    except OSError:
        return [], offset
    whole = data[: data.rfind(b"\n") + 1]
    return list(parse_lines(whole.split(b"\n"))), offset + len(whole)


class Feeds:
    """The run's records, read once each, handed to `sinks`."""

    def __init__(self, run_path: Path, sinks: list[Sink], report: Callable[[str], object] = lambda _: None) -> None:
        self.path = Path(run_path)
        self.sinks = sinks
        self.report = report  # told (one line) when a sink raises
        self.failures = 0  # sink calls that raised
        self._failed_by: dict[str, int] = {}
        self.positions = self._load()

    def _load(self) -> dict[str, Position]:
        try:
            raw = json.loads((self.path / STATE).read_text())
            return {name: Position(raw[name]["inode"], int(raw[name]["offset"])) for name in FILES if name in raw}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def _save(self) -> None:
        data = {name: {"inode": p.inode, "offset": p.offset} for name, p in self.positions.items()}
        try:
            atomic_write(self.path / STATE, json.dumps(data).encode())
        except OSError:
            pass  # a full disk: the positions stay in memory, written again next time

    def poll(self, now: float) -> int:
        """Hand over what was appended since the last poll, then tick every sink; returns how
        many records were handed over."""
        if not self.sinks:
            return 0
        moved, count = False, 0
        for name, method in zip(FILES, ("on_events", "on_metrics")):
            at = self.positions.get(name, Position())
            records, end = read_new(self.path / name, at)
            if end != at:
                self.positions[name] = end
                moved = True
            if records:
                count += len(records)
                self._each(method, records)
        if moved:
            self._save()
        self._each("tick", now)
        return count

    def _each(self, method: str, arg: Any) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, method)(arg)
            except Exception as exc:  # a broken sink must never stop the supervisor
                self._failed(sink, exc)

    def _failed(self, sink: Sink, exc: Exception) -> None:
        """Count a sink's failure; report the first of each sink (then every 100th)."""
        self.failures += 1
        name = type(sink).__name__
        count = self._failed_by.get(name, 0) + 1
        self._failed_by[name] = count
        if count == 1 or count % 100 == 0:
            self.report(f"{name} failed ({count}x): {type(exc).__name__}: {exc}")

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                self._failed(sink, exc)
