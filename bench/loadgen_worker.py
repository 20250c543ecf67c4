"""Synthetic learners for bench/loadgen.py: one worker process drives many over real sockets.

Each synthetic learner is the real learner's link (`learner.link.LinkCore`: hello with backoff,
welcome, the first upload when it owns the initialization, chunked state fetches, heartbeats,
the push queue, Paranoid Pirate reconnects, round calls) behind its own DEALER socket with its
own CURVE key, exactly as `learner.client.SyncerClient` drives it, minus the model:

- the replica (`LeanReplica`) keeps versions, not values: fetched state chunks are checked and
  dropped, update blobs are decoded (`decode = "all"`, or on one learner per worker: "one") and
  dropped, so a worker holds no model copy per learner;
- "training" is a step counter that advances every `step_time` seconds (each learner at its own
  phase); at each step boundary the learner pushes the fragments the syncer called (round_clock
  = "syncer", the default) or those its own schedule makes due, with the counters since its last
  push of that fragment, exactly like learner/trainer.py;
- a push carries one of a few outer gradients encoded once by the parent (int4 + zstd blobs of
  realistic statistics), so the worker spends its time on the protocol, not on encoding.

Every learner records each reply to its pushes (`loadgen_core.Reply`). The parent drives the
worker through a pipe: ("set", n) runs learners 0..n-1 of those this worker owns (the others say
bye), ("report",) answers with every learner's state and the replies since the last report,
("quit",) ends it.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from bench.loadgen_core import Schedule
from learner.link import Identity, LinkCore, PushItem, Send, push_meta
from learner.replica import Fetch, Replica
from syncer.common import keys
from syncer.common.settings import RunSettings
from syncer.wire import codec
from syncer.wire.protocol import Message, encode

POLL_MS = 20  # like learner/client.py
EMPTY = torch.empty(0)  # the replica keeps no values; a push's delta travels as a pre-encoded blob


@dataclass(frozen=True)
class Shard:
    """A syncer and the fragments it owns (today one syncer owns them all)."""

    address: str
    fragments: tuple[int, ...]


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to run its learners (picklable: it crosses a spawn)."""

    worker: int
    procs: int
    shards: tuple[Shard, ...]
    keys_dir: str | None  # None: an insecure run (no CURVE)
    run_id: str
    settings: dict[str, Any]
    manifest: list[list[Any]]  # fragments.manifest_to_json
    sizes: list[int]
    blobs: dict[int, list[str]]  # fragment -> files of encoded outer gradients
    step_time: float
    decode: str  # all | one | none
    seed: int = 0


def one_shard(shards: tuple[Shard, ...], fragments: int) -> Shard:
    """The syncer every learner talks to. Sharded syncers need a protocol that says which shard
    serves which fragment (a hello per shard, state and rounds per shard): not there yet, so a
    list of shards is accepted only when one of them owns every fragment."""
    if len(shards) != 1 or sorted(shards[0].fragments) != list(range(fragments)):
        raise NotImplementedError("one syncer owning every fragment: the protocol has no sharded syncers yet")
    return shards[0]


class LeanReplica(Replica):
    """A replica that tracks versions only: state chunks and update blobs are taken in, checked
    (chunks by the link, blobs by decoding them where `decode`), counted and dropped."""

    def __init__(self, sizes: list[int], decode: bool) -> None:
        super().__init__(sizes)
        self.decode = decode
        self.decoded = 0
        self.applied: list[tuple[int, int]] = []  # (fragment, version) applied since the shell last looked

    def on_state(self, p: int, version: int, offset: int, values: np.ndarray, crc: int | None = None) -> bool:
        f = self.fetches.get(p)
        if f is None or offset not in f.in_flight:
            return False
        if f.version is None:
            f.version, f.crc = version, crc
        elif version != f.version:
            self.fetches[p] = Fetch(pending=f.pending)
            return False
        del f.in_flight[offset]
        f.received += values.size
        if f.received < self.sizes[p]:
            return False
        assert f.version is not None
        self.latest[p], self.versions[p], self.crcs[p] = EMPTY, f.version, f.crc
        del self.fetches[p]
        for from_version, v, blob, c in sorted(f.pending, key=lambda u: u[1]):
            if self.on_update(p, from_version, v, blob, c) in ("gap", "mismatch"):
                break
        return True

    def on_update(self, p: int, from_version: int, version: int, blob: bytes, crc: int | None = None) -> str:
        if p in self.fetches:
            pending = self.fetches[p].pending
            pending.append((from_version, version, blob, crc))
            del pending[:-64]
            return "buffered"
        if self.latest[p] is None or version <= self.versions[p]:
            return "stale"
        if from_version != self.versions[p]:
            self.refetch(p)
            return "gap"
        if self.decode:
            codec.decode(blob, expect_numel=self.sizes[p])  # what a learner pays before its add
            self.decoded += 1
        self.versions[p], self.crcs[p] = version, crc
        self.applied.append((p, version))
        return "applied"


