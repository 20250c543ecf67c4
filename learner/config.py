"""The learner's view of a resolved run configuration (the JSON file `dldctl up` writes).

Each entry of `learners` describes one learner: {"id", "host", "device", "batch_size",
"throttle", "nproc", "threads", "env", "shard", "shards"}. Paths in the file are absolute or
relative to the file's own directory. Only stdlib and the shared settings are imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncer.common.settings import RunSettings, SettingsError, from_mapping, read_resolved, settings_from_dict


@dataclass(frozen=True)
class LearnerSpec:
    """One learner of the fleet, as the inventory declared it."""

    id: str
    host: str = "local"
    device: str = "cpu"
    batch_size: int = 0  # 0: the run's batch_size
    throttle: float = 1.0  # >1: artificially this many times slower (demos, tests)
    nproc: int = 1  # ranks in this learner's torchrun island
    threads: int = 1  # torch intra-op threads per rank
    env: dict[str, str] = field(default_factory=dict)  # the inventory checks: str keys and values
    shard: int = 0
    shards: int = 1


@dataclass(frozen=True)
class LearnerConfig:
    """Everything `python -m learner` needs."""

    run_id: str
    settings: RunSettings
    spec: LearnerSpec
    syncer_address: str
    secret_key: Path | None  # this learner's CURVE key pair (NAME.key_secret)
    syncer_key: Path | None  # the syncer's public key
    workdir: Path

    @property
    def batch_size(self) -> int:
        return self.spec.batch_size or self.settings.batch_size


def load(path: Path, learner_id: str, workdir: Path | None = None) -> LearnerConfig:
    """Parse the configuration for `learner_id`; ValueError names the file and the problem."""
    data = read_resolved(path)
    base = Path(path).resolve().parent
    try:
        settings = settings_from_dict(data["run"])
        entry = _entry(data, learner_id)
        spec = from_mapping(LearnerSpec, entry, "learners")
        sec = data["syncer"]
        address = f"tcp://{sec['advertise']}:{int(sec['port'])}"
        secret = syncer_key = None
        if not settings.insecure:
            keys_dir = _resolve(base, data["keys"]["dir"])
            secret, syncer_key = keys_dir / f"{learner_id}.key_secret", keys_dir / "syncer.key"
    except SettingsError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: missing or malformed entry {exc}") from exc
    return LearnerConfig(str(data["run_id"]), settings, spec, address, secret, syncer_key, workdir or base / learner_id)


def _entry(data: dict[str, Any], learner_id: str) -> dict[str, Any]:
    entries: list[dict[str, Any]] = data["learners"]  # JSON tables; from_mapping checks each one
    for entry in entries:
        if entry.get("id") == learner_id:
            return entry
    known = ", ".join(str(e.get("id")) for e in entries)
    raise SettingsError("learners", f"no learner {learner_id!r} in this configuration (known: {known})")


def _resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p
