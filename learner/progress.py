"""How fast and how well a learner trains: the numbers it reports about itself.

The loop (learner/trainer.py) feeds them; this keeps them: seconds busy (its steps) and blocked
(waiting on the link), tokens per second over an EMA of the step time, the steady throughput
without the warm-up (recipe.Steady), the training loss EMA and the last eval loss. Out of them
come what every heartbeat carries (`stats`) and the `finished` record's timings (`finished`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from learner.recipe import Steady
from syncer.common.smallmath import ema

STALL_FACTOR = 4.0  # a step longer than this many typical steps was stopped, not computing


@dataclass
class Progress:
    """One incarnation's running numbers (times are monotonic seconds)."""

    steady: Steady
    loss_ema: float | None = None
    eval_loss: float | None = None
    step_time: float | None = None
    tokens_per_s: float = 0.0
    busy_s: float = 0.0
    blocked_s: float = 0.0
    train_started: float = 0.0  # the training loop
    train_ended: float = 0.0

    def counted(self, seconds: float) -> float:
        """A step's wall time as compute: at most STALL_FACTOR typical steps. A stopped process
        (SIGSTOP, a pause, swapped out) stalls the step it is in; the stall is not compute, and
        the syncer's goodput (merged compute over provisioned time) must not count it. A real
        slow-down is followed within a few steps: the typical step is an EMA of what is counted."""
        return min(seconds, STALL_FACTOR * self.step_time) if self.step_time else seconds

    def stepped(self, tokens: int, seconds: float, steps_here: int, total_tokens: int) -> None:
        """After an inner step of `tokens` that took `seconds` (the `steps_here`-th of this incarnation)."""
        self.busy_s += seconds
        self.step_time = ema(self.step_time, seconds)
        self.tokens_per_s = tokens / self.step_time if self.step_time else 0.0
        self.steady.stepped(steps_here, total_tokens, time.monotonic(), self.train_started)

    def losses(self, values: list[float]) -> bool:
        """Fold training losses into the EMA (a non-finite EMA starts over); False if one was non-finite."""
        ok = True
        for value in values:
            finite = self.loss_ema is not None and math.isfinite(self.loss_ema)
            self.loss_ema = 0.9 * self.loss_ema + 0.1 * value if finite and self.loss_ema is not None else value
            ok = ok and math.isfinite(value)
        return ok

    def stats(self) -> dict[str, Any]:
        """The heartbeat's speed and losses (a non-finite loss as None: JSON has no NaN)."""
        total = self.busy_s + self.blocked_s
        return {
            "tokens_per_s": self.tokens_per_s,
            "step_time": self.step_time or 0.0,
            "blocked_frac": self.blocked_s / total if total else 0.0,
            "loss": finite(self.loss_ema),
            "eval_loss": finite(self.eval_loss),
        }

    def finished(self, tokens: int) -> dict[str, Any]:
        """The `finished` record's timings: the loop's wall seconds, its compute and blocked
        parts, and the steady throughput."""
        return {
            "train_s": self.train_ended - self.train_started,
            "busy_s": self.busy_s,
            "blocked_s": self.blocked_s,
            **self.steady.record(tokens, self.train_ended),
        }


def finite(value: float | None) -> float | None:
    """None for a missing or non-finite number (JSON has no NaN)."""
    return value if value is not None and math.isfinite(value) else None
