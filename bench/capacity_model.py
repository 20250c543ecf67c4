"""The syncer's capacity model (pure: no I/O, no torch): what one syncer process (a shard) needs in
memory, CPU and link to keep up with a fleet, and how many shards a model needs.

A fleet of M learners at H inner steps per sync of a fragment and T seconds per inner step pushes
every fragment once per H*T seconds from each learner; with the syncer's round clock each round
gathers the whole fleet (M contributions). A shard owning n of the model's parameters then, per
second of training:

    merge CPU    = n * (a + b*M) / (H*T)              core-seconds per second (its loop: one core)
    wire         = M * n * w / (H*T)                  bytes per second in, and as much out
    crypto CPU   = 2 * wire / C                       libzmq's I/O thread (CURVE), one more core
    memory       = base + n * (s + w*M)               steady; + n * 12 while a checkpoint is written

where a (ns per parameter per round) and b (ns per parameter per push) are the round's measured
costs, w the bytes of one int4 + zstd push per parameter, s the state bytes per parameter (12:
parameters, Nesterov momentum, error-feedback residual, plus what the process keeps around them),
C the one-way CURVE throughput of one connection thread, and base the empty process. A shard keeps
up while merge CPU <= `loop_share` of its core (the rest: messages, heartbeats, checkpoints, and
rounds finishing well inside their interval) and crypto CPU <= `io_cores`. A model of N parameters
needs

    shards = max(ceil(N * (s + w*M + 12) / RAM),  ceil(merge CPU(N) / loop_share),  ceil(crypto CPU(N) / io_cores))

shards of RAM bytes each (the checkpoint's copy-on-write counted; fragments balanced over shards).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CHECKPOINT_B = 12.0  # bytes per parameter a checkpoint write may copy (copy on write of merged fragments)


@dataclass(frozen=True)
class Costs:
    """A shard's measured costs, per parameter it owns."""

    round_ns: float  # a: CPU per parameter per round, whatever the number of pushes
    push_ns: float  # b: CPU per parameter per push in the round (decompress, check, Gram, merge)
    push_B: float  # w: wire bytes of one push per parameter (int4 + zstd)
    state_B: float  # s: what the process holds per parameter with nothing pending
    base_B: float  # the empty syncer process
    crypto_MBps: float  # C: one-way CURVE MB/s of one connection thread


@dataclass(frozen=True)
class Fleet:
    """The load: M learners, H inner steps per sync of each fragment, T seconds per inner step."""

    learners: int
    H: int
    step_s: float

    @property
    def period_s(self) -> float:
        """Every parameter is merged once per H*T seconds (each fragment once per H steps)."""
        return self.H * self.step_s


def merge_cores(c: Costs, f: Fleet, params: float) -> float:
    """Cores of the shard's loop that merging `params` parameters takes."""
    return params * (c.round_ns + c.push_ns * f.learners) * 1e-9 / f.period_s


def wire_MBps(c: Costs, f: Fleet, params: float) -> float:
    """MB/s in (pushes), and as much out (updates to the same learners)."""
    return f.learners * params * c.push_B / f.period_s / 1e6


def crypto_cores(c: Costs, f: Fleet, params: float) -> float:
    """Cores of CURVE encryption and decryption for both directions."""
    return 2.0 * wire_MBps(c, f, params) / c.crypto_MBps


def memory_B(c: Costs, f: Fleet, params: float, checkpointing: bool = False) -> float:
    """Bytes the shard holds: steady with every round pending, plus a checkpoint's copies."""
    per_param = c.state_B + c.push_B * f.learners + (CHECKPOINT_B if checkpointing else 0.0)
    return c.base_B + params * per_param


def max_learners(c: Costs, H: int, step_s: float, params: float, loop_share: float, io_cores: float) -> int:
    """The largest fleet one shard owning `params` keeps up with (by CPU; memory is `memory_B`)."""
    period = H * step_s
    by_merge = (loop_share * period / (params * 1e-9) - c.round_ns) / c.push_ns
    by_crypto = io_cores * c.crypto_MBps * 1e6 * period / (2.0 * params * c.push_B)
    return max(0, math.floor(min(by_merge, by_crypto)))


def shards(c: Costs, f: Fleet, params: float, ram_B: float, loop_share: float, io_cores: float) -> dict[str, int]:
    """Shards a model of `params` needs, and what each limit alone would ask for."""
    state = params * (c.state_B + c.push_B * f.learners + CHECKPOINT_B)
    need = {
        "by_memory": math.ceil(state / max(1.0, ram_B - c.base_B)),
        "by_merge": math.ceil(merge_cores(c, f, params) / loop_share),
        "by_crypto": math.ceil(crypto_cores(c, f, params) / io_cores),
    }
    need["shards"] = max(1, *need.values())
    return need


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b*x: (a, b)."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise ValueError("a line needs at least two distinct x")
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b
