"""The syncer's state machine: global model, rounds per fragment, learners; no sockets, no files.

`SyncerCore.handle(learner, message, now, out)` and `SyncerCore.tick(now, out)` are the whole
interface: what must be sent, logged as an event or recorded as a metric is put into the
`Outbox`, and the ZeroMQ server (syncer/server.py) carries it out. Wall-clock `now` is passed in,
merges are timed by an injected monotonic clock.

The core holds what every part reads (the settings, the run's epoch and shard, the global model,
the fleet) and composes the parts, each owning its own state and tested alone:
  admission    syncer/admission.py   hello checks (run, manifest, memory) and the init upload
  serving      syncer/serving.py     state transfers to learners that fetch, with their caches
  pushes       syncer/pushcheck.py   whether a push may enter a round (schema, values, replays)
  book         syncer/roundbook.py   open rounds, their calls, which close, the queue bound
  outer        syncer/outerstep.py   how a closing round becomes the fragment's next version
  acct         syncer/accounting.py  outer steps, checkpoints due, rejections, bytes, round records
and the older ones: fleet (syncer/fleet.py), screen (syncer/screening.py), guard, data
(syncer/datadesk.py), receipts (syncer/receipts.py), membership. The core dispatches messages
and orders a close; the names it keeps for its parts' fields (`outer_steps`, `rounds`, ...) read
and write the part's own (`_Part`), for the checkpoint, the status and the tests.

Publishing (ALGORITHM.md, Compression): the new global fragment is defined as
    old + dequantize(quantize(new - old + residual)),   residual' = (new - old + residual) - that
so the syncer holds exactly what every learner reconstructs from the update blob.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from syncer.accounting import Accounting, ClosedRound
from syncer.admission import Admission
from syncer.clock import RoundClock
from syncer.common.settings import RunSettings
from syncer.datadesk import DataDesk, unit_ids
from syncer.fleet import Ledger, Membership
from syncer.globalmodel import GlobalModel, Outbox
from syncer.guard import QualityGuard
from syncer.outerstep import OuterStep
from syncer.pushcheck import PushChecks
from syncer.receipts import PushReceipts
from syncer.roundbook import MISSED_ROUNDS, RoundBook
from syncer.rounds import Contribution, Round
from syncer.screening import Screen
from syncer.serving import StateServing
from syncer.upload import InitUpload
from syncer.wire import fragments, shards
from syncer.wire.protocol import Message, ProtocolError, check_fragment_index

__all__ = ["MISSED_ROUNDS", "Outbox", "SyncerCore"]  # Outbox too: handle() and tick() take one
T = TypeVar("T")


class _Part(Generic[T]):
    """A core name for a field one of its parts owns: reads and writes go to the part's field."""

    def __init__(self, part: str, field: str | None = None) -> None:
        self.part, self.field = part, field or ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = self.field or name

    def __get__(self, core: Any, owner: type | None = None) -> T:
        return getattr(getattr(core, self.part), self.field)  # type: ignore[no-any-return]

    def __set__(self, core: Any, value: T) -> None:
        setattr(getattr(core, self.part), self.field, value)


