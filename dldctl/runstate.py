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
every field and the schema version, so a file from another dldctl (or a damaged one) is one
line naming the file, not a KeyError deep in the supervisor. Stdlib only: every room imports it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from dldctl.errors import RunError
from dldctl.hostruntime import HostRuntime
from dldctl.hosts.slurmjobs import JobInfo

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


@dataclass(frozen=True)
class PidRecord:
    """A process we started: its pid and start time in clock ticks (a reused pid has another)."""

    pid: int
    start_ticks: int

    @classmethod
    def from_json(cls, data: Any, where: str) -> PidRecord:
        d = _obj(data, where, {"pid", "start_ticks"})
        return cls(_get(d, "pid", int, where), _get(d, "start_ticks", int, where))

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_ticks": self.start_ticks}


@dataclass(frozen=True)
class Daemon:
    """The supervisor's or the watchdog's record: who runs, since when, how often restarted."""

    pid: int
    start_ticks: int
    started: float | None = None
    restarts: int = 0

    @classmethod
    def from_json(cls, data: Any, where: str) -> Daemon:
        d = _obj(data, where, {"pid", "start_ticks", "started", "restarts"})
        return cls(
            _get(d, "pid", int, where),
            _get(d, "start_ticks", int, where),
            _opt(d, "started", float, where),
            _get(d, "restarts", int, where, 0),
        )

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_ticks": self.start_ticks, "started": self.started, "restarts": self.restarts}


PROC_KEYS = {
    "kind",
    "host",
    "status",
    "proc",
    "restarts",
    "fast_deaths",
    "started_at",
    "next_start",
    "hold_until",
    "chaos_kill",
    "killed_by",
    "reason",
    "job",
}


@dataclass(frozen=True)
class Proc:
    """One supervised process. `kind` is "syncer" or "learner"; `reason` says why one never started."""

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
    killed_by: str | None = None  # who killed it on purpose (with chaos_kill): `dldctl chaos`, the live view
    reason: str | None = None
    job: JobInfo | None = None  # on a scheduler site: its (last) job as the scheduler said

    @classmethod
    def from_json(cls, data: Any, where: str) -> Proc:
        d = _obj(data, where, PROC_KEYS)
        status = _get(d, "status", str, where, ProcStatus.PENDING.value)
        try:
            typed = ProcStatus(status)
        except ValueError:
            raise Malformed(f"{where}.status: unknown process status {status!r}") from None
        pid, job = d.get("proc"), d.get("job")
        return cls(
            kind=_get(d, "kind", str, where),
            host=_get(d, "host", str, where),
            status=typed,
            proc=None if pid is None else PidRecord.from_json(pid, f"{where}.proc"),
            restarts=_get(d, "restarts", int, where, 0),
            fast_deaths=_get(d, "fast_deaths", int, where, 0),
            started_at=_opt(d, "started_at", float, where),
            next_start=_opt(d, "next_start", float, where),
            hold_until=_opt(d, "hold_until", float, where),
            chaos_kill=_get(d, "chaos_kill", bool, where, False),
            killed_by=_opt(d, "killed_by", str, where),
            reason=_opt(d, "reason", str, where),
            job=None if job is None else _job(job, f"{where}.job"),
        )

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in sorted(PROC_KEYS)}
        out["status"] = self.status.value
        out["proc"] = self.proc.to_json() if self.proc else None
        out["job"] = self.job.to_json() if self.job else None
        return out

    @property
    def learner(self) -> bool:
        return self.kind == "learner"


@dataclass(frozen=True)
class HostRecord:
    """A host of the run: how to start processes there and a status word."""

    runtime: HostRuntime
    status: str = "ok"

    @classmethod
    def from_json(cls, data: Any, where: str) -> HostRecord:
        d = _obj(data, where, {"runtime", "status"})
        return cls(_runtime(_get(d, "runtime", dict, where), f"{where}.runtime"), _get(d, "status", str, where, "ok"))

    def to_json(self) -> dict[str, Any]:
        return {"runtime": self.runtime.to_dict(), "status": self.status}


def _job(data: Any, where: str) -> JobInfo:
    """A JobInfo as JobInfo.to_json wrote it."""
    d = _obj(data, where, {"id", "state", "reason", "nodes"})
    return JobInfo(
        _get(d, "id", int, where),
        _get(d, "state", str, where),
        _get(d, "reason", str, where, ""),
        _get(d, "nodes", str, where, ""),
    )


def _runtime(data: dict[str, Any], where: str) -> HostRuntime:
    """A HostRuntime as HostRuntime.to_dict wrote it (a run of an older dldctl has no `code`)."""
    d = _obj(data, where, set(HostRuntime.__dataclass_fields__))
    return HostRuntime(
        host=_get(d, "host", str, where),
        python=_get(d, "python", str, where),
        pythonpath=_get(d, "pythonpath", str, where),
        run_dir=_get(d, "run_dir", str, where),
        config=_get(d, "config", str, where),
        code=_get(d, "code", str, where, ""),
    )


