"""A run's metrics in Weights & Biases (`[metrics] wandb = true`), written by the supervisor.

One W&B run per dldctl run: its id is the run directory's name, so a restarted supervisor (and
`wandb sync` of several offline segments) continues the same W&B run. The step is seconds since
the run was created (dldctl/supervise/metricpoints.py), which only rises; a point whose step is below
the last one logged is skipped (W&B would drop it). `wandb_mode = "offline"` (the default) writes
to <run>/wandb/ only (upload later with `wandb sync <run>/wandb/offline-run-*`); "online" needs
`wandb login` or WANDB_API_KEY. W&B does not capture the supervisor's console or system stats.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dldctl.metricspec import MetricsSpec
from dldctl.supervise.metricpoints import Point, PointSink


def run_id(name: str) -> str:
    """A W&B run id from a run directory's name (W&B allows letters, digits, - and _)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", name)[:64]


class WandbSink(PointSink):
    """Logs each Point with wandb.log, from the supervisor process."""

    def __init__(self, spec: MetricsSpec, run_path: Path, t0: float) -> None:
        super().__init__(t0)
        import wandb

        out = run_path / "wandb"
        out.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        self.run: Any = wandb.init(
            project=spec.wandb_project,
            entity=spec.wandb_entity or None,
            mode=spec.wandb_mode,  # type: ignore[arg-type]
            dir=str(run_path),
            name=run_path.name,
            id=run_id(run_path.name),
            resume="allow",
            settings=settings,
        )
        self.last_step = -1
        self.where = f"W&B {spec.wandb_mode} run {self.run.id} in {out}"

    def write(self, point: Point) -> None:
        if point.step < self.last_step:
            return
        self.last_step = point.step
        self.run.log(point.values, step=point.step)

    def close(self) -> None:
        self.run.finish()
