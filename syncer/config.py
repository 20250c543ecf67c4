"""The syncer's view of a resolved run configuration (config.json, syncer/common/resolved.py).

Paths are absolute or relative to the configuration file's directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    shard: int = 0  # this process is shard `shard` of `shards` (syncer/wire/shards.py)
    shards: int = 1
    neighbours: int = 1  # shards of the run on this shard's host, itself included (they share its cores)
    model_args: dict[str, Any] = field(default_factory=dict)  # the inventory's [model] table
    model_dir: Path | None = None  # an `hf:` model's directory, the run's copy on this host

    def workload_args(self) -> dict[str, Any]:
        """What the evaluator hands the model's factory besides the settings (`WorkloadContext`)."""
        return {
            "model_args": dict(self.model_args),
            "model_dir": None if self.model_dir is None else str(self.model_dir),
        }

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def shard_dir(run_dir: Path, shard: int) -> Path:
    """Where shard `shard` keeps its files (`resolved.shard_subdir`)."""
    return run_dir / resolved.shard_subdir(shard)


def load(path: Path, shard: int = 0) -> SyncerConfig:
    """The syncer's part of a resolved configuration, as shard `shard` sees it; ValueError (one
    line) names the file."""
    cfg = resolved.load(path)
    base = Path(path).resolve().parent
    try:
        section = cfg.syncer.shard(shard)
    except ValueError as exc:
        raise resolved.ResolvedConfigError(f"{path}: {exc}") from None
    return SyncerConfig(
        cfg.run_id,
        cfg.run,
        section.bind,
        section.control_bind,
        shard_dir(cfg.run_dir(base), shard),
        cfg.learner_ids,
        cfg.keys_dir(base),
        shard,
        cfg.syncer.shards,
        len(cfg.syncer.on_host(section.host)),
        dict(cfg.model_args),
        cfg.model_dir_path(base),
    )
