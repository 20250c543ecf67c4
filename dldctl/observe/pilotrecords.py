"""A pilot run's records and the faults found in them: the data dldctl/observe/pilotrun.py
measures and dldctl/observe/pilotspares.py reads (their own module, so neither imports the other)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dldctl.sim.pilot import FaultCost
from syncer.common.settings import RunSettings


@dataclass
class Records:
    """A run's records, as read from its directory."""

    events: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    rounds: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    settings: RunSettings
    learners: int
    name: str = ""
    hosts: dict[str, str] = field(default_factory=dict)  # learner -> its host


@dataclass
class FaultSeen:
    """One fault of the window and the times that followed it (seconds after the injection)."""

    kind: str
    target: str
    t: float
    restart_s: float | None = None
    spare: bool = False  # the restart took a warm spare
    rejoin_s: float | None = None
    contributing_s: float | None = None
    undone_s: float | None = None
    cost: FaultCost | None = None


def first_time(events: Sequence[dict[str, Any]], kinds: tuple[str, ...], target: str, after: float) -> float | None:
    """The time of the first event of one of `kinds` for `target` at or after `after`."""
    times = [e["t"] for e in events if e.get("kind") in kinds and e.get("target") == target and e["t"] >= after]
    return min(times) if times else None
