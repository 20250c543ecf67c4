"""The syncer's operator log: what `dldctl logs syncer` shows, one timestamped line per thing an
operator needs (its start, resume or fresh start, checkpoints, rejections, quorum lost/regained,
joins and deaths of learners, shutdown), never one line per packet.

`OpLog` is pure: it is handed each event (kind, target, detail) with `now` and returns the lines
to print; the server prints them with `say` (on a stdout that never raises, syncer/common/jsonl.py).
- Rejections (`reject`, `send_dropped`, `drop`) and backlog notes, per class (the kind and the
  reason before the first colon; a backlog per learner): the first one at once, then every
  `every_s` a count of those since, if any.
- Checkpoints: at most one line per `every_s` (saying how many were written since the last line);
  the final checkpoint always.
- Kinds with a line of their own elsewhere (the start and resume lines) are not repeated.
Lines look like `2026-12-02 12:01:02 quorum lost: 2 live learners, minimum quorum 3`.
"""

from __future__ import annotations

import errno as errno_mod
import time
from dataclasses import dataclass
from pathlib import Path

NOISY = ("reject", "send_dropped", "drop", "backlog")  # can come many times a second: rate-limited
OWN_LINE = ("checkpoint", "syncer_start", "syncer_resume")  # said by checkpoint_line / the start lines
READS = {
    "quorum_lost": "quorum lost",
    "quorum_reached": "quorum reached",
    "quorum_regained": "quorum regained",
    "learner_lost": "learner lost",
    "learner_back": "learner back",
    "initialized": "global model initialized",
}


def stamp(now: float) -> str:
    """`2026-12-02 12:01:02`, local time (what `dldctl logs` merges by)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))


def say(lines: list[str]) -> None:
    """Print lines to the syncer's log (stdout); one that cannot be written is lost, never raised."""
    for line in lines:
        try:
            print(line, flush=True)
        except (OSError, ValueError):
            pass


def send_dropped(errno: int | None, message: str) -> str:
    """Why a send to a learner was dropped, in the operator's words (the `send_dropped` event's
    detail): ZeroMQ's "Host unreachable" (EHOSTUNREACH) only means the learner's connection is gone,
    on this machine too (its process exited or was killed): nothing was learned about a host."""
    if errno == errno_mod.EHOSTUNREACH:
        return "its connection is gone (the learner exited, was killed or cut off)"
    if errno == errno_mod.EAGAIN:
        return "its send queue is full (the learner does not read: paused, slow or cut off)"
    return message


def resumed(path: Path, outer_steps: int, versions: list[int], epoch: int, now: float) -> str:
    """The resume line: which checkpoint (its name `ckpt-EPOCH-STEP-MS.pt` carries the epoch that wrote it)."""
    parts = path.name.split("-")
    written = f"written in epoch {int(parts[1])}, " if len(parts) > 2 and parts[1].isdigit() else ""
    return (
        f"{stamp(now)} resume from checkpoint {path} ({written}outer step {outer_steps}, "
        f"fragment versions {versions}); this start is epoch {epoch}"
    )


def fresh(directory: Path, now: float) -> str:
    return (
        f"{stamp(now)} fresh start: no checkpoint in {directory}; the global model comes from the first learner to join"
    )


def human_bytes(n: int) -> str:
    """1.2 MB, 340 kB, 12 B."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@dataclass
class _Class:
    """One rejection class: when its last line went out and how many came since."""

    said_at: float
    since: int = 0
    total: int = 1
    last: str = ""


class OpLog:
    """Turns the syncer's events into operator lines, rate-limited where they can flood."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self.classes: dict[str, _Class] = {}
        self._ckpt_said = float("-inf")
        self._ckpt_since = 0

    def event(self, kind: str, target: str, detail: str, now: float) -> list[str]:
        """The lines for one event (none when rate-limited or said elsewhere)."""
        if kind in OWN_LINE:
            return []
        text = " ".join(detail.split())
        if kind in NOISY:
            return self._noisy(kind, target, text, now)
        what = READS.get(kind, kind.replace("_", " "))
        who = "" if target in ("syncer", "") else f" {target}"
        return [f"{stamp(now)} {what}{who}" + (f": {text}" if text else "")]

    def _noisy(self, kind: str, target: str, text: str, now: float) -> list[str]:
        words = kind.replace("_", " ")
        key = (
            f"{words} {text.split(':', 1)[0]}"
            if kind == "reject"
            else f"{words} {target}"
            if kind == "backlog"
            else words
        )
        seen = self.classes.get(key)
        if seen is None:
            self.classes[key] = _Class(said_at=now, last=f"{target}: {text}")
            more = f" (more of this class: a count every {self.every_s:g} s)"
            return [f"{stamp(now)} {words} {target}: {text[:300]}{more}"]
        seen.since += 1
        seen.total += 1
        seen.last = f"{target}: {text}"
        return []

    def due(self, now: float) -> list[str]:
        """Counts of the rejection classes whose interval ended with new ones in it."""
        lines = []
        for key, seen in sorted(self.classes.items()):
            if seen.since and now - seen.said_at >= self.every_s:
                lines.append(
                    f"{stamp(now)} {key}: {seen.since} more in the last {now - seen.said_at:.0f} s "
                    f"({seen.total} in all; latest from {seen.last[:200]})"
                )
                seen.said_at, seen.since = now, 0
        return lines

    def checkpoint(self, step: int, name: str, size: int, took_s: float, now: float, final: bool) -> list[str]:
        """A line for a checkpoint written: the final one always, others one per `every_s`."""
        self._ckpt_since += 1
        if not final and now - self._ckpt_said < self.every_s:
            return []
        since = self._ckpt_since
        self._ckpt_said, self._ckpt_since = now, 0
        more = f" ({since} checkpoints since the last line)" if since > 1 else ""
        head = "final checkpoint" if final else "checkpoint"
        return [f"{stamp(now)} {head} at outer step {step}: {name}, {human_bytes(size)} in {took_s:.2f} s{more}"]
