"""The syncer's view of a resolved run configuration (the JSON file `dldctl up` writes).

    { "version": 1, "run_id": str, "run": {RunSettings},
      "syncer": {"host": str, "bind_host": str, "port": int, "control_port": int,
                 "advertise": str, "dir": str},
      "learners": [{"id": "learner-0", "host": ..., "device": ..., ...}, ...],
      "keys": {"dir": str} }

Paths are absolute or relative to the configuration file's directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from syncer.common.settings import RunSettings, SettingsError, read_resolved, settings_from_dict


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


def _resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p)


def load(path: Path) -> SyncerConfig:
    """Parse and validate the syncer's part of a resolved configuration."""
    data = read_resolved(path)
    base = Path(path).resolve().parent
    try:
        settings = settings_from_dict(data["run"])
        sec = data["syncer"]
        bind_host, port, cport = sec["bind_host"], int(sec["port"]), int(sec["control_port"])
        learners = tuple(str(entry["id"]) for entry in data["learners"])
        keys_dir = None if settings.insecure else _resolve(base, data["keys"]["dir"])
        run_dir = _resolve(base, sec.get("dir", "."))
    except SettingsError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: missing or malformed entry {exc}") from exc
    return SyncerConfig(
        str(data["run_id"]),
        settings,
        f"tcp://{bind_host}:{port}",
        f"tcp://{bind_host}:{cport}",
        run_dir,
        learners,
        keys_dir,
    )
