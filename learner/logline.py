"""The learner's log: one timestamped line on stdout that never raises (a full disk loses it)."""

from __future__ import annotations

import time


def log(message: str) -> None:
    """One line on stdout (the learner's log); a line the disk cannot take is lost, never raised."""
    try:
        print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)
    except (OSError, ValueError):
        pass
