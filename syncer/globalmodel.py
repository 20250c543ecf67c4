"""The syncer's plain state holders: the `Outbox` a handler fills and the `GlobalModel` it merges
into (no I/O; syncer/core.py drives them, syncer/checkpoint.py saves them)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from syncer.wire import fragments
from syncer.wire.protocol import Message


@dataclass
class Outbox:
    """What a handler wants done: messages to send, events and metrics to record."""

    sends: list[tuple[list[str], Message]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)

    def send(self, learner: str, msg: Message) -> None:
        self.sends.append(([learner], msg))

    def broadcast(self, learners: list[str], msg: Message) -> None:
        if learners:
            self.sends.append((sorted(learners), msg))

    def event(self, now: float, kind: str, target: str, detail: str = "") -> None:
        self.events.append({"t": now, "kind": kind, "target": target, "detail": detail})


@dataclass
class GlobalModel:
    """The global parameters, one flat fp32 vector per fragment, and the outer-optimizer state."""

    manifest: list[fragments.TensorSpec]
    plan: fragments.FragmentPlan
    theta: list[torch.Tensor]
    versions: list[int]
    momentum: list[torch.Tensor]
    residual: list[torch.Tensor]
    lent: set[int] = field(default_factory=set)  # fragments whose current value a send may still read
    held: set[int] = field(default_factory=set)  # fragments whose momentum and residual a snapshot holds

    @classmethod
    def fresh(
        cls, manifest: list[fragments.TensorSpec], plan: fragments.FragmentPlan, theta: list[torch.Tensor]
    ) -> GlobalModel:
        zeros = [torch.zeros_like(t) for t in theta]
        return cls(manifest, plan, theta, [0] * plan.count, zeros, [torch.zeros_like(t) for t in theta])

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.theta)

    def lend(self, p: int) -> torch.Tensor:
        """Fragment p's current value for zero-copy sends (state chunks): from now on it is never
        written again; the next write goes to a copy (`writable`)."""
        self.lent.add(p)
        return self.theta[p]

    def snapshot(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(theta, momentum, residual) as they are now, without a copy: every fragment's three
        vectors are lent, so a merge writes into copies (`writable`) and the snapshot never
        changes while a checkpoint thread writes it or the quality guard holds it."""
        self.lent.update(range(len(self.theta)))
        self.held.update(range(len(self.theta)))
        return list(self.theta), list(self.momentum), list(self.residual)

    def writable(self, p: int) -> torch.Tensor:
        """Fragment p's value, to be changed in place (momentum and residual with it): whatever of
        it was lent is replaced by a private copy first (copy on write), so chunks still queued in
        a socket keep the bytes of their version and a snapshot keeps its values."""
        if p in self.lent:
            self.theta[p] = self.theta[p].clone()
            self.lent.discard(p)
        if p in self.held:
            self.momentum[p] = self.momentum[p].clone()
            self.residual[p] = self.residual[p].clone()
            self.held.discard(p)
        return self.theta[p]

    def crc(self, p: int) -> int:
        """crc32 of fragment p's fp32 bytes: learners check their replica against it."""
        # ndarray.data is memoryview(array); numpy's stubs declare the buffer protocol for 3.12+ only
        return zlib.crc32(self.theta[p].numpy().data)
