"""The learner's outer-loop bookkeeping: per-fragment marks, counters and the sync schedule.

Pure tensor code (no I/O). Fragment p is due after step s when s % H == ((p + 1) * H / P) % H,
so one fragment leaves every H/P steps. The outer gradient of fragment p is

    delta[p] = mark[p] - local[p]

where mark[p] is where the fragment stood at its last push or its last apply of a global value,
whichever came later. Right after an apply mark = the global value, so this is DiLoCo's
`global - local`; and a second push before the reply to the first (a round still waiting for
its quorum) carries only the work done since the first, so no step is ever sent twice.
Counters (steps, tokens, time) run over the same span as the delta.

Applying a global fragment: overwrite (alpha = 0, ALGORITHM.md's default) drops the work done
between the push and the reply; `rebase` keeps it, local := global + (local - mark), so that
work is sent with the next push instead of lost (no step is lost, none is sent twice). A reload
(a learner whose values turned non-finite: learner/health.py) overwrites whatever the settings:
rebasing or mixing would keep a NaN of the local weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from syncer.wire.fragments import FragmentPlan


@dataclass
class FragmentCounters:
    """Work on one fragment since its mark."""

    steps: int = 0
    tokens: int = 0
    time: float = 0.0

    def reset(self) -> None:
        self.steps, self.tokens, self.time = 0, 0, 0.0


@dataclass
class OuterState:
    """Marks, versions, counters and in-flight flags of every fragment."""

    plan: FragmentPlan
    H: int
    alpha: float
    rebase: bool = False
    mark: list[torch.Tensor] = field(default_factory=list)
    base_version: list[int] = field(default_factory=list)
    base_epoch: list[int] = field(default_factory=list)
    counters: list[FragmentCounters] = field(default_factory=list)
    awaiting: list[bool] = field(default_factory=list)

    def offset(self, p: int) -> int:
        return ((p + 1) * self.H // self.plan.count) % self.H

    def due(self, step: int) -> list[int]:
        """Fragments whose sync point is right after inner step `step` (1-based)."""
        return [p for p in range(self.plan.count) if step % self.H == self.offset(p)]

    def lockstep_phase(self) -> int:
        """Synchronous DiLoCo (overlap = false): steps to add to a (re)joining learner's counter so
        that its first push is the fragment the fleet merges next, after H/P steps of training.

        In lock-step the fragments merge in schedule order 0, 1, ..., P-1, so the next one is the
        number of fragments already merged once more than the least-merged one. Without this, a
        restarted learner (step counter back at 0) waits for fragment 0 while the others wait for
        its push of another fragment: a deadlock.
        """
        low = min(self.base_version)
        nxt = sum(1 for v in self.base_version if v > low)
        return nxt * self.H // self.plan.count

    def count_step(self, tokens: int, seconds: float) -> None:
        for c in self.counters:
            c.steps += 1
            c.tokens += tokens
            c.time += seconds

    @torch.no_grad()
    def take_outer_gradient(self, p: int, params: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, FragmentCounters]:
        """mark[p] - local[p] (on the parameters' device: `learner.offload.take` sends it on) and
        its counters; moves the mark."""
        local = self.plan.gather(p, params)
        delta = self.mark[p] - local
        counters = FragmentCounters(self.counters[p].steps, self.counters[p].tokens, self.counters[p].time)
        self.mark[p] = local
        self.counters[p].reset()
        self.awaiting[p] = True
        return delta, counters

    @torch.no_grad()
    def apply(
        self,
        p: int,
        version: int,
        value: torch.Tensor,
        params: Mapping[str, torch.Tensor],
        epoch: int = 0,
        overwrite: bool = False,
    ) -> None:
        """Take a global fragment: overwrite (alpha = 0, or `overwrite`: a reload), mix, or rebase;
        it becomes the new mark.

        Overwrite drops the local work since the last push (the price of the overlap); rebase
        keeps it on top of the global value and keeps its counters, so the next push carries it."""
        rebase = self.rebase and not overwrite
        if rebase:
            local = self.plan.gather(p, params)
            local.sub_(self.mark[p].to(local.device)).add_(value.to(local.device))
            self.plan.scatter(p, local, params)
            self.mark[p] = value.to(local.device, copy=True)
        elif self.alpha == 0.0 or overwrite:
            self.plan.scatter(p, value, params)
            self.mark[p] = value.clone()
        else:
            local = self.plan.gather(p, params)
            mixed = local.mul_(self.alpha).add_(value, alpha=1.0 - self.alpha)
            self.plan.scatter(p, mixed, params)
            self.mark[p] = mixed
        self.base_version[p] = version
        self.base_epoch[p] = epoch
        if not rebase:  # rebase keeps the work since the push, and its counters
            self.counters[p].reset()
        self.awaiting[p] = False

    @classmethod
    def start(
        cls,
        plan: FragmentPlan,
        H: int,
        alpha: float,
        values: list[tuple[int, torch.Tensor]],
        params: Mapping[str, torch.Tensor],
        epoch: int | Sequence[int] = 0,
        rebase: bool = False,
    ) -> OuterState:
        """Load the fetched global state into the model and make it every fragment's mark (`epoch`:
        of the syncer that sent it, one per fragment where shards differ)."""
        state = cls(plan, H, alpha, rebase)
        epochs = [epoch] * len(values) if isinstance(epoch, int) else list(epoch)
        for p, (version, value) in enumerate(values):
            with torch.no_grad():
                plan.scatter(p, value, params)
            state.mark.append(value.clone())
            state.base_version.append(version)
            state.base_epoch.append(epochs[p])
            state.counters.append(FragmentCounters())
            state.awaiting.append(False)
        return state
