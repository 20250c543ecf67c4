"""What the syncer writes down: events.jsonl, metrics.jsonl and the operator's log lines.

The syncer process's records, out of the socket loop (syncer/server.py): an event goes to the
events log and, where an operator needs it, to the log on stdout (syncer/oplog.py: rate-limited
where it can flood); a noisy kind is written at most once per interval per key; the core's
outbox records (events, metrics) are written as they come. Every write is dropped and counted
on a full disk, never raised (syncer/common/jsonl.py). An event may carry structured fields
beside its message (`fields`): every event about a checkpoint carries `outer_step`, `epoch` and
`checkpoint` (the file name), so the operator reads them without parsing the text.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from syncer.common import jsonl
from syncer.globalmodel import Outbox
from syncer.oplog import OpLog, say


class Records:
    """The events log, the metrics log and the operator log of one syncer process."""

    def __init__(self, run_dir: Path, name: str, max_bytes: int, wall: Callable[[], float]) -> None:
        self.events_path = run_dir / "events.jsonl"
        self.name = name  # its events' target ("syncer", "syncer-1"), as dldctl names it
        self.wall = wall
        # every record write is dropped and counted, never raised, on a full disk; logs rotate past max_log_mb
        jsonl.configure(events=self.events_path, source=name, max_bytes=max_bytes)
        self.metrics = jsonl.Writer(run_dir / "metrics.jsonl")
        self.oplog = OpLog()  # the operator's lines on stdout (the syncer's log), rate-limited where they can flood
        self._quiet: dict[str, float] = {}

    def _target(self, target: str) -> str:
        return self.name if target == "syncer" else target

    def event(self, kind: str, target: str, detail: str, **fields: Any) -> None:
        """An event in events.jsonl (with structured `fields` beside the message) and, where an
        operator needs it, a line in the log."""
        now, target = self.wall(), self._target(target)
        jsonl.append(self.events_path, {"t": now, "kind": kind, "target": target, "detail": detail, **fields})
        say(self.oplog.event(kind, target, detail, now))

    def quiet_event(self, key: str, kind: str, target: str, detail: str, every_s: float = 10.0, **fields: Any) -> None:
        """An event at most once per `every_s` per key (garbage must not flood the log); OpLog counts each."""
        now, target = self.wall(), self._target(target)
        say(self.oplog.event(kind, target, detail, now))
        if now - self._quiet.get(key, 0.0) >= every_s:
            self._quiet[key] = now
            record = {"t": now, "kind": kind, "target": target, "detail": detail[:300], **fields}
            jsonl.append(self.events_path, record)

    def outbox(self, out: Outbox) -> None:
        """The events and metrics the core put into `out`."""
        for record in out.events:
            jsonl.append(self.events_path, {**record, "target": self.name} if record["target"] == "syncer" else record)
            say(self.oplog.event(record["kind"], record["target"], str(record["detail"]), float(record["t"])))
        for record in out.metrics:
            self.metrics.write(record)

    def due(self, now: float) -> None:
        """The counts of rate-limited classes whose interval ended (syncer/oplog.py)."""
        say(self.oplog.due(now))

    def say(self, lines: list[str]) -> None:
        say(lines)

    def close(self) -> None:
        self.metrics.close()
