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

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dldctl.observe.snapshot_fields import (
    as_,
    count,
    counts_by,
    flag,
    nested,
    num,
    numbers,
    opt_int,
    opt_text,
    read_record,
    records,
    text,
    texts,
    to_json,
)
from dldctl.observe.snapshot_parts import Guard, Job, Ledger, Screen, Shard, Supervisor

VERSION = 1  # the snapshot's shape: raised when a key changes meaning (keys are only ever added)
SCHEMA = "dldctl.status/1"  # `status --json`; fields may be added, none renamed (docs/status.md)


@dataclass(frozen=True)
class Loss:
    """The fleet's losses: the learners' mean train loss, their eval, and the global model's score
    (`global_off`: why it is not scored, syncer/common/unscored.py)."""

    train: float | None = as_(num)
    eval: float | None = as_(num)
    global_: float | None = as_(num, "global")
    global_off: str | None = as_(opt_text)
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

    alive: bool = as_(flag)
    outer_steps: int | None = as_(opt_int)  # None: not known (an old or partial snapshot)
    checkpoint_outer_step: int | None = as_(opt_int)
    address: str | None = as_(opt_text)
    pid: int | None = as_(opt_int)
    epoch: int | None = as_(opt_int)
    fragments: int | None = as_(opt_int)
    restarts: int = as_(count)
    dropped_sends: int | None = as_(opt_int)
    rejected: Mapping[str, float] | None = as_(counts_by)  # a lifetime counter per reason
    warnings: tuple[str, ...] = as_(texts)
    risks: tuple[str, ...] = as_(texts)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def rejected_total(self) -> float | None:
        return sum(self.rejected.values()) if self.rejected is not None else None


@dataclass(frozen=True)
class Quorum:
    """The `quorum` object: live learners against the minimum."""

    min: int = as_(count)
    live: int = as_(count)
    total: int = as_(count)
    below_quorum: bool = as_(flag)
    last_round_contributors: int | None = as_(opt_int)
    open_rounds: int | None = as_(opt_int)
    grace_used_s: float | None = as_(num)
    grace_window_s: float | None = as_(num)
    recent_contributors: tuple[int | float, ...] = as_(numbers)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Tokens:
    trained: int = as_(count)
    merged: int = as_(count)
    per_s: float | None = as_(num)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Bytes:
    """Bytes the learners sent up and received down, and what data-parallel training would move."""

    up: int = as_(count)
    down: int = as_(count)
    ddp_equivalent: int = as_(count)
    compression_ratio: float | None = as_(num)
    up_per_s: float | None = as_(num, sparse=True)  # rates, where a source says them
    down_per_s: float | None = as_(num, sparse=True)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Learner:
    """One learner's row (the rest of what the syncer says of it stays in `extra`)."""

    id: str = as_(text)
    host: str = as_(text)
    device: str = as_(text)
    state: str = as_(text)
    pid: int | None = as_(opt_int)
    step: int | None = as_(opt_int)
    tokens: int = as_(count)
    tokens_per_s: float | None = as_(num)
    restarts: int | None = as_(opt_int)
    weight: float | None = as_(num)
    heartbeat_age_s: float | None = as_(num)
    straggler: bool = as_(flag)
    loss: float | None = as_(num)
    job: Job | None = field(default=None, metadata=nested(Job, optional=True))
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Event:
    """One line of events.jsonl; the structured fields some kinds carry (a checkpoint's
    `outer_step`, `epoch`, `checkpoint`) stay in `extra`."""

    t: float | None = as_(num)
    kind: str = as_(text)
    target: str = as_(text)
    detail: str = as_(text)
    extra: Mapping[str, Any] = field(default_factory=dict)


SECTIONS: dict[str, type] = {"syncer": SyncerPart, "quorum": Quorum, "tokens": Tokens, "bytes": Bytes, "loss": Loss}
# sections a snapshot may lack (older, or a syncer without them): None where absent or not an object
OPTIONAL: dict[str, type] = {"supervisor": Supervisor, "data": Ledger, "guard": Guard, "screen": Screen}
SCALARS = ("version", "schema", "run", "status", "now", "uptime_s", "goodput", "goodput_window", "insecure")
LISTS = ("learners", "events")


