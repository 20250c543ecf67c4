"""The Prometheus endpoint of a run (`[metrics] prometheus_port`), served by the supervisor.

Gauges are the newest metrics sample's figures, rounds aside, (dldctl/supervise/metricpoints.py names, `/` -> `_`,
prefixed `dldctl_`; a learner's figures carry a `learner` label), so a scrape always sees the run
as it is now and a learner that left is gone from it. Rounds feed histograms (merge latency, grace
used, contributors) and events a counter by kind, as Prometheus expects of cumulative figures;
they start again when the supervisor restarts, which Prometheus reads as a counter reset.
`dldctl_sample_age_seconds` says how old the newest sample is (a stalled syncer shows as age
rising, never as stale numbers that look fresh). Every series carries the label `run`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from dldctl.metricspec import MetricsSpec
from dldctl.supervise.metricpoints import Point, Points, number

PREFIX = "dldctl_"
_LEARNER = re.compile(r"^learner/(?P<id>[^/]+)/(?P<name>.+)$")


def metric_name(name: str) -> str:
    """A scalar's name as a Prometheus metric name (fleet/tokens_per_s -> dldctl_fleet_tokens_per_s)."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", name)


def families(point: Point | None, run: str, now: float) -> list[GaugeMetricFamily]:
    """The gauges of `point` (the newest sample), grouped into metric families."""
    if point is None:
        return []
    fleet: dict[str, GaugeMetricFamily] = {}
    for name, value in sorted(point.values.items()):
        if name.startswith("rounds/"):
            continue  # rounds are the histograms' (a per-sample mean is no Prometheus figure)
        m = _LEARNER.match(name)
        if m:
            key = metric_name("learner/" + m["name"])
            fam = fleet.setdefault(
                key, GaugeMetricFamily(key, f"each learner's {m['name']}", labels=["run", "learner"])
            )
            fam.add_metric([run, m["id"]], value)
        else:
            key = metric_name(name)
            fam = fleet.setdefault(key, GaugeMetricFamily(key, name, labels=["run"]))
            fam.add_metric([run], value)
    age = GaugeMetricFamily(PREFIX + "sample_age_seconds", "age of the newest metrics sample", labels=["run"])
    age.add_metric([run], max(0.0, now - point.t))
    return [*fleet.values(), age]


class _Newest(Collector):
    """Collects the gauges of the newest Point at each scrape."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.point: Point | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from families(self.point, self.run, time.time())


class PrometheusSink:
    """Serves /metrics on `[metrics] prometheus_bind:prometheus_port` from a thread of its own."""

    def __init__(self, spec: MetricsSpec, run: str, t0: float) -> None:
        self.registry = CollectorRegistry()
        self.newest = _Newest(run)
        self.registry.register(self.newest)
        self.points = Points(t0)
        labels = {"labelnames": ["run"], "registry": self.registry}
        self.merge = Histogram(PREFIX + "round_merge_seconds", "time to merge one round", **labels)  # type: ignore[arg-type]
        self.grace = Histogram(PREFIX + "round_grace_used_seconds", "grace waited for stragglers", **labels)  # type: ignore[arg-type]
        buckets = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
        self.contributors = Histogram(
            PREFIX + "round_contributors",
            "learners merged per round",
            buckets=buckets,
            **labels,  # type: ignore[arg-type]
        )
        self.events = Counter(PREFIX + "events", "run events by kind", ["run", "kind"], registry=self.registry)
        self.run = run
        self.server, self.thread = start_http_server(spec.prometheus_port, spec.prometheus_bind, self.registry)
        host, port = self.server.server_address[:2]
        self.where = f"http://{host!s}:{port}/metrics"

    def on_events(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self.events.labels(self.run, str(record.get("kind", "?"))).inc()

    def on_metrics(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            if record.get("kind") == "round":
                self._round(record)
        points = self.points.feed(records)
        if points:
            self.newest.point = points[-1]

    def _round(self, record: dict[str, Any]) -> None:
        for value, hist in ((record.get("merge_s"), self.merge), (record.get("grace_used_s"), self.grace)):
            v = number(value)
            if v is not None:
                hist.labels(self.run).observe(v)
        who = record.get("contributors")
        if isinstance(who, list):
            self.contributors.labels(self.run).observe(len(who))

    def tick(self, now: float) -> None:
        pass

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5.0)
