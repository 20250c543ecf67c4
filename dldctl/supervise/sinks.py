"""The run's metrics sinks (dldctl/supervise/feeds.py feeds them): one per library.

    [metrics] tensorboard = true     TensorBoardSink  scalars in <run>/tensorboard/ (tensorboard's own writer)
    [metrics] prometheus_port = N    PrometheusSink   /metrics over HTTP (prometheus_client)
    [metrics] wandb = true           WandbSink        a W&B run (offline by default) in <run>/wandb/

Each turns metrics records into `Point`s (dldctl/supervise/metricpoints.py) and writes them with the
library. `build_sinks` makes the ones the inventory turns on; a sink that cannot start (a port
in use, a library missing) is left out with one event that says why, and the run goes on. The
libraries are imported only here, only when turned on, so the base install needs none of them.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from dldctl.errors import ConfigError
from dldctl.inventory import Inventory
from dldctl.metricspec import MetricsSpec
from dldctl.supervise.feeds import Feeds, Sink
from dldctl.supervise.metricpoints import Point, PointSink

Report = Callable[[str, str], object]  # (event kind, detail): RunDir.event with the target "supervisor"


class TensorBoardSink(PointSink):
    """Scalars for TensorBoard, step = seconds since the run was created."""

    def __init__(self, logdir: Path, t0: float) -> None:
        super().__init__(t0)
        from tensorboard.summary import Writer  # type: ignore[import-untyped]

        logdir.mkdir(parents=True, exist_ok=True)
        self.writer = Writer(str(logdir))
        self.where = f"scalars in {logdir} (tensorboard --logdir {logdir})"
        self._flushed = time.monotonic()

    def write(self, point: Point) -> None:
        for name, value in point.values.items():
            self.writer.add_scalar(name, value, point.step, wall_time=point.t)

    def tick(self, now: float) -> None:
        if time.monotonic() - self._flushed >= 5.0:  # TensorBoard reads what is flushed
            self._flushed = time.monotonic()
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _prometheus(m: MetricsSpec, run: str, t0: float) -> Sink:
    """The Prometheus sink, imported only when it is on: prometheus_client is an extra
    (`dldctl[prometheus]`) that the README's install leaves out; a run without it never imports it."""
    from dldctl.supervise import sink_prom

    return sink_prom.PrometheusSink(m, run, t0)


def _wandb(m: MetricsSpec, run_path: Path, t0: float) -> Sink:
    """The W&B sink, imported only when it is on (as `_prometheus`)."""
    from dldctl.supervise import sink_wandb

    return sink_wandb.WandbSink(m, run_path, t0)


def build_sinks(inv: Inventory, run_path: Path, t0: float, report: Report) -> list[Sink]:
    """The sinks `inv`'s [metrics] turns on, for the run in `run_path` (created at `t0`)."""
    from dldctl.supervise import alertsend

    m = inv.metrics
    makers: list[tuple[bool, str, Callable[[], Sink]]] = [
        (m.tensorboard, "tensorboard", lambda: TensorBoardSink(run_path / "tensorboard", t0)),
        (m.prometheus_port > 0, "prometheus", lambda: _prometheus(m, run_path.name, t0)),
        (m.wandb, "wandb", lambda: _wandb(m, run_path, t0)),
        (inv.alerts.active, "alerts", lambda: alertsend.AlertSink(inv.alerts, run_path)),  # docs/alerts.md
    ]
    sinks: list[Sink] = []
    for on, name, make in makers:
        if not on:
            continue
        try:
            sink = make()
        except Exception as exc:  # a port in use, a missing library: the run goes on without it
            report("metrics_export_failed", f"{name}: {type(exc).__name__}: {exc}")
            continue
        sinks.append(sink)
        report("metrics_export", f"{name}: {getattr(sink, 'where', '')}")
    return sinks


def drain(inv: Inventory, run_path: Path, t0: float, report: Report) -> int:
    """At `down`, after the supervisor and syncer have stopped: hand the records they wrote last
    (the learners' final fragments, the syncer's final sample) to the file sinks
    (TensorBoard, W&B), so what the sinks wrote ends where the run did. Returns the records handed over."""
    no_alerts = replace(inv.alerts, command="", webhook="")  # down's own departures alert no one
    files_only = replace(inv, metrics=replace(inv.metrics, prometheus_port=0), alerts=no_alerts)
    sinks = build_sinks(files_only, run_path, t0, lambda *_: None)
    if not sinks:
        return 0
    feeds = Feeds(run_path, sinks, report=lambda line: report("metrics_export_failed", line))
    total = 0
    while True:
        before = dict(feeds.positions)
        total += feeds.poll(time.time())
        if feeds.positions == before:  # at the end of both files (a rotation moves without records)
            break
    feeds.close()
    return total


def preflight(inv: Inventory) -> None:
    """Before `up` creates a run: the Prometheus port can be bound (else a ConfigError naming it)."""
    m = inv.metrics
    if m.prometheus_port <= 0:
        return
    family = socket.AF_INET6 if ":" in m.prometheus_bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server will
        try:
            probe.bind((m.prometheus_bind, m.prometheus_port))
        except OSError as exc:
            raise ConfigError(
                inv.path,
                "metrics.prometheus_port",
                f"cannot listen on {m.prometheus_bind}:{m.prometheus_port} ({exc.strerror})",
                "stop what listens there (another run?), or pick another port",
            ) from None
