"""The run state (`state.json`) as typed, frozen records: the one schema every module reads.

    RunState    the whole file: the run's status, its processes, hosts, faults, daemons, spares
    Proc        one process the supervisor keeps (the syncer, every learner)
    ProcStatus  where a process is in its life (the JSON value is the status string itself)
    PidRecord   a started process: pid and start time (so a reused pid is not mistaken for it);
                on a scheduler site, a job id with start_ticks JOB_TICKS
    JobInfo     a scheduler's job as it last said (dldctl/hosts/slurmjobs.py)
    Daemon      the supervisor or the watchdog: a PidRecord with its start time and restarts
    HostRecord  a host of the run: how to run things there (a HostRuntime, dldctl/hostruntime.py)
    Fault       an injected fault the supervisor undoes at `until`

Only `dldctl/rundir.py` loads and saves it (under the state lock); everyone else reads attributes
and derives a new state with `dataclasses.replace` or the `with_*` helpers. `from_json` checks
the schema version and every field, by its annotation through the typed codec
(syncer/common/typedcodec.py), so a file from another dldctl (or a damaged one) is one line naming
the file and the field, not a KeyError deep in the supervisor. Stdlib and syncer.common only:
every room imports it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Self, TypeVar

from dldctl.errors import RunError
from dldctl.hostruntime import HostRuntime
from dldctl.hosts.slurmjobs import JobInfo
from syncer.common.typedcodec import SettingsError, checked, from_mapping, to_mapping

SCHEMA_VERSION = 1
VERSION_KEY = "schema_version"

T = TypeVar("T")


class ProcStatus(enum.StrEnum):
    """pending -> starting -> running -> dead -> (restart) starting -> ...; also unreachable (its
    host does not answer), finished (a learner that spent its budget), stopped (removed/down)."""

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    DEAD = "dead"
    UNREACHABLE = "unreachable"
    FINISHED = "finished"
    STOPPED = "stopped"


class Malformed(ValueError):
    """A field of the state file is missing or of the wrong type (from_json names the file)."""


def _decoded(cls: type[T], data: Any, where: str) -> T:
    """`cls` from its JSON by the typed codec (each field by its annotation); Malformed naming
    where in the file (`procs['learner-0'].restarts: must be int, got str 'two'`)."""
    try:
        return from_mapping(cls, data, where)
    except SettingsError as exc:
        raise Malformed(f"{exc.key}: {exc.problem}" if exc.key else exc.problem) from None


class Record:
    """A record of the state file: read and written field by field from its annotations."""

    @classmethod
    def from_json(cls, data: Any, where: str) -> Self:
        return _decoded(cls, data, where)

    def to_json(self) -> dict[str, Any]:
        return to_mapping(self)


@dataclass(frozen=True)
class PidRecord(Record):
    """A process we started: its pid and start time in clock ticks (a reused pid has another)."""

    pid: int
    start_ticks: int


@dataclass(frozen=True)
class Daemon(Record):
    """The supervisor's or the watchdog's record: who runs, since when, how often restarted."""

    pid: int
    start_ticks: int
    started: float | None = None
    restarts: int = 0


@dataclass(frozen=True)
class Proc(Record):
    """One supervised process. `kind` is "syncer" or "learner"; `reason` says why one never started;
    `killed_by` who killed it on purpose (written only when set, so older dldctl reads the file)."""

    kind: str
    host: str
    status: ProcStatus = ProcStatus.PENDING
    proc: PidRecord | None = None
    restarts: int = 0
    fast_deaths: int = 0
    started_at: float | None = None
    next_start: float | None = None
    hold_until: float | None = None
    chaos_kill: bool = False
    killed_by: str | None = checked(None, omit_default=True)
    reason: str | None = None
    job: JobInfo | None = None  # on a scheduler site: its (last) job as the scheduler said

    @property
    def learner(self) -> bool:
        return self.kind == "learner"


@dataclass(frozen=True)
class HostRecord(Record):
    """A host of the run: how to start processes there and a status word (a run of an older
    dldctl has no `runtime.code`: it reads as "")."""

    runtime: HostRuntime
    status: str = "ok"


@dataclass(frozen=True)
class Fault(Record):
    """An injected pause / slow / partition / link cap (or a kill's record) and when it ends. As
    `status --json` lists it, the optional fields only when set (`undone` always was absent)."""

    id: str
    kind: str
    target: str
    until: float = 0.0
    injected_at: float | None = checked(None, omit_default=True)
    factor: float | None = checked(None, omit_default=True)
    undone: bool = checked(False, omit_default=True)
    rate: str | None = checked(None, omit_default=True)  # link: the cap, as tc writes it ("1mbit")


@dataclass(frozen=True)
class RunState:
    """The whole state file. `status`: starting, up, stopping, down (the run's, not a process's)."""

    status: str
    procs: Mapping[str, Proc] = field(default_factory=dict)
    run: str = ""
    run_id: str = ""
    dir: str = ""
    created: float | None = None
    stopped_at: float | None = None
    updated: float | None = None
    hosts: Mapping[str, HostRecord] = field(default_factory=dict)
    faults: tuple[Fault, ...] = ()
    supervisor: Daemon | None = None
    watchdog: Daemon | None = None
    spares: Mapping[str, PidRecord] = field(default_factory=dict)
    mirror: Mapping[str, int] = field(default_factory=dict)

    # -- small updates (the records are frozen: each returns a new state) ----------------------
    def with_proc(self, name: str, proc: Proc) -> RunState:
        return replace(self, procs={**self.procs, name: proc})

    def with_status(self, status: str) -> RunState:
        return replace(self, status=status)

    def with_host(self, name: str, host: HostRecord) -> RunState:
        return replace(self, hosts={**self.hosts, name: host})

    def with_fault(self, fault: Fault) -> RunState:
        return replace(self, faults=(*self.faults, fault))

    def without_fault(self, fault_id: str) -> RunState:
        return replace(self, faults=tuple(f for f in self.faults if f.id != fault_id))

    def with_spare(self, host: str, record: PidRecord | None) -> RunState:
        """The host's spare set (or dropped, with None)."""
        spares = {k: v for k, v in self.spares.items() if k != host}
        if record is not None:
            spares[host] = record
        return replace(self, spares=spares)

    def with_daemon(self, role: str, record: Daemon | None) -> RunState:
        """`role` is "supervisor" or "watchdog"."""
        assert role in ("supervisor", "watchdog")
        return replace(self, supervisor=record) if role == "supervisor" else replace(self, watchdog=record)

    def daemon(self, role: str) -> Daemon | None:
        assert role in ("supervisor", "watchdog")
        record: Daemon | None = getattr(self, role)
        return record

    def learners(self, *, live: bool = False) -> list[str]:
        """Names of the learner processes (`live`: those not stopped), in state order."""
        return [n for n, p in self.procs.items() if p.learner and not (live and p.status is ProcStatus.STOPPED)]

    def runtime_of(self, host: str) -> HostRuntime:
        """How to start processes on a host of the run."""
        return self.hosts[host].runtime

    # -- load and save (called by RunDir only) -------------------------------------------------
    @classmethod
    def from_json(cls, data: Any, path: object) -> RunState:
        """The typed state; RunError (one line naming `path`) for another version or a bad field.
        A file without a version (older dldctl) is version 1 when its keys are the ones we know.
        `path` is only named in the message (this module does no I/O: it is in the pure core)."""
        if not isinstance(data, dict):
            raise RunError(f"{path}: corrupt state (not an object)")
        version = data.get(VERSION_KEY, SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise RunError(
                f"{path}: state schema version {version!r}, this dldctl reads version {SCHEMA_VERSION}",
                hint="use the dldctl that wrote this run (`dldctl down` with it stops the run)",
            )
        try:
            return _decoded(cls, {k: v for k, v in data.items() if k != VERSION_KEY}, "")
        except Malformed as exc:
            raise RunError(
                f"{path}: malformed state ({exc})",
                hint="`dldctl down` still stops every process it can find (procs.jsonl)",
            ) from None

    def to_json(self) -> dict[str, Any]:
        """The file's JSON (with the schema version), keys as older dldctl wrote them."""
        return {VERSION_KEY: SCHEMA_VERSION, **to_mapping(self)}


DOWN_REASON = "stopped by down"  # a Proc.reason: what `up --resume` starts again


def new_proc(kind: str, host: str) -> Proc:
    """A process not started yet (the supervisor starts every pending one)."""
    return Proc(kind=kind, host=host)
