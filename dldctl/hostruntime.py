"""How to start the run's processes on one host: its interpreter, import path and run directory.

`provision` records one per host when it prepares it; the run state keeps it
(`HostRecord.runtime`), and the supervisor, chaos, `logs` and `down` read it back typed. Pure:
no I/O, the paths are strings on the host.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class HostRuntime:
    """How to start the run's processes on one host."""

    host: str
    python: str  # interpreter
    pythonpath: str  # "" or the site dir holding our wheel
    run_dir: str  # this run's directory on the host
    config: str  # resolved configuration on the host
    code: str = ""  # the snapshot of `[run] workdir` on the host, first on every process's import path

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def learner_workdir(self, lid: str) -> str:
        """A learner's working directory on the host (its control.json, checkpoints, shards)."""
        return f"{self.run_dir}/learners/{lid}"

    def log_path(self, target: str) -> str:
        """Where a process's output goes on the host."""
        return f"{self.run_dir}/logs/{target}.log"
