"""The supervisor's decision log: one human line in `supervisor.log` per decision it takes.

Every decision of the supervisor (and of the watchdog that keeps it alive) is already an event
in events.jsonl (`RunDir.event`); `LoggingRunDir` is a RunDir whose `event` also writes the
decision as a line an operator reads in `dldctl logs supervisor`:

    2026-12-02 12:01:02 learner-2 died: process gone after 41.0 s (killed by `dldctl chaos`); restart 1 in 5.0 s
    2026-12-02 12:01:07 learner-2 restarted: pid 81234 on gpu-2 (restart 1)
    2026-12-02 12:03:10 learner-3 unreachable: host gpu-3 does not answer; will retry

`decision_line` (pure) says how each kind reads. The line is written with one `write()` to the
file opened for appending (the supervisor's stdout and the watchdog share it, and lines never
interleave); a write the disk cannot take is dropped and counted and said once as a
`write_dropped` event (syncer/common/jsonl.py), never raised: a full disk does not stop the
supervisor.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dldctl.rundir import RunDir
from syncer.common import jsonl

# how a kind reads after its target ("learner-2 died: ..."); a kind not here reads as its words
VERBS = {
    "death": "died",
    "syncer_death": "died",
    "start": "started",
    "restart": "restarted",
    "start_failed": "failed to start",
    "host_unreachable": "unreachable",
    "host_back": "reachable again",
    "finished": "finished",
    "refused": "refused, not restarted",
    "spare_failed": "spare failed",
    "fault_undo": "fault undone",
    "fault_undo_failed": "fault undo failed",
    "watchdog_started": "started",
    "watchdog_restarted": "restarted",
    "watchdog_restart_failed": "restart failed",
    "supervisor_lost": "lost",
    "supervisor_restarted": "restarted by the watchdog",
    "supervisor_restart_failed": "restart failed",
    "supervisor_start": "started",
    "supervisor_stop": "stopped",
    "watchdog_start": "started",
    "watchdog_stop": "stopped",
}


def stamp(t: float) -> str:
    """`2026-12-02 12:01:02`, local time: the stamp `dldctl logs` merges by (dldctl/observe/logmerge.py)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def decision_line(record: dict[str, Any]) -> str:
    """One event record (t, kind, target, detail) as a log line, without its newline."""
    kind = str(record.get("kind", ""))
    verb = VERBS.get(kind, kind.replace("_", " "))
    detail = " ".join(str(record.get("detail", "")).split())  # one line, whatever the detail held
    t = record.get("t")
    when = stamp(float(t)) if isinstance(t, (int, float)) else stamp(time.time())
    return f"{when} {record.get('target', '')} {verb}" + (f": {detail}" if detail else "")


class LoggingRunDir(RunDir):
    """A RunDir whose events are also decision lines in supervisor.log (never raising)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._sink: jsonl.FileSink | None = None

    def event(self, kind: str, target: str, detail: str = "", **fields: object) -> dict[str, Any]:
        record = super().event(kind, target, detail, **fields)
        self.log_line(decision_line(record))
        return record

    def log_line(self, line: str) -> bool:
        """Append one line to supervisor.log; False if it was dropped (counted, said once)."""
        if self._sink is None:
            self._sink = jsonl.FileSink(self.supervisor_log, self.log_cap(), notices=self.events)
        return self._sink.put((line + "\n").encode("utf-8", "backslashreplace"))
