"""The learner's outer-loop bookkeeping: per-fragment bases, counters and the sync schedule.

Pure tensor code (no I/O). Fragment p is due after step s when s % H == ((p + 1) * H / P) % H,
so one fragment leaves every H/P steps. The outer gradient of fragment p is
    delta[p] = base[p] - local[p]
where base[p] is the global value last applied. Counters run from that apply to the next one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from syncer.fragments import FragmentPlan


@dataclass
class FragmentCounters:
    """Work on one fragment since it was last overwritten by a global value."""

    steps: int = 0
    tokens: int = 0
    time: float = 0.0

    def reset(self) -> None:
        self.steps, self.tokens, self.time = 0, 0, 0.0


@dataclass
class OuterState:
    """Bases, versions, counters and in-flight flags of every fragment."""

    plan: FragmentPlan
    H: int
    alpha: float
    base: list[torch.Tensor] = field(default_factory=list)
    base_version: list[int] = field(default_factory=list)
    counters: list[FragmentCounters] = field(default_factory=list)
    awaiting: list[bool] = field(default_factory=list)

    def offset(self, p: int) -> int:
        return ((p + 1) * self.H // self.plan.count) % self.H

    def due(self, step: int) -> list[int]:
        """Fragments whose sync point is right after inner step `step` (1-based)."""
        return [p for p in range(self.plan.count) if step % self.H == self.offset(p)]

    def count_step(self, tokens: int, seconds: float) -> None:
        for c in self.counters:
            c.steps += 1
            c.tokens += tokens
            c.time += seconds

    @torch.no_grad()
    def outer_gradient(self, p: int, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """base[p] - local[p], copied to the CPU for the sender thread."""
        local = self.plan.gather(p, params)
        return (self.base[p] - local).to("cpu", torch.float32)

    @torch.no_grad()
    def apply(self, p: int, version: int, value: torch.Tensor, params: Mapping[str, torch.Tensor]) -> None:
        """Take a global fragment: overwrite (alpha = 0) or mix, and make it the new base."""
        if self.alpha == 0.0:
            self.plan.scatter(p, value, params)
        else:
            local = self.plan.gather(p, params)
            self.plan.scatter(p, local.mul_(self.alpha).add_(value, alpha=1.0 - self.alpha), params)
        self.base[p] = value
        self.base_version[p] = version
        self.counters[p].reset()
        self.awaiting[p] = False

    @classmethod
    def start(cls, plan: FragmentPlan, H: int, alpha: float, values: list[tuple[int, torch.Tensor]],
              params: Mapping[str, torch.Tensor]) -> "OuterState":
        """Load the fetched global state into the model and make it every fragment's base."""
        state = cls(plan, H, alpha)
        for p, (version, value) in enumerate(values):
            with torch.no_grad():
                plan.scatter(p, value, params)
            state.base.append(value)
            state.base_version.append(version)
            state.counters.append(FragmentCounters())
            state.awaiting.append(False)
        return state
