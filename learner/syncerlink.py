"""The learner's link to the whole syncer, sharded or not: one `SyncerClient` per syncer shard
behind the one interface the trainer uses.

Each shard owns a balanced subset of the run's fragments (syncer/wire/shards.py, computed here
from the fragment sizes as every shard computes it) and is, to its client, a whole syncer of
those fragments numbered 0..k-1 in global order. This facade maps the trainer's global fragment
p to (shard, local index) and back. Each shard's link lives on its own thread, socket and
clock: a dead, hung or partitioned shard never blocks pushes to, or replies from, the others,
and a wait for fragment p (a reply, a merge) waits on p's shard only. Unsharded (one address)
the map is the identity and this is one `SyncerClient`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from learner.client import SyncerClient
from learner.config import LearnerConfig
from learner.link import ShardRole
from learner.sends import PushItem
from syncer.wire import shards


class SyncerLink:
    """The trainer's view of the syncer: global fragment indices over one client per shard."""

    def __init__(
        self,
        cfg: LearnerConfig,
        manifest: list[list[Any]],
        sizes: list[int],
        init_values: Callable[[], list[torch.Tensor]],
        incarnation: str,
    ) -> None:
        self.cfg = cfg
        count = max(1, len(cfg.syncer_addresses))
        self.map = shards.assign(sizes, count)
        self.owned = [self.map.owned(s) for s in range(count)]
        self.where = [self.map.local(p) for p in range(len(sizes))]  # p -> (shard, local index)
        self.clients = [
            SyncerClient(
                cfg,
                manifest,
                [sizes[p] for p in owned],
                _pick(init_values, owned) if count > 1 else init_values,
                incarnation,
                ShardRole(s, count, owned if count > 1 else (), len(sizes)),
            )
            for s, owned in enumerate(self.owned)
        ]
        self.addresses = [c.address for c in self.clients]

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        for c in self.clients:
            c.start()

    def is_alive(self) -> bool:
        return all(c.is_alive() for c in self.clients)

    def wait_ready(self, timeout: float) -> bool:
        """Whether every shard's state is fetched (waits up to `timeout` in all)."""
        deadline = time.monotonic() + timeout
        return all(c.ready.wait(max(0.0, deadline - time.monotonic())) for c in self.clients)

    def not_ready(self) -> list[str]:
        """The addresses of the shards whose state is not fetched yet."""
        return [c.address for c in self.clients if not c.ready.is_set()]

    def stop(self, flush_s: float = 2.0, finished: bool = False) -> None:
        """Every shard's link flushes, says bye and closes, all at once (never S x flush_s)."""
        threads = [threading.Thread(target=c.stop, args=(flush_s, finished)) for c in self.clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    @property
    def fatal(self) -> str | None:
        """Why a shard refused this learner (restarting cannot help), or None."""
        return next((f for c in self.clients if (f := c.fatal) is not None), None)

    @property
    def restart(self) -> str | None:
        """Why this process must restart from the global state (a shard quarantined it), or None."""
        return next((r for c in self.clients if (r := c.restart) is not None), None)

    def held_s(self, now: float) -> float:
        """Seconds of a quarantine left to wait out before training (the longest of the shards')."""
        return max(c.held_s(now) for c in self.clients)

    @property
    def resume_step(self) -> int:
        return max(c.resume_step for c in self.clients)

    @property
    def goodbye_confirmed(self) -> bool:
        return all(c.goodbye_confirmed for c in self.clients)

    # -- fragments -----------------------------------------------------------------------------
    def push(self, item: PushItem) -> None:
        s, q = self.where[item.fragment]
        self.clients[s].push(dataclasses.replace(item, fragment=q))

    def take_updates(self) -> tuple[set[int], set[int]]:
        """(fragments with a reply to our push, fragments a shard wants overwritten), global."""
        replies: set[int] = set()
        forced: set[int] = set()
        for owned, c in zip(self.owned, self.clients, strict=True):
            r, f = c.take_updates()
            replies.update(owned[q] for q in r)
            forced.update(owned[q] for q in f)
        return replies, forced

    def queued_units(self) -> dict[int, tuple[int, ...]]:
        """Work units named by pushes not sent yet, per global fragment (every shard's queue)."""
        return {
            owned[q]: u for owned, c in zip(self.owned, self.clients, strict=True) for q, u in c.queued_units().items()
        }

    def take_units(self) -> tuple[list[int], list[int]]:
        """(units to train, units to give up): from shard 0, the one that keeps the data ledger."""
        return self.clients[0].take_units()

    def take_calls(self) -> set[int]:
        return {owned[q] for owned, c in zip(self.owned, self.clients, strict=True) for q in c.take_calls()}

    def has_reply(self, p: int) -> bool:
        s, q = self.where[p]
        return self.clients[s].has_reply(q)

    def linked(self, p: int | None = None) -> bool:
        """Whether fragment p's shard (None: every shard) is reachable now."""
        if p is None:
            return all(c.linked() for c in self.clients)
        return self.clients[self.where[p][0]].linked()

    def latest(self, p: int) -> tuple[int, torch.Tensor]:
        s, q = self.where[p]
        return self.clients[s].latest(q)

    def versions(self) -> list[int]:
        each = [c.versions() for c in self.clients]
        return [each[s][q] for s, q in self.where]

    def epoch(self, p: int) -> int:
        """The epoch of fragment p's shard that its replica belongs to (0 before the first welcome)."""
        return self.clients[self.where[p][0]].epoch()

    def epochs(self) -> list[int]:
        return [self.epoch(p) for p in range(len(self.where))]

    def wait_for_reply(self, p: int, timeout: float) -> bool:
        """Until a reply for p is waiting or p's shard is unreachable; whether it came to that."""
        s, q = self.where[p]
        return self.clients[s].wait_for(lambda core: core.has_reply(q) or not core.linked(), timeout)

    def wait_for_version(self, p: int, above: int, timeout: float) -> bool:
        """Until fragment p's replica is past version `above`; whether it is."""
        s, q = self.where[p]
        return self.clients[s].wait_for(lambda core: core.replica.versions[q] > above, timeout)

    # -- everyone ------------------------------------------------------------------------------
    def set_stats(self, **stats: Any) -> None:
        for c in self.clients:
            c.set_stats(**stats)

    def set_partitioned(self, cut: bool) -> None:
        for c in self.clients:
            c.set_partitioned(cut)

    def pending(self) -> int:
        return sum(c.pending() for c in self.clients)

    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for c in self.clients:
            for k, v in c.counters().items():
                total[k] = total.get(k, 0) + v
        return total

    def replica_snapshot(self) -> dict[str, Any]:
        """The replica's versions and values in global order (`replica.pt` at exit); `epoch` is
        shard 0's, `epochs` each fragment's shard's."""
        each = [c.replica_snapshot() for c in self.clients]
        return {
            "versions": self.versions(),
            "epoch": each[0]["epoch"],
            "epochs": [each[s]["epoch"] for s, _ in self.where],
            "fragments": [each[s]["fragments"][q] for s, q in self.where],
        }


def _pick(values: Callable[[], list[torch.Tensor]], owned: tuple[int, ...]) -> Callable[[], list[torch.Tensor]]:
    """The initial values of one shard's fragments, in its order."""

    def picked() -> list[torch.Tensor]:
        every = values()
        return [every[p] for p in owned]

    return picked
