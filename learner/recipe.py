"""The training recipe a learner runs its inner steps with, resolved for its device.

Settings (`[run]`, syncer/common/settings.py) and what they become:

    precision = "auto"   bf16 autocast of the forward on a GPU that supports it, fp32 elsewhere
    compile   = "auto"   torch.compile of the model on CUDA, eager on the CPU
    tf32      = true     TF32 matmuls and convolutions on CUDA
    (always)             fused AdamW on CUDA; torch's default implementation on the CPU

Master weights, the optimizer state, the marks and the outer gradients stay fp32: autocast only
changes the arithmetic of the forward (and so the backward). A CPU learner at the defaults trains
exactly as before. Reading the loss every step makes the host wait for the GPU; `LossMeter` keeps
the losses on the device and reads them in batches (every step on the CPU, where a read is free).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

READ_EVERY = 16  # CUDA: losses read (one host-device sync) once per this many steps
WARMUP_COMPILED = 3  # steps a compiled model needs before its speed is its own (compiles, autotuning)


@dataclass(frozen=True)
class Recipe:
    """What the inner step uses: autocast dtype (None = fp32), compile, fused optimizer, TF32."""

    device: torch.device
    autocast: torch.dtype | None = None
    compile: bool = False
    fused: bool = False
    tf32: bool = False

    @property
    def precision(self) -> str:
        return "bf16" if self.autocast is torch.bfloat16 else "fp32"

    @property
    def warmup_steps(self) -> int:
        """Steps left out of the steady throughput: the first (allocations, first kernels), and
        a compiled model's first few (compilation and recompiles)."""
        return WARMUP_COMPILED if self.compile else 1

    def describe(self) -> str:
        parts = [self.precision, "compiled" if self.compile else "eager"]
        parts += ["fused AdamW"] if self.fused else []
        parts += ["TF32"] if self.tf32 else []
        return ", ".join(parts)


def resolve(precision: str, compile_: bool | str, tf32: bool, device: torch.device) -> Recipe:
    """The recipe for these settings on `device` (RuntimeError: bf16 asked of a GPU without it)."""
    cuda = device.type == "cuda"
    if precision == "auto":
        precision = "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise RuntimeError(f"precision = 'bf16' but {torch.cuda.get_device_name(device)} has no bf16; set precision")
    return Recipe(
        device,
        autocast=torch.bfloat16 if precision == "bf16" else None,
        compile=cuda if compile_ == "auto" else bool(compile_),
        fused=cuda,
        tf32=tf32 and cuda,
    )


def resolve_device(name: str, island: Any = None) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N' (an island rank uses its local rank's GPU); clear error if absent."""
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {name!r} requested but torch.cuda.is_available() is False on this host")
        if name == "cuda":  # set_device needs an index: "cuda" alone raises in torch >= 2.11
            name = f"cuda:{island.local_rank if island is not None else torch.cuda.current_device()}"
        device = torch.device(name)
        torch.cuda.set_device(device)
        return device
    if name != "cpu":
        raise RuntimeError(f"unknown device {name!r}; use cpu, cuda or cuda:N")
    return torch.device("cpu")


def setup(recipe: Recipe) -> None:
    """Process-wide switches (TF32)."""
    if recipe.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = recipe.tf32
        torch.backends.cudnn.allow_tf32 = recipe.tf32


def autocast(recipe: Recipe) -> contextlib.AbstractContextManager[object]:
    """The forward's autocast context (a no-op for fp32)."""
    if recipe.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(recipe.device.type, dtype=recipe.autocast)


def compiled(recipe: Recipe, model: torch.nn.Module) -> torch.nn.Module:
    """The module the inner step calls: `torch.compile(model)` or the model itself."""
    if not recipe.compile:
        return model
    out: torch.nn.Module = torch.compile(model)  # type: ignore[assignment]  # compile returns a callable wrapper
    return out


def optimizer(recipe: Recipe, params: Iterable[torch.nn.Parameter], lr: float, wd: float) -> torch.optim.AdamW:
    """AdamW, fused where the device supports it."""
    if recipe.fused:
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=wd)


def peak_memory(device: torch.device) -> int:
    """Peak bytes: the device's allocations on CUDA, the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class LossMeter:
    """Training losses kept on the device until read: every step on the CPU, every READ_EVERY
    steps (or when asked) on CUDA, so the host does not wait for the GPU once per step."""

    every: int = 1
    pending: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def for_device(cls, device: torch.device) -> LossMeter:
        return cls(READ_EVERY if device.type == "cuda" else 1)

    def add(self, loss: torch.Tensor) -> None:
        self.pending.append(loss.detach().float())

    def due(self) -> bool:
        return len(self.pending) >= self.every

    def read(self) -> list[float]:
        """The losses since the last read, oldest first (one device sync for all of them)."""
        if not self.pending:
            return []
        values = torch.stack(self.pending).tolist()
        self.pending.clear()
        return [float(v) for v in values]


@dataclass
class Steady:
    """Throughput without the warm-up: the first steps (and a compiled model's compilation) are
    timed apart, so tokens/s is the loop's own speed and compile time is reported on its own."""

    warmup_steps: int
    started: float  # monotonic: the process's start (time to the first step counts from it)
    first_step_s: float | None = None  # process start -> end of the first step
    warm_at: float | None = None  # monotonic: the end of the warm-up
    warm_tokens: int = 0  # tokens trained by then
    warmup_s: float = 0.0  # wall seconds of the warm-up steps (compile included)

    def stepped(self, steps_here: int, tokens: int, now: float, loop_started: float) -> None:
        """After a step: `steps_here` steps of this incarnation so far, `tokens` its total."""
        if steps_here == 1:
            self.first_step_s = now - self.started
        if steps_here == self.warmup_steps:
            self.warm_at, self.warm_tokens, self.warmup_s = now, tokens, now - loop_started

    def record(self, tokens: int, ended: float) -> dict[str, float | int | None]:
        """The `finished` record's throughput keys (steady_* are the whole loop if it never warmed)."""
        warm = self.warm_at is not None
        return {
            "warmup_steps": self.warmup_steps,
            "warmup_s": self.warmup_s,
            "first_step_s": self.first_step_s,
            "steady_tokens": tokens - self.warm_tokens if warm else tokens,
            "steady_s": ended - self.warm_at if self.warm_at is not None else None,
        }
