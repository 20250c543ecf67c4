"""The inner learning rate per step: linear warmup, then constant or a cosine decay to 10% of lr
at the step budget. Pure; the learners and the data-parallel baseline share it, so a benchmark
compares them under one schedule."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine")
FLOOR = 0.1  # cosine ends at FLOOR x lr


def learning_rate(
    step: int, lr: float, warmup: int, schedule: str = "constant", steps: int = 0, resumed_at: int = 0
) -> float:
    """lr for 0-based inner step `step` (cosine needs `steps`, the budget, > 0). A learner that
    resumed its counter at `resumed_at` > 0 (a restart: its optimizer's moments start from zero)
    warms up again over `warmup` steps to the schedule's rate there."""
    rate = lr * min(1.0, (step + 1) / max(1, warmup))
    if resumed_at > 0:
        rate = lr * min(1.0, (step - resumed_at + 1) / max(1, warmup))
    if schedule == "cosine" and steps > 0:
        progress = min(1.0, max(0, step - warmup) / max(1, steps - warmup))
        rate *= FLOOR + (1.0 - FLOOR) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return rate
