"""The learner's log: one timestamped line on stdout that never raises (a full disk loses it).

Each line says which learner and which incarnation of it wrote it, so a log that spans restarts
reads clearly: `12:01:02 [#3] learner-2: step 400 loss ...` is from learner-2's third process
(the supervisor passes the restarts so far as DLDCTL_RESTARTS; a rank of a torchrun island adds
` r1`: `[#3 r1]`). The step counter is the learner's own across restarts: a restarted learner
resumes where the syncer says it was (learner/trainer.py `resume`). Before `configure` (a warm
spare waiting to learn who it becomes) a line is just the time and the message.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

_prefix = ""


def incarnation(env: Mapping[str, str]) -> int:
    """This process's number among the learner's processes: 1 + the restarts before it."""
    try:
        return 1 + max(0, int(env.get("DLDCTL_RESTARTS", "0") or 0))
    except ValueError:
        return 1


def prefix(learner_id: str, env: Mapping[str, str]) -> str:
    """`[#3] learner-2: `, with the island rank (`[#3 r1] learner-2: `) under torchrun."""
    try:
        island = int(env.get("WORLD_SIZE", "1") or 1) > 1
    except ValueError:
        island = False
    rank = f" r{env.get('RANK', '0')}" if island else ""
    return f"[#{incarnation(env)}{rank}] {learner_id}: "


def configure(learner_id: str) -> None:
    """From now on every line carries this learner's name and incarnation (from the environment)."""
    global _prefix
    _prefix = prefix(learner_id, os.environ)


def log(message: str) -> None:
    """One line on stdout (the learner's log); a line the disk cannot take is lost, never raised."""
    try:
        print(f"{time.strftime('%H:%M:%S')} {_prefix}{message}", flush=True)
    except (OSError, ValueError):
        pass


def shown(value: float | None) -> str:
    """A loss for a log line: four decimals, or `-` when there is none yet (right after a reload)."""
    return "-" if value is None else f"{value:.4f}"
