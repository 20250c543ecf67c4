"""The pure side of `dldctl logs` over several targets: which targets a pattern names, when a log
line was written, lines of several logs merged in time order, and the target prefix on each.

No I/O here: the command reads the logs (dldctl/commands/logs.py) and hands their lines in; `now`
is an argument wherever a time is read from a line that has no date.

A line's time is its leading stamp, `2026-12-02 12:01:02` (the supervisor, syncer and learner logs)
or `12:01:02` (older learner lines, notices): a clock time without a date is taken as the latest
such time not after `now`. A line without a stamp (a traceback, a wrapped message) belongs to the
stamped line above it, so merging never tears a traceback apart.
"""

from __future__ import annotations

import fnmatch
import heapq
import re
import time
from collections.abc import Iterable, Sequence

_STAMP = re.compile(r"^(?:(\d{4})-(\d{2})-(\d{2})[ T])?(\d{2}):(\d{2}):(\d{2})(?![\d:])")
DAY_S = 86400.0


def known_order(names: Iterable[str]) -> list[str]:
    """Targets as an operator reads them: syncer(s) first, learners by number, then the rest."""

    def key(name: str) -> tuple[int, str, int]:
        head, _, tail = name.rpartition("-")
        group = 0 if name.startswith("syncer") else 1 if name.startswith("learner") else 2
        return (group, head or name, int(tail)) if tail.isdigit() else (group, name, -1)

    return sorted(set(names), key=key)


def match_targets(patterns: Sequence[str], known: Iterable[str]) -> tuple[list[str], list[str]]:
    """(the known targets the patterns name, in known_order; the patterns that name none).

    A pattern is a name or a shell glob (`learner-*`, `learner-[12]`)."""
    ordered = known_order(known)
    chosen: set[str] = set()
    unmatched: list[str] = []
    for pattern in patterns:
        hits = [name for name in ordered if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            unmatched.append(pattern)
        chosen.update(hits)
    return [name for name in ordered if name in chosen], unmatched


def line_time(line: str, now: float) -> float | None:
    """The epoch time of a line's leading stamp (local time), None if it has none."""
    m = _STAMP.match(line)
    if m is None:
        return None
    year, month, day, hh, mm, ss = m.groups()
    if year is not None:
        parts = (int(year), int(month), int(day), int(hh), int(mm), int(ss), 0, 0, -1)
        return time.mktime(parts)
    today = time.localtime(now)
    parts = (today.tm_year, today.tm_mon, today.tm_mday, int(hh), int(mm), int(ss), 0, 0, -1)
    t = time.mktime(parts)
    return t - DAY_S if t > now + 60.0 else t  # a clock time later than now was yesterday's


def stamped(lines: Iterable[str], now: float) -> list[tuple[float | None, str]]:
    """Each line with its time; an unstamped line takes the time of the stamped line above it."""
    out: list[tuple[float | None, str]] = []
    last: float | None = None
    for line in lines:
        t = line_time(line, now)
        last = t if t is not None else last
        out.append((last, line))
    return out


def since(lines: list[tuple[float | None, str]], start: float) -> list[tuple[float | None, str]]:
    """The lines written at or after `start` (a line of unknown time is left out)."""
    return [(t, line) for t, line in lines if t is not None and t >= start]


def merge(streams: dict[str, list[tuple[float | None, str]]]) -> list[tuple[str, str]]:
    """(target, line) of every stream in time order; each stream keeps its own order, and a
    line of unknown time goes first (it was written before the first stamp of its log)."""

    def keyed(target: str, rows: list[tuple[float | None, str]]) -> Iterable[tuple[float, int, str, str]]:
        order = list(streams).index(target)
        return ((float("-inf") if t is None else t, order, target, line) for t, line in rows)

    merged = heapq.merge(*(keyed(target, rows) for target, rows in streams.items()), key=lambda r: (r[0], r[1]))
    return [(target, line) for _, _, target, line in merged]


def prefix_width(targets: Iterable[str]) -> int:
    """The padding that lines the prefixes up: the longest target's name."""
    return max((len(t) for t in targets), default=0)


def prefixed(target: str, line: str, width: int) -> str:
    """`learner-1  | the line`: the target, padded to `width`, then the line."""
    return f"{target:<{width}} | {line}"
