"""Warm spares as a pilot run had them (for dldctl/observe/pilotrun.py): which kills found their
host's spare ready, and how long a spare takes to get ready under the run's own load.

A kill that found its host's spare ready costs a quick take-over (the run's fastest, about a
second); one that costs much more (over twice that, plus half a second) waited: for the spare
handed over while it was still starting, or for a fresh process. Each such wait measures a
spare's start-up: from that spare's start (the supervisor's rule replayed over the host's
restarts: a second after one, no sooner than 30 s after the previous spare's start) to this
rejoin; a fresh process's, its rejoin less a quick take-over. Start-up under load (torch imported beside busy
learners) is slower than the fleet's own first start, which is only the fallback when no kill
waited.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from dldctl.observe.pilotrecords import FaultSeen, Records, first_time
from dldctl.sim.pilot import Spares, next_spare
from dldctl.supervise.spares import SPARE_DELAY_S, SPARE_RETRY_S

WAIT_MARGIN_S = 0.5
MIN_TAKEOVER_S = 0.1  # a "rejoin" sooner than this after a kill is another process's, not the take-over


def first_start_up(rec: Records) -> float | None:
    """The fleet's own first start: each learner's first `start` to its first `join` (median)."""
    spans = []
    for lid in rec.hosts:
        started = first_time(rec.events, ("start",), lid, -math.inf)
        joined = first_time(rec.events, ("join",), lid, started) if started is not None else None
        if started is not None and joined is not None:
            spans.append(joined - started)
    return statistics.median(spans) if spans else None


def quick_takeover(kills: Sequence[FaultSeen]) -> float | None:
    """The run's fastest kill-to-rejoin through a warm spare."""
    downs = [f.rejoin_s for f in kills if f.spare and f.rejoin_s is not None and f.rejoin_s > MIN_TAKEOVER_S]
    return min(downs) if downs else None


def waited(f: FaultSeen, quick: float | None) -> bool:
    """Whether a kill cost much more than a quick take-over: it waited for a process to start."""
    return quick is not None and f.rejoin_s is not None and f.rejoin_s > 2 * quick + WAIT_MARGIN_S


def spare_start(rec: Records, f: FaultSeen) -> float:
    """When the spare this kill found on its host had started (or was due to): the supervisor's
    rule replayed over the host's restarts before it (-inf: the run's first spare, long ready)."""
    host = rec.hosts.get(f.target)
    start = -math.inf
    for e in sorted(rec.events, key=lambda e: e["t"]):
        if e["t"] >= f.t:
            break
        if e.get("kind") == "restart" and rec.hosts.get(str(e.get("target"))) == host:
            start = next_spare(start, e["t"], SPARE_DELAY_S, SPARE_RETRY_S)
    return start


def start_ups(rec: Records, kills: Sequence[FaultSeen]) -> list[float]:
    """A spare's start-up under the run's load, one per kill that waited for one."""
    quick = quick_takeover(kills)
    out = []
    for f in kills:
        if quick is None or f.rejoin_s is None or not waited(f, quick):
            continue
        if f.spare:
            out.append(f.t + f.rejoin_s - spare_start(rec, f))
        else:
            out.append(f.rejoin_s - quick)
    return [s for s in out if s > 0]


def spare_model(rec: Records, kills: Sequence[FaultSeen]) -> tuple[Spares | None, str]:
    """The run's warm spares (None without them) and where their start-up came from."""
    if not rec.settings.warm_spares or not rec.hosts:
        return None, "the run had no warm spares"
    measured = start_ups(rec, kills)
    cold = statistics.median(measured) if measured else first_start_up(rec)
    if cold is None:
        return None, "no learner's start-up was recorded"
    source = (
        f"median of {len(measured)} kills that waited for a spare"
        if measured
        else "the fleet's first start; no kill waited"
    )
    per_host = max(1, round(len(rec.hosts) / len(set(rec.hosts.values()))))
    return Spares(per_host, cold, SPARE_DELAY_S, SPARE_RETRY_S), source
