"""The learner's link to the syncer as a pure state machine: no socket, no thread, no clock.

`LinkCore` knows everything the link is doing: its phase (closed, joining, up, partitioned),
the replica of the global fragments and the chunked state fetches that fill it, the first
upload when this learner owns the initialization, the pushes it owes (learner/pushqueue.py, a
part of its own: queued, folded, in flight, kept until a syncer checkpoint holds them), heartbeats and the syncer's
liveness (Paranoid Pirate: silence means a fresh socket), and the replies, resyncs and round
calls waiting for the training thread. Its inputs are the time (`now`, injected), the frames
received, and the results of the sends it asked for; what it returns (`LinkOutbox`) says which
messages to send, whether to open or close the socket, and what happened (`LinkEvent`s).

The thin shell, `learner.client.SyncerClient`, owns the DEALER socket in one thread, holds its
lock around every call into this core and notifies the training thread when something changed.
Pushes are encoded by the shell outside that lock (`push_message`), so the trainer is never held
up by a large encode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from learner.kept import KeptPushes
from learner.pushqueue import PushQueue
from learner.replica import Replica
from learner.sends import InitChunk, PushItem, Send
from syncer.common.settings import RunSettings
from syncer.wire import codec, quant
from syncer.wire.protocol import Message, ProtocolError, check_raw_fragment, decode

FETCH_WINDOW = 4  # at least this many state chunks in flight at once
FETCH_BYTES = 32 << 20  # and up to this many bytes of them (bounds what a fetch buffers)
FETCH_MAX = 32  # and never more requests than this (the DEALER's SNDHWM is 64: a request over it is lost)
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 2.0  # between hellos to a syncer that does not answer


class Phase(StrEnum):
    """Where the link is; the one place its state lives."""

    CLOSED = "closed"  # no socket: the next tick opens one
    JOINING = "joining"  # a socket, hellos with backoff, no welcome yet
    UP = "up"  # welcomed: fetch, upload, push, beat
    PARTITIONED = "partitioned"  # chaos: every byte cut, no socket until it is lifted


@dataclass(frozen=True)
class ShardRole:
    """Which shard of the syncer a link talks to (learner/syncerlink.py); the default: the whole syncer."""

    index: int = 0
    shards: int = 1
    owned: tuple[int, ...] = ()  # the global fragments the shard must own, in its order (): all
    fragments: int = 0  # the run's fragments (0: this link's own)


@dataclass(frozen=True)
class Identity:
    """Who this learner is, as its hello says."""

    learner: str
    incarnation: str
    run: str
    pid: int
    host: str
    device: str
    batch_size: int
    manifest: list[list[Any]]  # fragments.manifest_to_json: [[name, shape, kind], ...]
    role: ShardRole = ShardRole()


@dataclass(frozen=True)
class LinkEvent:
    """Something the shell reports or acts on: welcome, ready, resync, refused, bad_message, reconnect."""

    kind: str
    detail: str = ""


@dataclass
class LinkOutbox:
    """What one call into the core wants done, in order: close, open, then the sends."""

    sends: list[Send] = field(default_factory=list)
    events: list[LinkEvent] = field(default_factory=list)
    close: bool = False
    open: bool = False


@dataclass
class LinkCounters:
    """What the link did, for the learner's heartbeat and logs."""

    pushes_sent: int = 0
    updates: int = 0
    refetches: int = 0
    reconnects: int = 0
    bad_messages: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass
class Inbox:
    """What waits for the training thread: replies to its pushes, forced resyncs, round calls."""

    replies: set[int] = field(default_factory=set)
    forced: set[int] = field(default_factory=set)
    calls: set[int] = field(default_factory=set)
    units: list[int] = field(default_factory=list)  # the data ledger: units to train
    drop: list[int] = field(default_factory=list)  # ... and units to give up


