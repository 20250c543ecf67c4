"""Synthetic learners for bench/loadgen.py: one worker process drives many over real sockets.

Each synthetic learner is the real learner minus the model: one link per syncer shard
(bench/loadgen_link.py `ShardLink`: the real `learner.link.LinkCore` behind its own DEALER
socket and CURVE key, as learner/syncerlink.py holds one `SyncerClient` per shard), and a step
counter for the training:

- "training" advances the counter every `step_time` seconds (each learner at its own phase),
  once every shard's state is fetched (the trainer waits for all of them);
- at each step boundary the learner pushes the fragments the shards called (round_clock =
  "syncer", the default: each shard calls its own fragments' rounds) or those its own schedule
  makes due, with the counters since its last push of that fragment, exactly like
  learner/trainer.py; a push goes to the fragment's owner shard with the shard's local index;
- a push carries one of a few outer gradients encoded once by the parent, so the worker spends
  its time on the protocol, not on encoding; updates are decoded (`decode = "all"`, or on one
  learner per worker: "one") and dropped.

Every learner records each reply to its pushes (`loadgen_core.Reply`, with its shard). The parent
drives the worker through a pipe: ("set", n) runs learners 0..n-1 of those this worker owns (the
others say bye), ("hold", True) keeps learners that have not taken their first step from taking
it until ("hold", False) (a fleet joins before any merge loads the syncer: a fetch cannot finish
while its fragment merges several times a second), ("report",) answers with every learner's
state and the replies since the last report, ("quit",) ends it.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from bench.loadgen_core import Schedule
from bench.loadgen_link import EMPTY, Blobs, Shard, ShardLink, check_shards
from learner.link import Identity, ShardRole
from learner.sends import PushItem
from syncer.common.settings import RunSettings

POLL_MS = 20  # like learner/client.py


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to run its learners (picklable: it crosses a spawn)."""

    worker: int
    procs: int
    shards: tuple[Shard, ...]  # every shard of the syncer (one: unsharded)
    keys_dir: str | None  # None: an insecure run (no CURVE)
    run_id: str
    settings: dict[str, Any]
    manifest: list[list[Any]]  # fragments.manifest_to_json
    sizes: list[int]  # the run's fragments, global numbering
    blobs: dict[int, list[str]]  # global fragment -> files of encoded outer gradients
    step_time: float
    decode: str  # all | one | none
    seed: int = 0