class SyncerCore:
    """Rounds, merges and the global model for one run: the parts composed, messages dispatched."""

    run_id: _Part[str] = _Part("admission")
    memory_free: _Part[tuple[int, str] | None] = _Part("admission")
    upload: _Part[InitUpload] = _Part("admission")
    rounds: _Part[dict[int, Round]] = _Part("book")
    round_clock: _Part[RoundClock] = _Part("book")
    missed: _Part[collections.Counter[str]] = _Part("book")
    _norm_history: _Part[collections.defaultdict[int, collections.deque[float]]] = _Part("outer", "norm_history")
    outer_steps: _Part[int] = _Part("acct")
    since_checkpoint: _Part[int] = _Part("acct")
    checkpoint_outer_step: _Part[int] = _Part("acct")
    t_sync: _Part[float | None] = _Part("acct")
    rejected: _Part[collections.Counter[str]] = _Part("acct")
    counters: _Part[collections.Counter[str]] = _Part("acct")
    bytes_up: _Part[int] = _Part("acct")
    bytes_down: _Part[int] = _Part("acct")
    recent_rounds: _Part[collections.deque[dict[str, Any]]] = _Part("acct")
    started: _Part[float] = _Part("acct")

    def __init__(
        self,
        settings: RunSettings,
        run_id: str,
        declared: list[str],
        now: float,
        epoch: int = 1,
        clock: Callable[[], float] = time.perf_counter,
        on_merge: Callable[[int], None] | None = None,
        kernel: Any = None,
        shard: tuple[int, int] = (0, 1),
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        s = self.s = settings
        self.shard, self.shards = shard  # this process is shard `shard` of `shards` (syncer/wire/shards.py)
        self.owned: tuple[int, ...] = ()  # the global fragments this shard owns, in local order (set with the plan)
        self.kernel = kernel  # syncer.native.Kernel or None (torch round step)
        self.on_merge = on_merge
        self.epoch = epoch
        self.clock = clock  # times a merge (monotonic)
        self.cpu_clock = cpu_clock  # times the ledger's bookkeeping (CPU, not wall: `settle`)
        self.fleet = Ledger(declared, settings.liveness_s, now)
        self.model: GlobalModel | None = None
        self.warnings: list[str] = []  # lasting, shown in status (e.g. the run's history was lost)
        self.acct = Accounting(now)
        self.admission = Admission(run_id, settings.fragments, settings.compression)
        self.serving = StateServing(settings.state_chunk_mb)  # state transfers (joins, rejoins, resyncs)
        self.pushes = PushChecks(self.acct.counters)
        self.book = RoundBook(settings, self.acct.counters)
        # judges contributions (syncer/screening.py)
        self.screen = Screen(s.judge_size, s.judge_agree, s.quarantine_strikes, s.quarantine_s, s.H)
        self.outer = OuterStep(settings, self.fleet, self.book.round_clock, self.screen, self.acct.counters)
        self.receipts = PushReceipts()  # which pushes the state holds: learners keep the rest (learner/kept.py)
        self.membership = Membership()  # learner_lost/back and quorum events
        self.guard = QualityGuard(settings.quality_guard)  # syncer/quality.py scores and rolls back
        self.scored_at: int | None = None  # outer step of the last snapshot scored (None: score at once)
        self.snapshot_tag = 0
        self.data = DataDesk(on=settings.data_order == "ledger" and self.shard == 0)  # the data cursor (shard 0's)

    # -- dispatch ----------------------------------------------------------------------------
    def handle(self, learner: str, msg: Message, now: float, out: Outbox) -> None:
        """Apply one decoded message from `learner` (already authenticated as that id)."""
        self.settle(now, out)  # a push must find the ledger as its rounds left it
        handler = _HANDLERS.get(msg.kind)
        if handler is None:
            raise ProtocolError("unexpected_kind", f"a learner may not send {msg.kind!r}")
        if msg.kind != "hello" and learner not in self.fleet.learners:
            out.send(learner, Message("error", {"reason": "say hello first", "fatal": False}))
            return
        self.fleet.seen(learner, now)
        handler(self, learner, msg, now, out)

    def reject(self, reason: str, learner: str, detail: str, now: float, out: Outbox) -> None:
        """Count a rejected message and record it as an event."""
        self.acct.reject(reason, learner, detail, now, out)

    def _refuse(self, reason: str, learner: str, detail: str, now: float, out: Outbox) -> None:
        """Reject a hello for good: counted, an event, and a fatal error the learner stops on."""
        self.reject(reason, learner, detail, now, out)
        out.send(learner, Message("error", {"reason": detail, "fatal": True}))

    # -- membership --------------------------------------------------------------------------
    def _hello(self, learner: str, msg: Message, now: float, out: Outbox) -> None:
        manifest, refused = self.admission.check(msg, self.model, self.shard, self.shards)
        if refused:
            self._refuse(refused[0], learner, refused[1], now, out)
            return
        info, fresh = self.fleet.hello(msg.meta, now)
        again = self.receipts.again(msg.meta.get("kept"), learner, info.incarnation, self.epoch, self.owned, now, out)
        if refusal := self.data.hello(learner, info.incarnation, fresh, msg.meta, now, out, again):
            self._refuse("data_mismatch", learner, refusal, now, out)
            return
        out.event(
            now,
            "join" if info.joins == 1 and fresh else ("rejoin" if fresh else "reconnect"),
            learner,
            f"pid {info.pid} on {info.host} ({info.device})",
        )
        if fresh and self.s.lockstep:
            self.book.withdraw(learner, now, out)
        owner = self._claim_init(learner, manifest, now)
        welcome = {
            "epoch": self.epoch,
            "initialized": self.model is not None,
            "init_owner": owner,
            "versions": self.versions(),
            "chunk_numel": self.chunk_numel(),
            "step": info.step,
            "covered": self.receipts.covered(learner, info.incarnation),  # above: sent again (restarted)
            "quarantine_s": self.screen.quarantine.remaining(learner, now),  # wait it out first
            "shard": self.shard,
            "shards": self.shards,
            "owned": list(self.owned or self._owned_of(manifest)),
        }
        out.send(learner, Message("welcome", welcome))

    def _owned_of(self, manifest: list[fragments.TensorSpec]) -> tuple[int, ...]:
        """The global fragments this shard owns for a model of `manifest` (all of them unsharded)."""
        full = fragments.plan(manifest, self.s.fragments)
        return shards.assign(full.sizes(), self.shards).owned(self.shard)

    def plan_for(self, manifest: list[fragments.TensorSpec]) -> fragments.FragmentPlan:
        """This shard's fragment plan (the run's plan unsharded) and the fragments it owns."""
        self.owned = self._owned_of(manifest)
        self.data.ledger.fragments = self.owned
        return shards.shard_plan(manifest, self.s.fragments, self.shard, self.shards)

    def _claim_init(self, learner: str, manifest: list[fragments.TensorSpec], now: float) -> bool:
        """The first learner to arrive (or the next, if the first went away) uploads the init."""
        if self.model is not None or not self.admission.may_upload(learner, self.fleet, self.s.liveness_s, now):
            return False
        self.admission.start_upload(learner, manifest, self.plan_for(manifest).sizes())
        return True

    def _init(self, learner: str, msg: Message, now: float, out: Outbox) -> None:
        done = self.admission.chunk(learner, msg, self.model)
        if done is None:
            self.reject("init_refused", learner, "not the init owner", now, out)
        elif done:
            manifest, values = self.admission.take()
            plan = self.plan_for(manifest)
            self.model = GlobalModel.fresh(manifest, plan, values)
            out.event(
                now,
                "initialized",
                "syncer",
                f"{self.model.numel} parameters from {learner}, "
                f"{plan.count} fragments, imbalance {plan.imbalance():.3f}",
            )
            self._broadcast_ack(now, out)

    def _bye(self, learner: str, msg: Message, now: float, out: Outbox) -> None:
        self.fleet.leave(learner, finished=msg.meta.get("finished") is True)
        self.data.left(learner, now, out)
        out.event(now, "leave", learner, str(msg["reason"])[:200])
        out.send(learner, Message("bye", {"reason": "receipt"}))  # lets the learner close with LINGER 0

    def _heartbeat(self, learner: str, msg: Message, now: float, out: Outbox) -> None:
        self.fleet.heartbeat(learner, msg.meta, now)
        saved = self.receipts.covered(learner, self.fleet.learners[learner].incarnation, saved=True)
        out.send(learner, self._ack(saved))
        self.data.heartbeat(learner, self.fleet.learners[learner].incarnation, msg.meta, now, out)

    def _ack(self, saved: list[list[int]] | None = None) -> Message:
        """The epoch and versions (`saved`: this learner's pushes the newest checkpoint holds)."""
        meta = {"epoch": self.epoch, "versions": self.versions(), "initialized": self.model is not None}
        return Message("ack", meta if saved is None else {**meta, "saved": saved})

    def _broadcast_ack(self, now: float, out: Outbox) -> None:
        out.broadcast(list(self.fleet.connected(now)), self._ack())

    # -- state transfer ----------------------------------------------------------------------
    def chunk_numel(self) -> int:
        return self.serving.chunk_numel

    def crcs(self) -> list[int | None]:
        return self.serving.known(self.model)

    def versions(self) -> list[int]:
        return list(self.model.versions) if self.model else []

    def _state_req(self, learner: str, msg: Message, now: float, out: Outbox) -> None:
        if self.model is None:
            out.send(learner, Message("error", {"reason": "not initialized yet", "fatal": False}))
            return
        out.send(learner, self.serving.chunk(self.model, learner, msg, now, self.epoch))
        self.counters["state_chunks"] += 1

    # -- contributions -----------------------------------------------------------------------
    def _push(self, learner: str, msg: Message, now: float, out: Outbox) -> None:
        if self.model is None:
            self.rejected["not_initialized"] += 1
            return
        p = check_fragment_index(msg, self.model.plan.count)
        if self.screen.refuses(learner, now):
            return  # quarantined: counted (syncer/screening.py)
        self.pushes.check_schema(msg)
        delta, damaged = self.pushes.decode(msg, p, self.model, self.kernel)
        if damaged:
            self.reject(damaged[0], learner, f"fragment {p}: {damaged[1]}", now, out)
            out.send(learner, Message("resync", {"fragment": p, "reason": f"push rejected: {damaged[1]}"[:200]}))
            return
        incarnation = self.fleet.learners[learner].incarnation
        problem = self.pushes.problem(learner, incarnation, p, msg, self.epoch, self.model.versions[p])
        if problem:
            self.reject(problem[0], learner, problem[1], now, out)
            return
        if msg.get("last") is True and self.fleet.ending:
            self.pushes.keep_out(learner, int(msg["c_tokens"]), now, out)
            return
        units = unit_ids(msg.get("units"), "push")
        nbytes = len(msg.blob())
        contribution = Contribution.of_push(learner, incarnation, delta, msg.meta, now, nbytes, units)
        self.book.add(contribution, p, self.t_sync)
        self.data.carried(self.owned[p], contribution)
        self.counters["pushes"] += 1
        self.counters["push_raw_bytes"] += 4 * delta.numel
        self.counters["push_wire_bytes"] += nbytes
        self.book.bound(now, out)

    # -- rounds ------------------------------------------------------------------------------
    def tick(self, now: float, out: Outbox) -> None:
        """Advance time: accounting, quorum events, and close every round that is ready."""
        self.settle(now, out)
        self.fleet.tick(now)
        self.screen.released(now, out)
        live = self.fleet.live(now) - self.screen.shut_out(now)
        self.membership.events(self.fleet, live, self.s.quorum, now, out)
        self.data.tick(live, now, out)
        if self.model is None:
            return
        if self.s.syncer_clock:
            self.book.call(live, self.model, self.epoch, self.owned, self.fleet, now, out)
        for rnd in self.book.ready(now, live):
            self.book.replace(rnd.fragment, self._close(rnd, now, out), self.t_sync)

    def flush(self, now: float, out: Outbox) -> int:
        """Close every round that holds anything, quorum or not (the run is going down)."""
        if self.model is None:
            return 0
        ready = self.book.flush()
        for rnd in ready:
            # once: draining carried backlogs here would apply them all at once, the giant step the
            # bound exists to prevent (a 30 s outage's backlog took the final model from 1.87 to 3.34)
            self._close(rnd, now, out)
        return len(ready)

    def settle(self, now: float, out: Outbox) -> None:
        """The rounds closed since the last call into the data ledger and the push receipts. The
        server calls it once their updates have left, before it checkpoints; `handle` and `tick`
        call it first: a round's time never includes this bookkeeping (on gpt-tiny it was 8% of it)."""
        if not self.book.unsettled:
            return
        t0 = self.cpu_clock()  # CPU, not wall: right after the updates leave, the learners take the cores
        for p, contribs in self.book.take_unsettled():
            self.data.merged(self.owned[p], contribs, now, out)
            self.receipts.settled(p, contribs)
        self.data.busy_s += self.cpu_clock() - t0

    def _close(self, rnd: Round, now: float, out: Outbox) -> list[Contribution]:
        """Screen, merge, outer step, publish (bit-exact), broadcast, account; returns the shares
        of capped backlogs carried over to the fragment's next round."""
        m = self.model
        assert m is not None  # only a round of an initialized model closes
        t0 = self.clock()
        p = rnd.fragment
        ranked = sorted(rnd.contributions.values(), key=lambda c: c.learner)
        contribs, grams = self.outer.screened(p, ranked, m, self.kernel, now, out)
        if not contribs:  # every one rejected: no new version; their units missed this fragment
            self.book.closed(p, [])
            return []
        self.serving.keep_previous(m, p, now)
        m.writable(p)  # from here on fragment p is written in place: never a value a send may still read
        if self.on_merge is not None:
            self.on_merge(p)
        carried = self.outer.cap_backlogs(p, contribs, now, out)
        want_crc = (m.versions[p] + 1) % self.s.checksum_every == 0
        step = self.outer.step(p, contribs, m, self.kernel, now, grams, want_crc)
        self.serving.crcs[p] = step.crc  # None: computed only if a state transfer needs it
        m.versions[p] += 1
        recipients = list(self.fleet.connected(now))
        update = {
            "fragment": p,
            "version": m.versions[p],
            "from_version": m.versions[p] - 1,
            "epoch": self.epoch,
            "contributors": [c.learner for c in contribs],
            "crc": step.crc,
        }
        out.broadcast(recipients, Message("update", update, [step.blob]))
        self.book.closed(p, contribs)  # the ledger's part, once the update has left (`settle`)
        bytes_out = len(step.blob) * len(recipients)
        closed = ClosedRound(
            rnd, contribs, m.versions[p], m.plan.count, bytes_out, self.clock() - t0, step.share, self.screen.last
        )
        self.acct.round_closed(closed, self.fleet, self.s.quorum, now, out)
        return carried

    def drop_caches(self) -> None:
        self.serving.clear()

    def checkpoint_due(self) -> bool:
        return self.model is not None and self.acct.checkpoint_due(self.s.checkpoint_every)


_HANDLERS: dict[str, Callable[[SyncerCore, str, Message, float, Outbox], None]] = {
    "hello": SyncerCore._hello,
    "init": SyncerCore._init,
    "state_req": SyncerCore._state_req,
    "push": SyncerCore._push,
    "heartbeat": SyncerCore._heartbeat,
    "bye": SyncerCore._bye,
}
