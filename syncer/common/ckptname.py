"""The one reader of a checkpoint's file name, `ckpt-EPOCH-STEP-MS.pt` (syncer/checkpoint.py writes it).

The name carries the epoch that wrote it, the outer step it holds and its wall time in
milliseconds, so they stay readable when the body is not. Everything that must learn a
checkpoint's step from a file name (the operator's status, `down`, a shard's row) reads it here;
a light module, so reading a name never imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

NAME = re.compile(r"ckpt-(\d+)-(\d+)-(\d+)\.pt")  # epoch, outer step, wall ms


@dataclass(frozen=True, order=True)
class CheckpointName:
    """What a checkpoint's file name says; ordered as the syncer orders its checkpoints."""

    epoch: int
    outer_step: int
    wall_ms: int

    @property
    def wall_s(self) -> float:
        return self.wall_ms / 1000.0


def parse(name: str) -> CheckpointName | None:
    """The name's fields, or None if it is not a checkpoint's name."""
    m = NAME.fullmatch(name)
    return CheckpointName(int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def newest(names: Iterable[str]) -> CheckpointName | None:
    """The newest of the checkpoint names among `names` (others ignored); None if none is one."""
    return max((c for c in map(parse, names) if c is not None), default=None)
