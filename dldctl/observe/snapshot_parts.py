"""The snapshot's records beyond the headline figures: the supervisor and its watchdog, the syncer
shards' rows, the data ledger, the quality guard, the syncer's screen of quarantined learners,
and a learner's scheduler job. What `dldctl status` (live and `--once`) shows of them it reads
here, typed; the rest of each object rides along in its `extra` (observe/snapshot_fields.py).

Pure: no I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dldctl.observe.snapshot_fields import (
    as_,
    count,
    counts_by,
    flag,
    ident,
    nested,
    number,
    opt_int,
    opt_numbers,
    opt_text,
    records,
    text,
)


@dataclass(frozen=True)
class Watchdog:
    alive: bool = as_(flag)
    pid: int | None = as_(opt_int)
    restarts: int = as_(count)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Supervisor:
    """The `supervisor` object (observe/snapshot.py supervisor_status): its health word (`ok`,
    `stale`, `hung`, `missing`, `stopped`), pid, restarts, heartbeat and its watchdog."""

    alive: bool = as_(flag)
    state: str = as_(text)
    pid: int | None = as_(opt_int)
    restarts: int | None = as_(opt_int)
    heartbeat_age_s: float | None = as_(number)
    watchdog: Watchdog | None = field(default=None, metadata=nested(Watchdog, optional=True))
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Shard:
    """One syncer shard's row (observe/shardrows.py): whether it answers, what it owns, its pace."""

    name: str = as_(text)
    up: bool = as_(flag)
    state: str = as_(text)
    fragments: tuple[int | float, ...] | None = as_(opt_numbers)
    pid: int | None = as_(opt_int)
    epoch: int | None = as_(opt_int)
    outer_steps: int | None = as_(opt_int)
    merges_per_s: float | None = as_(number)
    checkpoint_age_s: float | None = as_(number)
    cpu_s: float | None = as_(number)
    rss_bytes: float | None = as_(number)
    restarts: int = as_(count)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Ledger:
    """The `data` object: the data ledger's progress through its epoch (docs/data.md). With the
    syncer down only the figures of its last sample are known; the others are None, and left
    out of its JSON as they were."""

    order: str = as_(text)
    epoch: float | None = as_(number, sparse=True)
    merged_share: float | None = as_(number, sparse=True)
    in_flight: float | None = as_(number, sparse=True)
    lost: float | None = as_(number, sparse=True)
    reissued: float | None = as_(number, sparse=True)
    merged: float | None = as_(number, sparse=True)
    partial: float | None = as_(number, sparse=True)
    units: float | None = as_(number, sparse=True)
    off_ledger_tokens: float | None = as_(number, sparse=True)
    queued_again: float | None = as_(number, sparse=True)
    merged_tokens: float | None = as_(number, sparse=True)
    tokens_by_learner: Mapping[str, float] | None = as_(counts_by, sparse=True)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GuardScore:
    loss: float | None = as_(number)
    good: bool = as_(flag)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Guard:
    """The `guard` object: how often the quality guard tripped and rolled back, its last score."""

    trips: int = as_(count)
    rollbacks: int = as_(count)
    last: GuardScore = field(default_factory=GuardScore, metadata=nested(GuardScore))
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScreenRow:
    """A learner the syncer's screen watches: quarantined or not, for how long more, why."""

    learner: str = as_(text)
    state: str = as_(text)
    remaining_s: float | None = as_(number)
    reason: str = as_(text)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Screen:
    learners: tuple[ScreenRow, ...] = as_(records(ScreenRow))
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Job:
    """A learner's scheduler job: its id, state, and what the scheduler says of it."""

    id: str | int | None = as_(ident)
    state: str | None = as_(opt_text)
    says: str | None = as_(opt_text)
    extra: Mapping[str, Any] = field(default_factory=dict)