@dataclass(frozen=True)
class Snapshot:
    """`dldctl status --json`, typed where the operator reads it; the sections not typed (faults,
    spares, wire_bytes, ...) ride along in `extra`, unchanged. An optional section that is absent
    or null is None here, and written back as it came."""

    version: int = VERSION
    schema: str = SCHEMA
    run: str = ""
    status: str = ""
    now: float | None = None  # when it was taken
    uptime_s: float | None = None
    goodput: float | None = None  # the whole run's
    goodput_window: float | None = None  # the last 60 s
    insecure: bool = False
    syncer: SyncerPart = field(default_factory=SyncerPart)
    quorum: Quorum = field(default_factory=Quorum)
    tokens: Tokens = field(default_factory=Tokens)
    bytes: Bytes = field(default_factory=Bytes)
    loss: Loss = field(default_factory=Loss)
    learners: tuple[Learner, ...] = ()
    events: tuple[Event, ...] = ()
    supervisor: Supervisor | None = None
    data: Ledger | None = None  # the data ledger's progress; None: the run keeps none
    guard: Guard | None = None
    screen: Screen | None = None
    shards: tuple[Shard, ...] | None = None  # one row per syncer shard; None: an older snapshot
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, given: Any) -> Snapshot:
        """The typed snapshot of its JSON; anything not an object reads as all defaults."""
        data: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
        given = {k: kind for k, kind in OPTIONAL.items() if isinstance(data.get(k), Mapping)}
        optional: dict[str, Any] = {k: read_record(kind, data[k]) for k, kind in given.items()}
        shards = records(Shard)(data["shards"]) if isinstance(data.get("shards"), list) else None
        typed = {*SCALARS, *SECTIONS, *LISTS, *optional, *(["shards"] if shards is not None else [])}
        return cls(
            version=opt_int(data.get("version")) or VERSION,
            schema=text(data.get("schema")) or SCHEMA,
            run=text(data.get("run")),
            status=text(data.get("status")),
            now=num(data.get("now")),
            uptime_s=num(data.get("uptime_s")),
            goodput=num(data.get("goodput")),
            goodput_window=num(data.get("goodput_window")),
            insecure=flag(data.get("insecure")),
            **{name: read_record(kind, data.get(name)) for name, kind in SECTIONS.items()},
            learners=records(Learner)(data.get("learners")),
            events=records(Event)(data.get("events")),
            **optional,
            shards=shards,
            extra={k: v for k, v in data.items() if k not in typed},
        )

    def to_json(self) -> dict[str, Any]:
        out = dict(self.extra)
        out.update({name: to_json(getattr(self, name)) for name in (*SCALARS, *SECTIONS, *LISTS)})
        for name in (*OPTIONAL, "shards"):
            if getattr(self, name) is not None:
                out[name] = to_json(getattr(self, name))
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


def as_snapshot(snapshot: Snapshot | Mapping[str, Any]) -> Snapshot:
    """The typed snapshot of one taken already, or of its JSON (`status --json`, a recorded one)."""
    return snapshot if isinstance(snapshot, Snapshot) else Snapshot.from_json(snapshot)


def final_figures(sample: Mapping[str, Any] | None, snap: Snapshot | None) -> Figures | None:
    """Where a run ended (`down`'s summary): the metrics log's newest sample, which the syncer
    writes last as it shuts down (after its final score and checkpoint) and which `runs`,
    `export` and the report read too, so every one says the same number; its learners' losses,
    gone once they stopped, from the syncer's last answer `snap`. Without a sample: that answer;
    None without either."""
    answered = snap.figures if snap is not None else None
    if sample is None:
        return answered
    figures = Figures.from_sample(sample)
    if answered is None:
        return figures
    train = figures.loss.train if figures.loss.train is not None else answered.loss.train
    evaluated = figures.loss.eval if figures.loss.eval is not None else answered.loss.eval
    return replace(figures, loss=replace(figures.loss, train=train, eval=evaluated))
