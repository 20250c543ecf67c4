"""The learner's end of the data ledger (docs/data.md, "Who trains what"), and its loader state.

`LearnerUnits` holds the `UnitFeed` the workload takes its batches from (workload/units.py),
takes the units the syncer hands out (or takes back), and after every step notes the units whose
last sequence was trained: each fragment's next push names them, which is how the syncer learns
that a unit was trained and, when that push is merged, merged. The units it holds and has not
yet pushed on every fragment are its "hand", reported with every heartbeat and hello (after a
syncer restart the ledger reconciles its checkpoint with the hands). Every finished unit is a
line in `units.jsonl` in the work dir: what this learner trained, by its own account.

A factory with its own loader instead gives `Workload.state_dict` / `load_state_dict`: its state
is saved beside the replica with every push of fragment 0 and handed back at the next start.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from learner.logline import log
from syncer.common import jsonl
from syncer.common.atomic import atomic_file
from workload import Workload
from workload.units import UnitFeed

LOADER_STATE = "loader_state.pt"
META_EVERY_S = 0.1  # the trainer publishes every step; heartbeats carry it every heartbeat_s (0.5 s)


class LearnerUnits:
    """The feed, the units finished and not yet pushed per fragment, and the learner's log."""

    def __init__(self, workdir: Path, learner: str, fragments: int, incarnation: str, on: bool) -> None:
        self.feed: UnitFeed | None = UnitFeed() if on else None
        self.unpushed: dict[int, set[int]] = {p: set() for p in range(fragments)}
        self.log_path = workdir / "units.jsonl"
        self.learner, self.incarnation = learner, incarnation
        self._meta: dict[str, Any] | None = None
        self._meta_at = float("-inf")
        if self.feed is not None:  # a restored syncer moves its cursor past what this slot trained before
            self.feed.beyond = last_unit(self.log_path) + 1

    def receive(self, handed: list[int], taken_back: list[int]) -> None:
        """Units from the syncer: to train (queued in order), and to give up (another learner has them)."""
        if self.feed is None or not self.feed.configured:
            return
        if taken_back:
            self.feed.drop(taken_back)
            for waiting in self.unpushed.values():
                waiting.difference_update(taken_back)
        if handed:
            self.feed.add(handed)

    def stepped(self, step: int) -> None:
        """After a step: the units it finished wait for every fragment's next push."""
        if self.feed is None:
            return
        for uid in self.feed.completed():
            for waiting in self.unpushed.values():
                waiting.add(uid)
            record = {"t": time.time(), "unit": uid, "step": step, "learner": self.learner, "inc": self.incarnation}
            jsonl.append(self.log_path, record)

    def for_push(self, p: int) -> tuple[int, ...]:
        """The units fragment p's push names (finished since its previous push), now pushed on p."""
        units = tuple(sorted(self.unpushed.get(p, ())))
        self.unpushed[p] = set()
        return units

    def published(self, tokens_per_s: float, queued: Callable[[], dict[int, tuple[int, ...]]]) -> dict[str, Any] | None:
        """`meta` for the trainer's every-step publish, worked out at most every META_EVERY_S
        (its lists and the link's locks cost a fast learner's steps for a heartbeat that reads
        it twice a second)."""
        now = time.monotonic()
        if now - self._meta_at >= META_EVERY_S:
            self._meta, self._meta_at = self.meta(tokens_per_s, queued()), now
        return self._meta

    def meta(
        self, tokens_per_s: float = 0.0, queued: dict[int, tuple[int, ...]] | None = None
    ) -> dict[str, Any] | None:
        """The heartbeat's and hello's `data`: the feed's description, the hand including the
        units finished but not yet pushed on every fragment (a push still `queued` to leave, per
        fragment, is not pushed yet), and (`pushed`) the fragments each of those has been pushed
        on (a restored syncer counts those pushes lost with its rounds)."""
        if self.feed is None or not self.feed.configured:
            return None
        meta = self.feed.meta(tokens_per_s)
        assert meta is not None
        left = {p: waiting | set((queued or {}).get(p, ())) for p, waiting in self.unpushed.items()}
        waiting = set().union(*left.values())
        meta["hand"] = meta["hand"] + sorted(waiting - set(meta["hand"]))
        meta["pushed"] = [[uid, [p for p, due in left.items() if uid not in due]] for uid in sorted(waiting)]
        return meta


def last_unit(path: Path, tail: int = 1 << 16) -> int:
    """The highest unit id in the last `tail` bytes of a units.jsonl (-1: none, or no file)."""
    try:
        with open(path, "rb") as fh:
            start = max(0, fh.seek(0, 2) - tail)
            fh.seek(start)
            lines = fh.read().decode("utf-8", "replace").splitlines()[1 if start else 0 :]  # the first may be cut
    except OSError:
        return -1
    top = -1
    for line in lines:
        try:
            top = max(top, int(json.loads(line)["unit"]))
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line (a kill mid-write)
    return top


def restore_loader(workload: Workload, workdir: Path) -> None:
    """Hand a factory's loader the state it saved before this restart, if it keeps one."""
    path = workdir / LOADER_STATE
    if workload.load_state_dict is None or not path.exists():
        return
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a torn or foreign file: start the loader afresh, say so
        log(f"cannot read {path.name} ({exc}); the data loader starts from its beginning")
        return
    workload.load_state_dict(state)
    log(f"data loader resumed from {path.name}")


def save_loader(workload: Workload, workdir: Path) -> None:
    """The factory loader's state, atomically (a full disk keeps the previous one)."""
    if workload.state_dict is None:
        return
    try:
        with atomic_file(workdir / LOADER_STATE) as fh:
            torch.save(workload.state_dict(), fh)
    except (OSError, RuntimeError) as exc:
        log(f"cannot write {LOADER_STATE} ({exc}); the loader state is not kept")