@dataclass
class Outstanding:
    """A push that left and has no reply yet."""

    pushed_at: float  # wall clock
    missed: int = 0


class SimLearner:
    """One synthetic learner: a LinkCore, its socket and a step counter."""

    def __init__(self, index: int, spec: WorkerSpec, ctx: zmq.Context[zmq.Socket[bytes]], blobs: Blobs) -> None:
        self.index, self.spec, self.ctx, self.blobs = index, spec, ctx, blobs
        self.lid = f"learner-{index}"
        self.s = RunSettings(**spec.settings)
        self.schedule = Schedule(self.s.H, self.s.fragments, spec.step_time)
        self.tokens_per_step = self.s.batch_size * self.s.seq_len
        me = Identity(
            self.lid,
            f"loadgen-{os.getpid()}-{index}-{time.monotonic_ns()}",
            spec.run_id,
            os.getpid(),
            "loadgen",
            "cpu",
            self.s.batch_size,
            spec.manifest,
        )
        self.core = LinkCore(me, spec.sizes, self.s)
        decode = spec.decode == "all" or (spec.decode == "one" and index < spec.procs)
        self.core.replica = self.replica = LeanReplica(spec.sizes, decode)
        self.sock: zmq.Socket[bytes] | None = None
        self.phase = random.Random(spec.seed * 1000 + index).random() * spec.step_time
        self.ready_at: float | None = None  # monotonic time of its step 0
        self.steps = 0  # steps since ready
        self.first_step = 0  # the step counter's start (the syncer's welcome when it joined)
        self.since = [0] * self.s.fragments  # steps since the last push of each fragment
        self.outstanding: dict[int, Outstanding] = {}
        self.replies: list[dict[str, Any]] = []
        self.lag: list[float] = []  # how late step boundaries were handled (the generator's own delay)
        self.pushes = self.missed_updates = self.fetched_replies = 0

    # -- time --------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Handle the step boundaries that have passed: count, push what is due, report progress."""
        if not self.core.ready:
            return
        if self.ready_at is None:
            # joined: the step counter starts where the syncer said, once (learner/trainer.py `resume`);
            # the welcome of a later reconnect changes nothing
            self.ready_at, self.first_step = now + self.phase, self.core.resume_step
        due = math.floor((now - self.ready_at) / self.spec.step_time)
        if due > self.steps:
            self.lag.append(now - (self.ready_at + due * self.spec.step_time))
        while self.steps < due:
            self.steps += 1
            self.since = [n + 1 for n in self.since]
            self._push_due(self.first_step + self.steps)
        self.core.stats.update(
            step=self.first_step + self.steps,
            tokens=self.steps * self.tokens_per_step,
            state="running",
            step_time=self.spec.step_time,
            tokens_per_s=self.tokens_per_step / self.spec.step_time,
        )

    def _push_due(self, step: int) -> None:
        """learner/trainer.py `_due` + `_send_outer`: the called (or scheduled) fragments with work."""
        due = sorted(self.core.take_calls()) if self.s.syncer_clock else self.schedule.due(step)
        for p in due:
            if self.since[p] <= 0:
                continue
            n = self.since[p]
            item = PushItem(
                p,
                EMPTY,
                self.replica.versions[p],
                n,
                n * self.tokens_per_step,
                n * self.spec.step_time,
                self.spec.step_time,
                base_epoch=self.replica.epoch or 0,
            )
            self.core.push(item)
            self.since[p] = 0

    def tick(self, now: float) -> None:
        """learner/client.py `_cycle` minus the poll: what the time asks for, carried out."""
        out = self.core.tick(now)
        if out.close:
            self.close_socket()
        if out.open:
            self._open(now)
        failed: set[str] = set()  # after one push or upload chunk cannot leave, the later ones go back
        for send in out.sends:
            kind = "push" if send.push is not None else "init" if send.init is not None else "msg"
            if kind in failed or not self._send(send):
                if kind != "msg":
                    failed.add(kind)
                self.core.unsent(send)

    # -- socket ------------------------------------------------------------------------------
    def _open(self, now: float) -> None:
        """A DEALER socket set up like learner/client.py's (Paranoid Pirate: LINGER 0, IMMEDIATE)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.SNDTIMEO, 5000)
        if self.spec.keys_dir is not None:
            keydir = Path(self.spec.keys_dir)
            sock.curve_publickey, sock.curve_secretkey = keys.load_pair(keydir / f"{self.lid}.key_secret")
            sock.curve_serverkey = keys.load_public(keydir / "syncer.key")
        sock.connect(one_shard(self.spec.shards, self.s.fragments).address)
        self.sock = sock
        self.core.opened(now)

    def close_socket(self, linger_ms: int = 0) -> None:
        if self.sock is not None:
            self.sock.close(linger=linger_ms)
            self.sock = None

    def _send(self, send: Send) -> bool:
        if self.sock is None:
            return False
        frames = encode(self._message(send))
        try:
            self.sock.send_multipart(frames, flags=0 if send.block else zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        self.core.sent(send, sum(len(f) for f in frames))
        if send.push is not None:
            p = send.push.fragment
            self.outstanding[p] = Outstanding(time.time(), self.outstanding[p].missed if p in self.outstanding else 0)
            self.pushes += 1
        return True

    def _message(self, send: Send) -> Message:
        """learner/link.py `push_message` with a pre-encoded blob; upload chunks of random values."""
        if send.push is not None:
            blob = self.blobs.pick(send.push.fragment, self.index + self.pushes)
            return Message("push", push_meta(send), [blob])
        if send.init is not None:
            c = send.init
            meta = {"fragment": c.fragment, "offset": c.offset, "numel": c.numel, "total": c.total}
            return Message("init", meta, [self.blobs.init_chunk(c.numel)])
        assert send.msg is not None, "a send is a message, a push or an upload chunk"
        return send.msg

    def receive_all(self, now: float) -> None:
        """Every waiting message into the link; each reply to a push is recorded with its times."""
        while self.sock is not None:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            received_at = time.time()
            self.core.receive(now, frames)
            self._account(received_at)

    def _account(self, received_at: float) -> None:
        """A reply is an update whose round merged our push (LinkCore's replies); an update of a
        fragment whose push is out that does not list us is a round our push missed."""
        replies, _ = self.core.take_updates()
        applied, self.replica.applied = self.replica.applied, []
        for p, version in applied:
            o = self.outstanding.get(p)
            if o is None:
                continue
            if p not in replies:
                o.missed += 1
                self.missed_updates += 1
                continue
            del self.outstanding[p]
            self.replies.append(
                {
                    "learner": self.lid,
                    "fragment": p,
                    "version": version,
                    "pushed_at": o.pushed_at,
                    "received_at": received_at,
                    "missed": o.missed,
                }
            )
        for p in replies - {p for p, _ in applied}:
            if self.outstanding.pop(p, None) is not None:  # a fetched state answered it (after a gap)
                self.fetched_replies += 1

    # -- reports -----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        c = self.core.counters
        return {
            "ready": self.core.ready,
            "phase": self.core.phase.value,
            "fatal": self.core.fatal,
            "steps": self.steps,
            "pushes": self.pushes,
            "outstanding": len(self.outstanding),
            "missed_updates": self.missed_updates,
            "fetched_replies": self.fetched_replies,
            "updates": c.updates,
            "refetches": c.refetches,
            "reconnects": c.reconnects,
            "bad_messages": c.bad_messages,
            "bytes_sent": c.bytes_sent,
            "bytes_received": c.bytes_received,
            "decoded": self.replica.decoded,
        }

    def stop(self) -> None:
        """Say bye (if linked) and close, leaving libzmq a moment to send it."""
        bye = self.core.goodbye()
        if bye is not None and self.sock is not None:
            try:
                self.sock.send_multipart(encode(self._message(bye)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.close_socket(linger_ms=200)


class Blobs:
    """The pre-encoded outer gradients (a few per fragment) and a chunk of initial values."""

    def __init__(self, files: dict[int, list[str]], seed: int) -> None:
        self.by_fragment = {p: [Path(f).read_bytes() for f in paths] for p, paths in files.items()}
        self._init: bytes | None = None
        self.seed = seed

    def pick(self, p: int, turn: int) -> bytes:
        choices = self.by_fragment[p]
        return choices[turn % len(choices)]

    def init_chunk(self, numel: int) -> bytes:
        """fp32 values for an upload chunk (one random chunk, reused: the values do not matter)."""
        if self._init is None or len(self._init) < 4 * numel:
            g = torch.Generator().manual_seed(self.seed)
            self._init = (torch.randn(max(numel, 1 << 20), generator=g) * 0.02).numpy().tobytes()
        return self._init[: 4 * numel]


class Worker:
    """The learners of one worker process and its loop."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.blobs = Blobs(spec.blobs, spec.seed)
        self.learners: dict[int, SimLearner] = {}

    def command(self, cmd: tuple[Any, ...], conn: Connection) -> bool:
        """Carry out one command of the parent; False for quit."""
        if cmd[0] == "set":
            self.resize(int(cmd[1]))
        elif cmd[0] == "report":
            conn.send(self.report())
        elif cmd[0] == "quit":
            return False
        return True

    def resize(self, n: int) -> None:
        """Run this worker's learners among 0..n-1; those beyond say bye."""
        for i in [i for i in self.learners if i >= n]:
            self.learners.pop(i).stop()
        for i in range(self.spec.worker, n, self.spec.procs):  # learner i runs on worker i % procs
            if i not in self.learners:
                self.learners[i] = SimLearner(i, self.spec, self.ctx, self.blobs)

    def report(self) -> dict[str, Any]:
        replies: list[dict[str, Any]] = []
        lag: list[float] = []
        for learner in self.learners.values():
            replies += learner.replies
            lag += learner.lag
            learner.replies, learner.lag = [], []
        return {
            "worker": self.spec.worker,
            "pid": os.getpid(),
            "learners": {learner.lid: learner.status() for learner in self.learners.values()},
            "replies": replies,
            "lag": lag,
        }

    def run(self, conn: Connection) -> None:
        while True:
            while conn.poll(0):
                if not self.command(conn.recv(), conn):
                    return
            now = time.monotonic()
            for learner in list(self.learners.values()):
                learner.advance(now)
                learner.tick(now)
            self._poll()

    def _poll(self) -> None:
        by_sock = {learner.sock: learner for learner in self.learners.values() if learner.sock is not None}
        if not by_sock:
            time.sleep(POLL_MS / 1000)
            return
        poller = zmq.Poller()
        for sock in by_sock:
            poller.register(sock, zmq.POLLIN)
        ready = dict(poller.poll(self._timeout_ms()))
        now = time.monotonic()
        for sock, learner in by_sock.items():
            if sock in ready:
                learner.receive_all(now)

    def _timeout_ms(self) -> int:
        """Until the next step boundary of any learner, at most POLL_MS."""
        now, wait = time.monotonic(), POLL_MS / 1000
        for learner in self.learners.values():
            if learner.ready_at is not None:
                step = self.spec.step_time
                wait = min(wait, learner.ready_at + (learner.steps + 1) * step - now)
        return max(0, math.ceil(wait * 1000))

    def close(self) -> None:
        for learner in self.learners.values():
            learner.stop()
        self.learners.clear()
        self.ctx.term()


def main(spec: WorkerSpec, conn: Connection) -> None:
    """The worker process's entry point (multiprocessing, spawn)."""
    torch.set_num_threads(1)
    worker = Worker(spec)
    try:
        worker.run(conn)
    except (EOFError, KeyboardInterrupt):  # the parent went away
        pass
    finally:
        worker.close()
