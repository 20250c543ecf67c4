"""The inner training loop of every baseline: the plain loop, data-parallel (DDP) and torchft's DiLoCo.

Each baseline trains the model a learner trains (`workload.build_workload`) with the learners'
inner recipe: AdamW, `learner.schedule.learning_rate`, gradient clipping. One step:

    lr -> batch -> forward and loss (bf16 autocast or none) -> zero_grad -> backward -> clip -> AdamW

What differs between the baselines is a `Strategy`: the module the forward runs through (a bare or
compiled model, DDP's wrapper) and what backward does about the other workers' gradients (nothing;
DDP's overlapped all-reduce; an explicit all-reduce after it), which it reports as the seconds of
communication the step left exposed. torchft's DiLoCo syncs inside AdamW's step (its optimizer
hook), so its strategy says so and the emulated slower device (a host's `throttle`, as a learner's)
is measured before that step; elsewhere it is measured on the whole step, less exposed communication.
The loss stays a tensor: reading it waits for the device, and the plain loop reads it only at the end.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from learner.files import Slowdown
from learner.schedule import learning_rate
from workload import Workload, WorkloadContext, build_workload


class Strategy:
    """The plain loop's: the forward runs through `model`, backward reduces nothing."""

    syncs_in_update = False  # True: the optimizer step communicates (torchft's DiLoCo hook)

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def backward(self, loss: torch.Tensor, began: float) -> float:
        """Backward and whatever reduces the gradients; the seconds of communication left exposed
        (`began`: the step's perf_counter start)."""
        loss.backward()
        return 0.0


@dataclass(frozen=True)
class Step:
    """One inner step's outcome."""

    loss: torch.Tensor  # detached only by the reader: float() waits for the device
    tokens: int
    compute_s: float  # the step's time less its exposed communication, the emulated slowdown included
    exposed_s: float  # communication the strategy left exposed


def workload(settings: dict[str, Any], index: int, shards: int, device: torch.device, seed: int) -> Workload:
    """The workload learner `index` of `shards` builds (model, batches, held-out batches)."""
    ctx = WorkloadContext(
        settings=settings,
        learner_index=index,
        shards=shards,
        batch_size=int(settings["batch_size"]),
        device=device,
        seed=seed,
    )
    return build_workload(ctx)


def inner_optimizer(model: torch.nn.Module, settings: dict[str, Any], fused: bool = False) -> torch.optim.AdamW:
    """The learners' inner AdamW (`fused` on CUDA where the recipe asks for it)."""
    lr, decay = float(settings["lr"]), float(settings["weight_decay"])
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=decay, fused=fused or None)


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """bf16 autocast of what runs inside (the forward and the loss), or nothing for fp32."""
    if precision != "bf16":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        yield


class InnerLoop:
    """Steps of one worker: its workload, inner optimizer and strategy."""

    def __init__(
        self,
        wl: Workload,
        opt: torch.optim.Optimizer,
        strategy: Strategy,
        settings: dict[str, Any],
        *,
        device: torch.device,
        precision: str = "fp32",
        throttle: float = 1.0,
    ) -> None:
        self.wl, self.opt, self.strategy, self.s = wl, opt, strategy, settings
        self.device, self.precision, self.throttle = device, precision, throttle
        self.grad_clip = float(settings["grad_clip"])
        self.slowdown = Slowdown()

    def lr(self, step: int) -> float:
        """The learners' learning rate at inner step `step` (warmup, then the run's schedule)."""
        s = self.s
        total = int(s.get("steps") or 0)
        return learning_rate(step, float(s["lr"]), int(s["warmup"]), s.get("lr_schedule", "constant"), total)

    def step(self, lr: float) -> Step:
        """One inner step at learning rate `lr`."""
        began = time.perf_counter()
        for group in self.opt.param_groups:
            group["lr"] = lr
        batch = self.wl.next_batch()
        with autocast(self.device, self.precision):
            loss = self.wl.loss(self.strategy.model, batch)
        self.opt.zero_grad(set_to_none=True)
        exposed = self.strategy.backward(loss, began)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.wl.model.parameters(), self.grad_clip)
        if self.strategy.syncs_in_update:
            self._slow_down(time.perf_counter() - began)  # the sync inside the update is not compute
        self.opt.step()
        compute = time.perf_counter() - began - exposed
        if not self.strategy.syncs_in_update:
            compute += self._slow_down(compute)
        return Step(loss, self.wl.tokens(batch), compute, exposed)

    def _slow_down(self, compute: float) -> float:
        """Wait as an emulated slower device would (the config's `throttle`); the seconds waited."""
        if self.throttle == 1.0:
            return 0.0
        wait = self.slowdown.wait_s(compute, self.throttle)
        if wait > 0:
            time.sleep(wait)
        return max(0.0, wait)
