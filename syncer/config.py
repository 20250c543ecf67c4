"""The syncer's view of a resolved run configuration (config.json, syncer/common/resolved.py).

Paths are absolute or relative to the configuration file's directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from syncer.common import resolved
from syncer.common.settings import RunSettings


@dataclass(frozen=True)
class SyncerConfig:
    """What `python -m syncer` needs to run."""

    run_id: str
    settings: RunSettings
    bind: str
    control_bind: str
    run_dir: Path
    learners: tuple[str, ...]
    keys_dir: Path | None

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def load(path: Path) -> SyncerConfig:
    """The syncer's part of a resolved configuration; ValueError (one line) names the file."""
    cfg = resolved.load(path)
    base = Path(path).resolve().parent
    return SyncerConfig(
        cfg.run_id,
        cfg.run,
        cfg.syncer.bind,
        cfg.syncer.control_bind,
        cfg.run_dir(base),
        cfg.learner_ids,
        cfg.keys_dir(base),
    )
