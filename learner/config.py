"""The learner's view of a resolved run configuration (config.json, syncer/common/resolved.py).

Each entry of `learners` describes one learner (the shared `LearnerEntry`). Paths
in the file are absolute or relative to the file's own directory. Only stdlib and the shared
parts are imported here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncer.common import resolved
from syncer.common.resolved import LearnerEntry
from syncer.common.settings import RunSettings, SettingsError


@dataclass(frozen=True)
class LearnerConfig:
    """Everything `python -m learner` needs."""

    run_id: str
    settings: RunSettings
    spec: LearnerEntry
    syncer_address: str
    secret_key: Path | None  # this learner's CURVE key pair (NAME.key_secret)
    syncer_key: Path | None  # the syncer's public key
    workdir: Path
    init_model: Path | None = None  # the model file a new run starts from ([run] init_from); None: the seed's
    syncer_addresses: tuple[str, ...] = ()  # one per syncer shard (): only `syncer_address`
    model_args: dict[str, Any] = field(default_factory=dict)  # the inventory's [model] table
    model_dir: Path | None = None  # an `hf:` model's directory, the run's copy on this host

    @property
    def batch_size(self) -> int:
        return self.spec.batch_size or self.settings.batch_size


def load(path: Path, learner_id: str, workdir: Path | None = None) -> LearnerConfig:
    """Parse the configuration for `learner_id`; ValueError names the file and the problem."""
    cfg = resolved.load(path)
    base = Path(path).resolve().parent
    try:
        spec = cfg.learner(learner_id)
    except SettingsError as exc:
        raise resolved.ResolvedConfigError(f"{path}: {exc}") from None
    keys_dir = cfg.keys_dir(base)
    secret = syncer_key = None
    if keys_dir is not None:
        secret, syncer_key = keys_dir / f"{learner_id}.key_secret", keys_dir / "syncer.key"
    return LearnerConfig(
        cfg.run_id,
        dataclasses.replace(cfg.run, compression=spec.compression) if spec.compression else cfg.run,
        spec,
        cfg.syncer.address,
        secret,
        syncer_key,
        workdir or base / learner_id,
        cfg.init_model_path(base),
        cfg.syncer.addresses,
        dict(cfg.model_args),
        cfg.model_dir_path(base),
    )