class SimLearner:
    """One synthetic learner: a link per shard and a step counter over the run's fragments."""

    def __init__(self, index: int, spec: WorkerSpec, ctx: zmq.Context[zmq.Socket[bytes]], blobs: Blobs) -> None:
        check_shards(spec.shards, len(spec.sizes))
        self.index, self.spec = index, spec
        self.lid = f"learner-{index}"
        self.s = RunSettings(**spec.settings)
        self.schedule = Schedule(self.s.H, self.s.fragments, spec.step_time)
        self.tokens_per_step = self.s.batch_size * self.s.seq_len
        decode = spec.decode == "all" or (spec.decode == "one" and index < spec.procs)
        self.incarnation = f"loadgen-{os.getpid()}-{index}-{time.monotonic_ns()}"  # one for every shard
        self.links = [self._link(s, shard, ctx, blobs, decode) for s, shard in enumerate(spec.shards)]
        self.where = {p: (s, q) for s, shard in enumerate(spec.shards) for q, p in enumerate(shard.fragments)}
        self.phase = random.Random(spec.seed * 1000 + index).random() * spec.step_time
        self.ready_at: float | None = None  # monotonic time of its step 0
        self.steps = 0  # steps since ready
        self.first_step = 0  # the step counter's start (the shards' welcomes when it joined)
        self.since = [0] * self.s.fragments  # steps since the last push of each (global) fragment
        self.lag: list[float] = []  # how late step boundaries were handled (the generator's own delay)
        self.held = False  # joined but not stepping yet (the worker's "hold")

    def _link(self, s: int, shard: Shard, ctx: zmq.Context[zmq.Socket[bytes]], blobs: Blobs, decode: bool) -> ShardLink:
        """The link to shard s, its role as learner/syncerlink.py sets it (unsharded: the default)."""
        count, total = len(self.spec.shards), len(self.spec.sizes)
        me = Identity(
            self.lid,
            self.incarnation,
            self.spec.run_id,
            os.getpid(),
            "loadgen",
            "cpu",
            self.s.batch_size,
            self.spec.manifest,
            ShardRole(s, count, shard.fragments if count > 1 else (), total),
        )
        return ShardLink(me, self.index, shard, self.spec.sizes, self.s, ctx, blobs, self.spec.keys_dir, decode)

    @property
    def ready(self) -> bool:
        return all(link.core.ready for link in self.links)

    # -- time --------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Handle the step boundaries that have passed: count, push what is due, report progress."""
        if not self.ready or (self.held and self.ready_at is None):
            return
        if self.ready_at is None:
            # joined: the step counter starts where the shards said, once (learner/trainer.py `resume`);
            # the welcome of a later reconnect changes nothing
            self.ready_at = now + self.phase
            self.first_step = max(link.core.resume_step for link in self.links)
        due = math.floor((now - self.ready_at) / self.spec.step_time)
        if due > self.steps:
            self.lag.append(now - (self.ready_at + due * self.spec.step_time))
        while self.steps < due:
            self.steps += 1
            self.since = [n + 1 for n in self.since]
            self._push_due(self.first_step + self.steps)
        for link in self.links:
            link.core.stats.update(
                step=self.first_step + self.steps,
                tokens=self.steps * self.tokens_per_step,
                state="running",
                step_time=self.spec.step_time,
                tokens_per_s=self.tokens_per_step / self.spec.step_time,
            )

    def _called(self) -> set[int]:
        """The global fragments whose rounds the shards called (learner/syncerlink.py `take_calls`)."""
        return {link.owned[q] for link in self.links for q in link.core.take_calls()}

    def _push_due(self, step: int) -> None:
        """learner/trainer.py `_due` + `_send_outer`: the called (or scheduled) fragments with
        work, each to its owner shard under the shard's local index."""
        due = sorted(self._called()) if self.s.syncer_clock else self.schedule.due(step)
        for p in due:
            if self.since[p] <= 0:
                continue
            n, (s, q) = self.since[p], self.where[p]
            replica = self.links[s].replica
            item = PushItem(
                q,
                EMPTY,
                replica.versions[q],
                n,
                n * self.tokens_per_step,
                n * self.spec.step_time,
                self.spec.step_time,
                base_epoch=replica.epoch or 0,
            )
            self.links[s].core.push(item)
            self.since[p] = 0

    def tick(self, now: float) -> None:
        for link in self.links:
            link.tick(now)

    # -- reports -----------------------------------------------------------------------------
    def take_replies(self) -> list[dict[str, Any]]:
        """The replies every shard sent since the last take."""
        out: list[dict[str, Any]] = []
        for link in self.links:
            out += link.replies
            link.replies = []
        return out

    def status(self) -> dict[str, Any]:
        """Ready when every shard's state is fetched; the counters summed over the shards."""
        counts = [link.counters() for link in self.links]
        out: dict[str, Any] = {
            "ready": self.ready,
            "phase": "/".join(link.core.phase.value for link in self.links),
            "fatal": next((link.core.fatal for link in self.links if link.core.fatal), None),
            "steps": self.steps,
        }
        out.update({k: sum(c[k] for c in counts) for k in counts[0]})
        return out

    def stop(self) -> None:
        for link in self.links:
            link.stop()


class Worker:
    """The learners of one worker process and its loop."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.blobs = Blobs(spec.blobs, spec.seed)
        self.learners: dict[int, SimLearner] = {}
        self.held = False

    def command(self, cmd: tuple[Any, ...], conn: Connection) -> bool:
        """Carry out one command of the parent; False for quit."""
        if cmd[0] == "set":
            self.resize(int(cmd[1]))
        elif cmd[0] == "hold":
            self.held = bool(cmd[1])
            for learner in self.learners.values():
                learner.held = self.held
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
                self.learners[i].held = self.held

    def report(self) -> dict[str, Any]:
        replies: list[dict[str, Any]] = []
        lag: list[float] = []
        for learner in self.learners.values():
            replies += learner.take_replies()
            lag += learner.lag
            learner.lag = []
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
        """Wait for a message on any link (until the next step boundary) and take in what came."""
        by_sock = {
            link.sock: link for learner in self.learners.values() for link in learner.links if link.sock is not None
        }
        if not by_sock:
            time.sleep(POLL_MS / 1000)
            return
        poller = zmq.Poller()
        for sock in by_sock:
            poller.register(sock, zmq.POLLIN)
        ready = dict(poller.poll(self._timeout_ms()))
        now = time.monotonic()
        for sock, link in by_sock.items():
            if sock in ready:
                link.receive_all(now)

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
