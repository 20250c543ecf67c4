"""The syncer's state machine: global model, rounds per fragment, learners; no sockets, no files.

`SyncerCore.handle(learner, message, now, out)` and `SyncerCore.tick(now, out)` are the whole
interface: what must be sent, logged as an event or recorded as a metric is put into the
`Outbox`, and the ZeroMQ server (syncer/server.py) carries it out. Wall-clock `now` is passed in,
merges are timed by an injected monotonic clock; merge and outer step: syncer/outerstep.py.

Publishing (ALGORITHM.md, Compression): the new global fragment is defined as
    old + dequantize(quantize(new - old + residual)),   residual' = (new - old + residual) - that
so the syncer holds exactly what every learner reconstructs from the update blob.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from syncer.clock import RoundClock
from syncer.common import memfit
from syncer.common.settings import RunSettings
from syncer.datadesk import DataDesk, unit_ids
from syncer.fleet import Ledger, Membership
from syncer.globalmodel import GlobalModel, Outbox
from syncer.guard import QualityGuard
from syncer.outerstep import OuterStep
from syncer.receipts import PushReceipts
from syncer.rounds import Contribution, GraceFn, Round, drop_oldest, withdraw
from syncer.screening import Screen
from syncer.serving import StateServing
from syncer.upload import InitUpload
from syncer.wire import codec, fragments, shards
from syncer.wire.protocol import Message, ProtocolError, check_fragment_index, check_raw_fragment

__all__ = ["Outbox", "SyncerCore"]  # Outbox too: handle() and tick() take one
# A live learner not in this many rounds in a row (it heartbeats but pushes nothing: it reloads
# after every step, it is still fetching the state) is not waited for until it pushes again: each
# round waited for it until its deadline, and every merge reached the fleet a period late (a
# learner stuck reloading took the final model 4.6% behind, bench/integrity.py bad_nan_rest).
MISSED_ROUNDS = 2


class SyncerCore(OuterStep):
    """Rounds, merges and the global model for one run."""

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
    ) -> None:
        self.s = settings
        self.shard, self.shards = shard  # this process is shard `shard` of `shards` (syncer/wire/shards.py)
        self.owned: tuple[int, ...] = ()  # the global fragments this shard owns, in local order (set with the plan)
        self.kernel = kernel  # syncer.native.Kernel or None (torch round step)
        self.on_merge = on_merge
        self.run_id = run_id
        self.epoch = epoch
        self.clock = clock
        self.fleet = Ledger(declared, settings.liveness_s, now)
        self.model: GlobalModel | None = None
        self.memory_free: tuple[int, str] | None = None  # bytes free here, which limit (the shell: at hellos)
        self.rounds: dict[int, Round] = {}
        self.round_clock = RoundClock(settings.H, settings.fragments)
        self.outer_steps = 0
        self.since_checkpoint = 0
        self.checkpoint_outer_step = 0
        self.t_sync: float | None = None
        self.rejected: collections.Counter[str] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter()
        self.bytes_up = 0
        self.bytes_down = 0
        self.started = now
        self.recent_rounds: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
        self._norm_history: collections.defaultdict[int, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=32)
        )
        self.upload = InitUpload()  # the first upload of the global model, while no model exists
        self.receipts = PushReceipts()  # which pushes the state holds: learners keep the rest (learner/kept.py)
        self.unsettled: list[tuple[int, list[Contribution]]] = []  # rounds closed, not yet in the ledger
        self.serving = StateServing(settings.state_chunk_mb)  # state transfers (joins, rejoins, resyncs)
        self._last_seq: dict[tuple[str, str], int] = {}
        self.membership = Membership()  # learner_lost/back and quorum events
        self.missed: collections.Counter[str] = collections.Counter()  # rounds closed in a row without it
        self._backlogged: set[tuple[str, int]] = set()
        s = settings
        # judges contributions (syncer/screening.py)
        self.screen = Screen(s.judge_size, s.judge_agree, s.quarantine_strikes, s.quarantine_s, s.H)
        self.guard = QualityGuard(settings.quality_guard)  # syncer/quality.py scores and rolls back
        self.scored_at: int | None = None  # outer step of the last snapshot scored (None: score at once)
        self.snapshot_tag = 0
        self.warnings: list[str] = []  # lasting, shown in status (e.g. the run's history was lost)
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
        self.rejected[reason] += 1
        out.event(now, "reject", learner, f"{reason}: {detail}"[:300])

    def _refuse(self, reason: str, learner: str, detail: str, now: float, out: Outbox) -> None:
        """Reject a hello for good: counted, an event, and a fatal error the learner stops on."""
        self.reject(reason, learner, detail, now, out)
        out.send(learner, Message("error", {"reason": detail, "fatal": True}))

    # -- membership --------------------------------------------------------------------------
    def _hello(self, learner: str, msg: Message, now: float, out: Outbox) -> None:
        if msg["run"] != self.run_id:
            self._refuse("wrong_run", learner, f"this syncer serves run {self.run_id}, not {msg['run']}", now, out)
            return
        try:
            manifest = fragments.manifest_from_json(msg["manifest"])
        except ValueError as exc:
            raise ProtocolError("schema", f"hello: {exc}") from None
        problem = self._manifest_problem(manifest, msg["fragments"])
        if problem:
            self._refuse("manifest", learner, problem, now, out)
            return
        info, fresh = self.fleet.hello(msg.meta, now)
        again = self.receipts.again(msg.meta.get("kept"), learner, info.incarnation, self.epoch, self.owned, now, out)
        if refused := self.data.hello(learner, info.incarnation, fresh, msg.meta, now, out, again):
            self._refuse("data_mismatch", learner, refused, now, out)
            return
        out.event(
            now,
            "join" if info.joins == 1 and fresh else ("rejoin" if fresh else "reconnect"),
            learner,
            f"pid {info.pid} on {info.host} ({info.device})",
        )
        for p in withdraw(self.rounds.values(), learner, self.s.quorum, now) if fresh and self.s.lockstep else []:
            out.event(now, "drop", learner, f"fragment {p}: the previous incarnation's unmerged push (lock-step)")
        owner = self._claim_init(learner, manifest, now)
        out.send(
            learner,
            Message(
                "welcome",
                {
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
                },
            ),
        )

    def _manifest_problem(self, manifest: list[fragments.TensorSpec], count: int) -> str | None:
        if count != self.s.fragments:
            return f"learner cuts the model into {count} fragments, the run uses {self.s.fragments}"
        reference = self.model.manifest if self.model else self.upload.manifest
        if reference is not None and manifest != reference:
            return "learner's model has different parameter names/shapes than the run's global model"
        if len(manifest) < count:
            return f"model has {len(manifest)} parameter tensors, fewer than fragments={count}"
        if self.model is None and self.memory_free is not None:  # nothing allocated yet: will it fit here?
            n = sum(shards.shard_plan(manifest, count, self.shard, self.shards).sizes())
            name = f"syncer shard {self.shard}" if self.shards > 1 else "the syncer"
            return memfit.floor_problem(n, *self.memory_free, name)
        return None

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
        if self.model is not None:
            return False
        owner = self.fleet.learners.get(self.upload.owner or "")
        if owner is not None and owner.id != learner and owner.live(now, self.s.liveness_s):
            return False
        self.upload.start(learner, manifest, self.plan_for(manifest).sizes())
        return True

    def _init(self, learner: str, msg: Message, now: float, out: Outbox) -> None:
        up = self.upload
        if self.model is not None or learner != up.owner or up.manifest is None:
            self.reject("init_refused", learner, "not the init owner", now, out)
            return
        values = check_raw_fragment(msg, up.sizes())  # read-only, a view of the received frame
        if up.add(msg["fragment"], msg["offset"], values):
            plan = self.plan_for(up.manifest)
            self.model = GlobalModel.fresh(up.manifest, plan, up.take())
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
        if len(msg.payloads) != 1 or msg["c_steps"] < 1 or msg["c_tokens"] < 0 or msg["c_time"] < 0:
            raise ProtocolError("schema", "push: needs one payload, c_steps >= 1, c_tokens >= 0, c_time >= 0")
        blob = msg.blob()
        try:
            delta = codec.decode_quantized(blob, expect_numel=self.model.theta[p].numel(), kernel=self.kernel)
        except codec.CodecError as exc:
            reason = "nan" if "NaN" in str(exc) or "non-finite" in str(exc) else "codec"
            self.reject(reason, learner, f"fragment {p}: {exc}", now, out)
            out.send(learner, Message("resync", {"fragment": p, "reason": f"push rejected: {exc}"[:200]}))
            return
        problem = self._push_problem(learner, p, msg)
        if problem:
            self.reject(problem[0], learner, problem[1], now, out)
            return
        if msg.get("last") is True and self.fleet.ending:
            self._keep_out(learner, p, int(msg["c_tokens"]), now, out)
            return
        incarnation = self.fleet.learners[learner].incarnation
        units = unit_ids(msg.get("units"), "push")
        contribution = Contribution.of_push(learner, incarnation, delta, msg.meta, now, len(blob), units)
        rnd = self.rounds.setdefault(p, Round(p))
        rnd.add(contribution, self.s.quorum, GraceFn(self.s.grace_gamma, self.s.tau, self.t_sync or 0.0))
        self.data.carried(self.owned[p], contribution)
        self.counters["pushes"] += 1
        self.counters["push_raw_bytes"] += 4 * delta.numel
        self.counters["push_wire_bytes"] += len(blob)
        self._bound_queue(now, out)

    def _keep_out(self, learner: str, p: int, tokens: int, now: float, out: Outbox) -> None:
        """`dldctl down`: a stopping learner's last, partial windows stay out of the final model
        (docs/algorithm.md, "The end of a run"); their tokens count as trained, not merged."""
        if not self.counters[f"kept_out:{learner}"]:  # one event per learner, not per fragment
            out.event(now, "last_windows_kept_out", learner, "its last partial windows at down (not merged)")
        self.counters[f"kept_out:{learner}"] += 1
        self.counters["last_tokens_kept_out"] += tokens

    def _push_problem(self, learner: str, p: int, msg: Message) -> tuple[str, str] | None:
        """Replayed pushes (sequence not increasing within one incarnation) and versions from
        the future are refused: both would move the model with something it never produced."""
        assert self.model is not None
        info = self.fleet.learners[learner]
        key = (info.incarnation, learner)
        if msg["seq"] <= self._last_seq.get(key, -1):
            return "replay", f"push seq {msg['seq']} after {self._last_seq[key]}"
        if msg["epoch"] == self.epoch and msg["base_version"] > self.model.versions[p]:
            return (
                "future_version",
                f"base version {msg['base_version']} > current {self.model.versions[p]} of fragment {p}",
            )
        self._last_seq[key] = msg["seq"]
        return None

    def _bound_queue(self, now: float, out: Outbox) -> None:
        """Keep memory bounded: past max_queue pending contributions, drop the oldest."""
        for learner, p in drop_oldest(self.rounds.values(), self.s.max_queue, self.s.quorum, now):
            self.counters["dropped_pushes"] += 1
            out.event(now, "drop", learner, f"fragment {p}: queue over {self.s.max_queue}")

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
            self._call_rounds(now, live, out)
        waited = {lid for lid in live if self.missed[lid] < MISSED_ROUNDS}
        for p in sorted(self.rounds):
            rnd = self.rounds[p]
            if rnd.contributions and rnd.ready(now, self.s.quorum, waited, called=self.s.syncer_clock):
                for lid in live:  # who is in it: a live learner that pushes nothing is not waited for
                    self.missed[lid] = 0 if lid in rnd.contributions else self.missed[lid] + 1
                self._replace(p, self._close(rnd, now, out))

    def _call_rounds(self, now: float, live: set[str], out: Outbox) -> None:
        """The syncer's round clock (syncer/clock.py): call the rounds that are due, every
        connected learner at once. A fragment whose last call is still below quorum is called
        again, with a fresh window, to those not in it yet: a call can be lost (after a hang the
        learners had new sockets, and every call went to the old ones), and an open round is
        never called again otherwise: after a 20 s SIGSTOP nothing was merged until `down`."""
        assert self.model is not None
        times = [self.fleet.learners[lid].seconds_per_step() for lid in live]
        # the fleet's clock runs over the run's fragments; this shard calls the rounds of its own
        due = [self.owned.index(p) for p in self.round_clock.advance(now, times) if p in self.owned]
        if not due:
            return
        window = self.round_clock.window(self.s.tau, self.s.grace_gamma)
        connected = list(self.fleet.connected(now))
        for p in due:
            rnd = self.rounds.setdefault(p, Round(p))
            recipients = connected
            if rnd.called_at is not None:
                if len(rnd.contributions) >= self.s.quorum:
                    continue  # it closes at its deadline
                recipients = [lid for lid in connected if lid not in rnd.contributions]
                self.counters["recalls"] += 1
            rnd.call(now, window)
            out.broadcast(
                recipients, Message("call", {"fragment": p, "epoch": self.epoch, "version": self.model.versions[p]})
            )
            self.counters["calls"] += 1

    def flush(self, now: float, out: Outbox) -> int:
        """Close every round that holds anything, quorum or not (the run is going down)."""
        if self.model is None:
            return 0
        ready = sorted(p for p, r in self.rounds.items() if r.contributions)
        for p in ready:
            # once: draining carried backlogs here would apply them all at once, the giant step the
            # bound exists to prevent (a 30 s outage's backlog took the final model from 1.87 to 3.34)
            self._close(self.rounds[p], now, out)
        self.rounds.clear()
        return len(ready)

    def settle(self, now: float, out: Outbox) -> None:
        """The rounds closed since the last call into the data ledger and the push receipts. The
        server calls it once their updates have left, before it checkpoints; `handle` and `tick`
        call it first: a round's time never includes this bookkeeping (on gpt-tiny it was 8% of it)."""
        if not self.unsettled:
            return
        t0 = time.thread_time()  # CPU, not wall: right after the updates leave, the learners take the cores
        for p, contribs in self.unsettled:
            self.data.merged(self.owned[p], contribs, now, out)
            self.receipts.settled(p, contribs)
        self.unsettled = []
        self.data.busy_s += time.thread_time() - t0

    def _replace(self, p: int, carried: list[Contribution]) -> None:
        """After a close: fragment p's next round, holding what the close carried over, if anything."""
        del self.rounds[p]
        if carried:
            rnd = self.rounds[p] = Round(p)
            for c in carried:
                rnd.add(c, self.s.quorum, GraceFn(self.s.grace_gamma, self.s.tau, self.t_sync or 0.0))

    def _close(self, rnd: Round, now: float, out: Outbox) -> list[Contribution]:
        """Merge, outer step, publish (bit-exact), broadcast, account; returns the shares of
        capped backlogs carried over to the fragment's next round."""
        assert self.model is not None
        t0 = self.clock()
        p = rnd.fragment
        m = self.model
        contribs, grams = self._screened(p, sorted(rnd.contributions.values(), key=lambda c: c.learner), now, out)
        if not contribs:  # every one rejected: no new version; their units missed this fragment
            self.unsettled.append((p, []))
            return []
        self.serving.keep_previous(m, p, now)
        m.writable(p)  # from here on fragment p is written in place: never a value a send may still read
        if self.on_merge is not None:
            self.on_merge(p)
        carried = self._cap_backlogs(p, contribs, now, out)
        blob, crc = self._step(p, contribs, now, grams, want_crc=(m.versions[p] + 1) % self.s.checksum_every == 0)
        self.serving.crcs[p] = crc  # None: computed only if a state transfer needs it
        m.versions[p] += 1
        recipients = list(self.fleet.connected(now))
        out.broadcast(
            recipients,
            Message(
                "update",
                {
                    "fragment": p,
                    "version": m.versions[p],
                    "from_version": m.versions[p] - 1,
                    "epoch": self.epoch,
                    "contributors": [c.learner for c in contribs],
                    "crc": crc,
                },
                [blob],
            ),
        )
        self.unsettled.append((p, contribs))  # the ledger's part, once the update has left (`settle`)
        weights = [c.weight for c in contribs]
        self._account(rnd, contribs, weights, now, out, blob_bytes=len(blob) * len(recipients), t0=t0)
        return carried

    def drop_caches(self) -> None:
        self.serving.clear()

    def checkpoint_due(self) -> bool:
        return self.model is not None and self.since_checkpoint >= self.s.checkpoint_every


_HANDLERS: dict[str, Callable[[SyncerCore, str, Message, float, Outbox], None]] = {
    "hello": SyncerCore._hello,
    "init": SyncerCore._init,
    "state_req": SyncerCore._state_req,
    "push": SyncerCore._push,
    "heartbeat": SyncerCore._heartbeat,
    "bye": SyncerCore._bye,
}