@dataclass(frozen=True)
class Fault:
    """An injected pause / slow / partition / link cap (or a kill's record) and when it ends."""

    id: str
    kind: str
    target: str
    until: float = 0.0
    injected_at: float | None = None
    factor: float | None = None
    undone: bool = False
    rate: str | None = None  # link: the cap, as tc writes it ("1mbit")

    @classmethod
    def from_json(cls, data: Any, where: str) -> Fault:
        d = _obj(data, where, {"id", "kind", "target", "until", "injected_at", "factor", "undone", "rate"})
        return cls(
            _get(d, "id", str, where),
            _get(d, "kind", str, where),
            _get(d, "target", str, where),
            _get(d, "until", float, where, 0.0),
            _opt(d, "injected_at", float, where),
            _opt(d, "factor", float, where),
            _get(d, "undone", bool, where, False),
            _opt(d, "rate", str, where),
        )

    def to_json(self) -> dict[str, Any]:
        """The record as `status --json` lists it (`undone` only when set: it always was absent)."""
        out: dict[str, Any] = {"id": self.id, "kind": self.kind, "target": self.target, "until": self.until}
        for key in ("injected_at", "factor", "rate"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.undone:
            out["undone"] = True
        return out


STATE_KEYS = {
    VERSION_KEY,
    "run",
    "run_id",
    "dir",
    "status",
    "created",
    "stopped_at",
    "updated",
    "procs",
    "hosts",
    "faults",
    "supervisor",
    "watchdog",
    "spares",
    "mirror",
}


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
            return cls._parse(data)
        except Malformed as exc:
            raise RunError(
                f"{path}: malformed state ({exc})",
                hint="`dldctl down` still stops every process it can find (procs.jsonl)",
            ) from None

    @classmethod
    def _parse(cls, d: dict[str, Any]) -> RunState:
        unknown = sorted(set(d) - STATE_KEYS)
        if unknown:
            raise Malformed(f"unknown key {unknown[0]!r}")
        daemons = {r: _opt_rec(d.get(r), r, Daemon.from_json) for r in ("supervisor", "watchdog")}
        return cls(
            status=_get(d, "status", str, "state"),
            procs=_mapping(d, "procs", Proc.from_json),
            run=_get(d, "run", str, "state", ""),
            run_id=_get(d, "run_id", str, "state", ""),
            dir=_get(d, "dir", str, "state", ""),
            created=_opt(d, "created", float, "state"),
            stopped_at=_opt(d, "stopped_at", float, "state"),
            updated=_opt(d, "updated", float, "state"),
            hosts=_mapping(d, "hosts", HostRecord.from_json),
            faults=tuple(
                Fault.from_json(f, f"faults[{i}]") for i, f in enumerate(_get(d, "faults", list, "state", []))
            ),
            spares=_mapping(d, "spares", PidRecord.from_json),
            mirror={k: _get({k: v}, k, int, "mirror") for k, v in _get(d, "mirror", dict, "state", {}).items()},
            **daemons,
        )

    def to_json(self) -> dict[str, Any]:
        """The file's JSON (with the schema version), keys as older dldctl wrote them."""
        return {
            VERSION_KEY: SCHEMA_VERSION,
            "run": self.run,
            "run_id": self.run_id,
            "dir": self.dir,
            "status": self.status,
            "created": self.created,
            "stopped_at": self.stopped_at,
            "updated": self.updated,
            "procs": {n: p.to_json() for n, p in self.procs.items()},
            "hosts": {n: h.to_json() for n, h in self.hosts.items()},
            "faults": [f.to_json() for f in self.faults],
            "supervisor": self.supervisor.to_json() if self.supervisor else None,
            "watchdog": self.watchdog.to_json() if self.watchdog else None,
            "spares": {n: s.to_json() for n, s in self.spares.items()},
            "mirror": dict(self.mirror),
        }


# -- field checks: each raises Malformed naming where in the file --------------------------------
_MISSING: Any = object()


def _obj(data: Any, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise Malformed(f"{where}: not an object")
    unknown = sorted(set(data) - keys)
    if unknown:
        raise Malformed(f"{where}: unknown key {unknown[0]!r}")
    return data


def _get(d: dict[str, Any], key: str, kind: type[T], where: str, default: Any = _MISSING) -> T:
    """d[key] checked to be a `kind` (an int is a float; a bool is no int); `default` if absent."""
    if key not in d:
        if default is _MISSING:
            raise Malformed(f"{where}.{key}: missing")
        return default
    value = d[key]
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # type: ignore[return-value]
    if not ok:
        raise Malformed(f"{where}.{key}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _opt(d: dict[str, Any], key: str, kind: type[T], where: str) -> T | None:
    return None if d.get(key) is None else _get(d, key, kind, where)


def _opt_rec(data: Any, where: str, parse: Callable[[Any, str], T]) -> T | None:
    return None if data is None else parse(data, where)


def _mapping(d: dict[str, Any], key: str, parse: Callable[[Any, str], T]) -> dict[str, T]:
    items = _get(d, key, dict, "state", {})
    return {str(name): parse(value, f"{key}[{name!r}]") for name, value in items.items()}


DOWN_REASON = "stopped by down"  # a Proc.reason: what `up --resume` starts again


def new_proc(kind: str, host: str) -> Proc:
    """A process not started yet (the supervisor starts every pending one)."""
    return Proc(kind=kind, host=host)