def fetch_window(chunk_numel: int) -> int:
    """State chunks a fetch keeps in flight: FETCH_BYTES worth, between FETCH_WINDOW and FETCH_MAX.
    The syncer answers each from a view of its model (no copy), so a full pipe costs it nothing."""
    return max(FETCH_WINDOW, min(FETCH_MAX, FETCH_BYTES // (4 * max(1, chunk_numel))))


class LinkCore:
    """The link's state and rules; every method is called under the shell's lock."""

    def __init__(
        self, me: Identity, sizes: list[int], settings: RunSettings, fault: Callable[[str], None] = lambda _: None
    ) -> None:
        self.me, self.s, self.fault = me, settings, fault
        self.replica = Replica(sizes)
        self.phase = Phase.CLOSED
        self.partitioned = False
        self.ready = False
        self.fatal: str | None = None
        self.restart: str | None = None  # quarantined by the syncer: this process restarts from the global state
        self.hold_until = 0.0  # a restarted quarantined learner trains only from then on (the welcome says)
        self.goodbye_confirmed = False
        self.finished = False  # the budget is spent: the bye says so (the syncer keeps it in the average)
        self.resume_step = 0  # where the syncer says this incarnation's step counter starts
        self.counters = LinkCounters()
        self.inbox = Inbox()
        self.pushes = PushQueue(int(settings.keep_pushes_mb * 2**20))  # queued, sent, kept (learner/pushqueue.py)
        self.stats: dict[str, Any] = {"step": 0, "tokens": 0, "state": "joining"}
        self.chunk = 1 << 20
        self.init_queue: list[tuple[int, int]] = []
        self._hello_at = self._heard_at = self._beat_at = 0.0
        self._backoff = BACKOFF_MIN_S
        self._hello_now = False  # the connection is up: hello without waiting out the backoff

    # -- the shell's inputs --------------------------------------------------------------------
    def opened(self, now: float) -> None:
        """A fresh socket is connected: say hello after the first backoff."""
        self.phase = Phase.JOINING
        self._hello_at = self._heard_at = now
        self._backoff = BACKOFF_MIN_S
        self._hello_now = False

    def connected(self, now: float) -> None:
        """The fresh socket's connection is up (with CURVE, its handshake done): the first hello
        goes at the next tick instead of after the first backoff (a join is 0.1 s shorter)."""
        if self.phase is Phase.JOINING:
            self._hello_now = True

    def tick(self, now: float) -> LinkOutbox:
        """What the time alone asks for: open or close the socket, hello, fetch, upload, push, beat."""
        out = LinkOutbox()
        if self.partitioned:
            out.close = self.phase is not Phase.PARTITIONED
            self._enter(Phase.PARTITIONED)
            return out
        if self.phase in (Phase.CLOSED, Phase.PARTITIONED):
            self._enter(Phase.CLOSED)
            out.open = True
            return out
        if self.phase is Phase.JOINING:
            if self._hello_now or now - self._hello_at > min(BACKOFF_MAX_S, self._backoff):
                self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
                self._hello_at, self._hello_now = now, False
                out.sends.append(Send(self._hello()))
        else:
            self._work(now, out)
        if now - self._heard_at > 3 * self.s.liveness_s and now - self._hello_at > self.s.liveness_s:
            self.counters.reconnects += 1  # Paranoid Pirate: silence means a fresh socket
            out.close = True
            out.events.append(LinkEvent("reconnect", f"no word from the syncer in {now - self._heard_at:.1f} s"))
            self._enter(Phase.CLOSED)
        return out

    def receive(self, now: float, frames: Sequence[Any]) -> LinkOutbox:
        """One message from the syncer (bytes, or zmq.Frames: a state chunk is then read straight
        from its frame); a malformed one is dropped and counted."""
        out = LinkOutbox()
        self.counters.bytes_received += sum(len(f) for f in frames)
        self._heard_at = now
        try:
            self._dispatch(decode(list(frames)), out)
        except (ProtocolError, codec.CodecError) as exc:
            self.counters.bad_messages += 1
            out.events.append(LinkEvent("bad_message", str(exc)))
        return out

    def sent(self, send: Send, nbytes: int, blob: bytes | None = None) -> None:
        """The shell handed `send` to the socket (a push: with its payload, `blob`, kept)."""
        self.counters.bytes_sent += nbytes
        if send.push is not None:
            self.counters.pushes_sent += 1
            self.pushes.sent(send, blob)
        elif send.init is not None and self.init_queue[:1] == [(send.init.fragment, send.init.offset)]:
            self.init_queue.pop(0)

    def unsent(self, send: Send) -> None:
        """`send` could not leave (no connection): a push goes back to the queue, folded with any
        newer one of its fragment; an upload chunk stays queued; anything else is dropped."""
        if send.push is not None:
            self.pushes.unsent(send)

    def encode_failed(self, send: Send, exc: Exception) -> LinkEvent:
        """A message that could not be encoded (a bug): dropped and counted, and the link goes on."""
        self.counters.bad_messages += 1
        if send.push is not None:
            self.pushes.dropped()
        return LinkEvent("bad_message", f"could not encode {send.msg.kind if send.msg else 'a push'}: {exc}")

    def goodbye(self) -> Send | None:
        """The bye to send at exit, if the syncer can hear it."""
        if self.phase is not Phase.UP or self.partitioned:
            return None
        if self.finished:
            return Send(Message("bye", {"reason": "learner finished its budget", "finished": True}))
        return Send(Message("bye", {"reason": "learner stopping"}))

    # -- the training thread's inputs (through the shell, under its lock) ----------------------
    def push(self, item: PushItem) -> None:
        """Queue an outer gradient; an unsent one of the same fragment is folded in (`coalesce`)."""
        self.pushes.push(item)

    def take_updates(self) -> tuple[set[int], set[int]]:
        """(fragments with a reply to our push, fragments the syncer wants overwritten).

        A reply is an update whose round merged this learner's push (it is in the update's
        contributors), or a fetched state (after a gap; who it merged is not known). An update of
        a round without our push is kept in the replica but is no reply: applying it would drop
        the pushed work, still in flight, from the model until the next reply."""
        replies, forced = self.inbox.replies, self.inbox.forced
        self.inbox.replies, self.inbox.forced = set(), set()
        return replies, forced

    def take_calls(self) -> set[int]:
        """Fragments whose round the syncer called since the last take: push them now."""
        calls, self.inbox.calls = self.inbox.calls, set()
        return calls

    def has_reply(self, p: int) -> bool:
        return p in self.inbox.replies or p in self.inbox.forced

    def linked(self) -> bool:
        """Whether the syncer is reachable now (welcomed, not cut off by a chaos partition)."""
        return self.phase is Phase.UP and not self.partitioned

    def pending(self) -> int:
        """Pushes not yet handed to the socket (queued, going again, or being sent)."""
        return self.pushes.pending()

    # the push queue's fields under the names the link's tests and benchmarks read
    @property
    def queue(self) -> dict[int, PushItem]:
        return self.pushes.queue

    @property
    def again(self) -> list[PushItem]:
        return self.pushes.again

    @property
    def kept(self) -> KeptPushes:
        return self.pushes.kept

    # -- timers --------------------------------------------------------------------------------
    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        if phase in (Phase.UP, Phase.PARTITIONED):
            self.stats["link"] = phase.value

    def _work(self, now: float, out: LinkOutbox) -> None:
        out.sends.extend(Send(init=c) for c in self._init_chunks())
        for p, offset, version in self.replica.requests(now, self.chunk, fetch_window(self.chunk)):
            out.sends.append(Send(Message("state_req", {"fragment": p, "offset": offset, "version": version})))
        if self.ready and self._hears_syncer(now):
            out.sends.extend(self.pushes.take())
        if now - self._beat_at >= self.s.heartbeat_s:
            self._beat_at = now
            out.sends.append(Send(Message("heartbeat", self._heartbeat_meta(now))))

    def _hears_syncer(self, now: float) -> bool:
        """Whether the syncer answered recently (its acks come every heartbeat). Pushes sent into
        a silent syncer (hung, SIGSTOPped) wait in libzmq and are lost with the socket when the
        link gives up on it: after a 20 s hang only 0.36 of the trained tokens were merged. While
        it is silent they stay queued here, folded per fragment, and go out once it answers."""
        return now - self._heard_at <= max(1.0, 4 * self.s.heartbeat_s)

    def _init_chunks(self) -> list[InitChunk]:
        return [
            InitChunk(p, off, min(self.chunk, self.replica.sizes[p] - off), self.replica.sizes[p])
            for p, off in self.init_queue
        ]

    def _heartbeat_meta(self, now: float) -> dict[str, Any]:
        meta = dict(self.stats)
        meta.update(
            sent_at=now,  # the syncer measures this learner's step rate on its clock
            versions=list(self.replica.versions),
            crcs=list(self.replica.crcs),
            crc_mismatches=self.replica.mismatches,
            bytes_sent=self.counters.bytes_sent,
            bytes_received=self.counters.bytes_received,
            pending_pushes=len(self.pushes.queue),
            link="up",
        )
        return meta

    def _hello(self) -> Message:
        me = self.me
        meta = {
            "learner": me.learner,
            "incarnation": me.incarnation,
            "run": me.run,
            "pid": me.pid,
            "host": me.host,
            "device": me.device,
            "batch_size": me.batch_size,
            "codecs": list(quant.MODES),
            "manifest": me.manifest,
            "fragments": me.role.fragments or self.replica.count,
        }
        if self.stats.get("data"):  # the dataset and the units in hand (syncer/datadesk.py)
            meta["data"] = self.stats["data"]
        if kept := self.pushes.hello():  # a restarted syncer gets these again (learner/kept.py)
            meta["kept"] = kept
        return Message("hello", meta)

    def _shard_problem(self, msg: Message) -> str | None:
        """Why this syncer (shard) is not the one this link expects: another number of shards,
        or other fragments than the map this learner computed (syncer/wire/shards.py)."""
        role = self.me.role
        expected = list(role.owned or range(self.replica.count))
        shards, owned = msg.get("shards", 1), msg.get("owned", expected)
        if shards == role.shards and owned == expected:
            return None
        return (
            f"the syncer at this address is shard {msg.get('shard', 0)} of {shards} owning fragments {owned}; "
            f"this learner expected {role.shards} shard(s) and fragments {expected}: "
            "the learners' and the syncer's config.json differ (restart the run with `dldctl up`)"
        )

    # -- messages ------------------------------------------------------------------------------
    def _dispatch(self, msg: Message, out: LinkOutbox) -> None:
        handler = {
            "welcome": self._on_welcome,
            "ack": self._on_ack,
            "state": self._on_state,
            "update": self._on_update,
            "resync": self._on_resync,
            "error": self._on_error,
            "call": self._on_call,
            "units": self._on_units,
            "quarantine": self._on_quarantine,
            "bye": self._on_bye,
        }.get(msg.kind)
        if handler is None:
            raise ProtocolError("unexpected_kind", f"syncer sent {msg.kind!r}")
        handler(msg, out)

    def _on_welcome(self, msg: Message, out: LinkOutbox) -> None:
        problem = self._shard_problem(msg)
        if problem:
            self.fatal = problem
            out.events.append(LinkEvent("refused", problem))
            return
        self._enter(Phase.UP)
        self._backoff = BACKOFF_MIN_S
        self.chunk = max(1024, int(msg["chunk_numel"]))
        self.resume_step = max(0, int(msg["step"]))
        self.hold_until = self._heard_at + max(0.0, float(msg.get("quarantine_s") or 0.0))
        if again := self.pushes.welcome(int(msg["epoch"]), msg.get("covered")):
            out.events.append(LinkEvent("resend", f"{again} pushes the restarted syncer's checkpoint lacks"))
        self._sync_epoch(msg["epoch"], msg["initialized"], msg["versions"])
        if msg["init_owner"] and not msg["initialized"]:
            sizes = self.replica.sizes
            self.init_queue = [(p, off) for p in range(self.replica.count) for off in range(0, sizes[p], self.chunk)]
        out.events.append(LinkEvent("welcome", f"syncer epoch {msg['epoch']}"))

    def _on_ack(self, msg: Message, out: LinkOutbox) -> None:
        if "saved" in msg.meta:
            self.pushes.saved(msg["epoch"], msg["saved"])
        self._sync_epoch(msg["epoch"], msg["initialized"], msg["versions"])

    def _sync_epoch(self, epoch: int, initialized: bool, versions: list[Any]) -> None:  # JSON: int() below
        """A new syncer epoch (it restarted) means our replica may be ahead or behind: refetch."""
        if not initialized:
            return
        if epoch != self.replica.epoch:
            self.replica.epoch = epoch
            self.replica.refetch_all()
            self.counters.refetches += self.replica.count
            return
        for p in self.replica.behind([int(v) for v in versions]):
            self.replica.refetch(p)
            self.counters.refetches += 1

    def _on_state(self, msg: Message, out: LinkOutbox) -> None:
        if msg["epoch"] != self.replica.epoch:
            return
        self.fault("fetch")
        values = check_raw_fragment(msg, self.replica.sizes)
        if self.replica.on_state(msg["fragment"], msg["version"], msg["offset"], values, msg.get("crc")):
            self.inbox.replies.add(msg["fragment"])
            if self.replica.complete() and not self.ready:
                self.ready = True
                out.events.append(LinkEvent("ready", f"versions {self.replica.versions}"))

    def _on_update(self, msg: Message, out: LinkOutbox) -> None:
        p = msg["fragment"]
        if msg["epoch"] != self.replica.epoch or not 0 <= p < self.replica.count or len(msg.payloads) != 1:
            return
        result = self.replica.on_update(p, msg["from_version"], msg["version"], msg.blob(), msg.get("crc"))
        if result == "applied":
            if self.me.learner in msg["contributors"]:
                self.inbox.replies.add(p)
            self.counters.updates += 1
        elif result in ("gap", "mismatch"):
            self.counters.refetches += 1

    def _on_call(self, msg: Message, out: LinkOutbox) -> None:
        p = msg["fragment"]
        if msg["epoch"] == self.replica.epoch and 0 <= p < self.replica.count and self.ready:
            self.inbox.calls.add(p)

    def _on_units(self, msg: Message, out: LinkOutbox) -> None:
        ids = [u for u in msg["units"] + msg["drop"] if isinstance(u, int) and not isinstance(u, bool) and u >= 0]
        if len(ids) == len(msg["units"]) + len(msg["drop"]):  # anything else: dropped whole
            self.inbox.units += msg["units"]
            self.inbox.drop += msg["drop"]

    def queued_units(self) -> dict[int, tuple[int, ...]]:
        """The work units named by pushes still waiting to leave, per fragment (PushQueue.queued_units)."""
        return self.pushes.queued_units()

    def take_units(self) -> tuple[list[int], list[int]]:
        """(work units handed to this learner, units to give up) since the last take."""
        taken = self.inbox.units, self.inbox.drop
        self.inbox.units, self.inbox.drop = [], []
        return taken

    def _on_resync(self, msg: Message, out: LinkOutbox) -> None:
        p = msg["fragment"]
        targets = range(self.replica.count) if p < 0 else [p] if p < self.replica.count else []
        for q in targets:
            self.inbox.forced.add(q)
            self.replica.refetch(q)
        out.events.append(LinkEvent("resync", f"syncer asked for a resync of fragment {p}: {msg['reason']}"))

    def _on_error(self, msg: Message, out: LinkOutbox) -> None:
        if msg["fatal"]:
            self.fatal = str(msg["reason"])
            out.events.append(LinkEvent("refused", self.fatal))
        elif "hello" in str(msg["reason"]):
            self.phase = Phase.JOINING
            self._hello_at = 0.0  # the syncer restarted and does not know us: hello at once

    def _on_quarantine(self, msg: Message, out: LinkOutbox) -> None:
        """The syncer's screen shut this learner out (syncer/screening.py): its state is wrong."""
        self.restart = f"quarantined by the syncer for {float(msg['seconds']):.0f} s: {msg['reason']}"
        out.events.append(LinkEvent("quarantined", self.restart))

    def _on_bye(self, msg: Message, out: LinkOutbox) -> None:
        self.goodbye_confirmed = True  # the receipt: our bye, and every push before it, arrived
