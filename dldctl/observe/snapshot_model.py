"""The typed, versioned status snapshot: what `dldctl status --json` prints and every view reads.

`observe/snapshot.py` gathers it (the syncer's answer, the run state, the event log);
`Snapshot.from_json` types it, `to_json` gives the JSON contract back (docs/status.md): the typed
fields under their JSON names, every other key as it came (`extra`), and `version`. A key is
added in a new version, never renamed; a reader of an older snapshot gets the defaults, so a
figure is `None` where it is unknown rather than a crash. `Figures` are the headline numbers a
run ends with: `down`, `runs` and the report read them from the same record (the metrics log's
newest sample, which the syncer writes last at shutdown, after its final score), so they agree.

Pure: no I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

VERSION = 1  # the snapshot's shape: raised when a key changes meaning (keys are only ever added)
SCHEMA = "dldctl.status/1"  # `status --json`; fields may be added, none renamed (docs/status.md)

T = TypeVar("T")


def num(value: Any) -> float | None:
    """A finite JSON number as a float (None: absent, null, NaN, inf or not a number; nor a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def count(value: Any) -> int:
    """A JSON count as an int (a whole float too); 0 where it is absent or not a finite number."""
    number = num(value)
    return int(number) if number is not None else 0


def opt_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def opt_text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def flag(value: Any) -> bool:
    return value if isinstance(value, bool) else False


def _as(reader: Callable[[Any], Any], key: str = "") -> Any:
    """A typed field: how its JSON value is read, and its JSON key where it differs from its name."""
    return field(default=reader(None), metadata={"read": reader, "key": key})


def _key(f: Any) -> str:
    return str(f.metadata.get("key") or f.name)


_FIELDS: dict[type, tuple[Any, ...]] = {}


def _typed(cls: type) -> tuple[Any, ...]:
    """The typed fields of a record class (found once per class: a frame reads thousands of rows)."""
    if cls not in _FIELDS:
        _FIELDS[cls] = tuple(f for f in fields(cls) if "read" in f.metadata)
    return _FIELDS[cls]


def read_record(cls: type[T], data: Any) -> T:
    """An instance of the flat record `cls` from a JSON object: each typed field read by its
    reader, every other key kept in `extra` (a non-object reads as all defaults)."""
    d: Mapping[str, Any] = data if isinstance(data, Mapping) else {}
    typed = _typed(cls)
    names = {_key(f) for f in typed}
    values = {f.name: f.metadata["read"](d.get(_key(f))) for f in typed}
    values["extra"] = {k: v for k, v in d.items() if k not in names}
    return cls(**values)


def _write(record: Any) -> dict[str, Any]:
    """The JSON object of a flat record: its `extra` keys, then its typed fields."""
    out = dict(record.extra)
    out.update({_key(f): getattr(record, f.name) for f in _typed(type(record))})
    return out


@dataclass(frozen=True)
class Loss:
    """The fleet's losses: the learners' mean train loss, their eval, and the global model's score
    (`global_off`: why it is not scored, syncer/common/unscored.py)."""

    train: float | None = _as(num)
    eval: float | None = _as(num)
    global_: float | None = _as(num, "global")
    global_off: str | None = _as(opt_text)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Figures:
    """The headline numbers of a run at one moment, whichever record carried them."""

    outer_steps: int = 0
    goodput: float | None = None
    goodput_window: float | None = None
    tokens_trained: int = 0
    tokens_merged: int = 0
    tokens_per_s: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    ddp_equivalent: int = 0
    loss: Loss = field(default_factory=Loss)

    @classmethod
    def from_sample(cls, sample: Mapping[str, Any]) -> Figures:
        """From a metrics "sample" record (syncer/status.py sample_record)."""
        loss = Loss(
            num(sample.get("loss_train")),
            num(sample.get("loss_eval")),
            num(sample.get("loss_global")),
            opt_text(sample.get("global_off")),
        )
        return cls(
            count(sample.get("outer_steps")),
            num(sample.get("goodput")),
            num(sample.get("goodput_window")),
            count(sample.get("tokens_trained")),
            count(sample.get("tokens_merged")),
            num(sample.get("tokens_per_s")),
            count(sample.get("bytes_up")),
            count(sample.get("bytes_down")),
            count(sample.get("ddp_equivalent")),
            loss,
        )

    @property
    def scored_loss(self) -> float | None:
        """The run's loss as `runs` shows it: the global model's score, else the learners' eval."""
        return self.loss.global_ if self.loss.global_ is not None else self.loss.eval


@dataclass(frozen=True)
class SyncerPart:
    """The `syncer` object: alive, progress and where it is (its counters stay in `extra`)."""

    alive: bool = _as(flag)
    outer_steps: int | None = _as(opt_int)  # None: not known (an old or partial snapshot)
    checkpoint_outer_step: int | None = _as(opt_int)
    address: str | None = _as(opt_text)
    pid: int | None = _as(opt_int)
    epoch: int | None = _as(opt_int)
    fragments: int | None = _as(opt_int)
    restarts: int = _as(count)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Quorum:
    """The `quorum` object: live learners against the minimum."""

    min: int = _as(count)
    live: int = _as(count)
    total: int = _as(count)
    below_quorum: bool = _as(flag)
    last_round_contributors: int | None = _as(opt_int)
    open_rounds: int | None = _as(opt_int)
    grace_used_s: float | None = _as(num)
    grace_window_s: float | None = _as(num)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Tokens:
    trained: int = _as(count)
    merged: int = _as(count)
    per_s: float | None = _as(num)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Bytes:
    """Bytes the learners sent up and received down, and what data-parallel training would move."""

    up: int = _as(count)
    down: int = _as(count)
    ddp_equivalent: int = _as(count)
    compression_ratio: float | None = _as(num)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Learner:
    """One learner's row (the rest of what the syncer says of it stays in `extra`)."""

    id: str = _as(text)
    host: str = _as(text)
    device: str = _as(text)
    state: str = _as(text)
    pid: int | None = _as(opt_int)
    step: int | None = _as(opt_int)
    tokens: int = _as(count)
    tokens_per_s: float | None = _as(num)
    restarts: int | None = _as(opt_int)
    weight: float | None = _as(num)
    heartbeat_age_s: float | None = _as(num)
    straggler: bool = _as(flag)
    loss: float | None = _as(num)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Event:
    """One line of events.jsonl; the structured fields some kinds carry (a checkpoint's
    `outer_step`, `epoch`, `checkpoint`) stay in `extra`."""

    t: float | None = _as(num)
    kind: str = _as(text)
    target: str = _as(text)
    detail: str = _as(text)
    extra: Mapping[str, Any] = field(default_factory=dict)


def _rows(value: Any) -> list[Mapping[str, Any]]:
    return [r for r in value if isinstance(r, Mapping)] if isinstance(value, list) else []


SECTIONS: dict[str, type] = {"syncer": SyncerPart, "quorum": Quorum, "tokens": Tokens, "bytes": Bytes, "loss": Loss}
TYPED = ("version", "schema", "run", "status", "now", "uptime_s", "goodput", "goodput_window", "learners", "events")


@dataclass(frozen=True)
class Snapshot:
    """`dldctl status --json`, typed where the operator's figures come from; the sections not
    typed yet (supervisor, shards, data, faults, ...) ride along in `extra`, unchanged."""

    version: int = VERSION
    schema: str = SCHEMA
    run: str = ""
    status: str = ""
    now: float = 0.0
    uptime_s: float | None = None
    goodput: float | None = None  # the whole run's
    goodput_window: float | None = None  # the last 60 s
    syncer: SyncerPart = field(default_factory=SyncerPart)
    quorum: Quorum = field(default_factory=Quorum)
    tokens: Tokens = field(default_factory=Tokens)
    bytes: Bytes = field(default_factory=Bytes)
    loss: Loss = field(default_factory=Loss)
    learners: tuple[Learner, ...] = ()
    events: tuple[Event, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Snapshot:
        return cls(
            version=opt_int(data.get("version")) or VERSION,
            schema=text(data.get("schema")) or SCHEMA,
            run=text(data.get("run")),
            status=text(data.get("status")),
            now=num(data.get("now")) or 0.0,
            uptime_s=num(data.get("uptime_s")),
            goodput=num(data.get("goodput")),
            goodput_window=num(data.get("goodput_window")),
            **{name: read_record(kind, data.get(name)) for name, kind in SECTIONS.items()},
            learners=tuple(read_record(Learner, r) for r in _rows(data.get("learners"))),
            events=tuple(read_record(Event, e) for e in _rows(data.get("events"))),
            extra={k: v for k, v in data.items() if k not in TYPED and k not in SECTIONS},
        )

    def to_json(self) -> dict[str, Any]:
        out = dict(self.extra)
        out.update(
            version=self.version,
            schema=self.schema,
            run=self.run,
            status=self.status,
            now=self.now,
            uptime_s=self.uptime_s,
            goodput=self.goodput,
            goodput_window=self.goodput_window,
            **{name: _write(getattr(self, name)) for name in SECTIONS},
            learners=[_write(r) for r in self.learners],
            events=[_write(e) for e in self.events],
        )
        return out

    @property
    def figures(self) -> Figures:
        """The headline numbers, as a metrics sample would carry them."""
        return Figures(
            self.syncer.outer_steps or 0,
            self.goodput,
            self.goodput_window,
            self.tokens.trained,
            self.tokens.merged,
            self.tokens.per_s,
            self.bytes.up,
            self.bytes.down,
            self.bytes.ddp_equivalent,
            self.loss,
        )


def final_figures(sample: Mapping[str, Any] | None, snap: Mapping[str, Any] | None) -> Figures | None:
    """Where a run ended (`down`'s summary): the metrics log's newest sample, which the syncer
    writes last as it shuts down (after its final score and checkpoint) and which `runs`,
    `export` and the report read too, so every one says the same number; its learners' losses,
    gone once they stopped, from the syncer's last answer `snap`. Without a sample: that answer;
    None without either."""
    answered = Snapshot.from_json(snap).figures if snap else None
    if sample is None:
        return answered
    figures = Figures.from_sample(sample)
    if answered is None:
        return figures
    train = figures.loss.train if figures.loss.train is not None else answered.loss.train
    evaluated = figures.loss.eval if figures.loss.eval is not None else answered.loss.eval
    return replace(figures, loss=replace(figures.loss, train=train, eval=evaluated))
