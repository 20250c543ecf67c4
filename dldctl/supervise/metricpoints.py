"""A run's metrics records as named scalars, the one shape every sink writes (pure, no I/O).

The syncer's metrics.jsonl holds a "sample" every couple of seconds (the headline figures) and a
"round" per merged fragment. `Points.feed` turns them into `Point`s, one per sample: the sample's
figures plus the rounds merged since the previous sample (mean and max merge latency, grace used,
contributors), so that rounds, which come many per second, do not each become a data point.

Names are slash-separated (TensorBoard groups by the first part; Prometheus and W&B take them as
they are). Nothing is invented for a figure the run does not have: a null loss is left out, not 0.
The step is whole seconds since the run was created, so it keeps rising across syncer restarts
(a restarted syncer's own counters start again; tokens and outer steps can go back at a rollback).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

# sample key -> scalar name
SAMPLE_SCALARS = {
    "goodput": "fleet/goodput",
    "goodput_window": "fleet/goodput_window",
    "tokens_per_s": "fleet/tokens_per_s",
    "tokens_trained": "fleet/tokens_trained",
    "tokens_merged": "fleet/tokens_merged",
    "quorum_live": "quorum/live",
    "quorum_min": "quorum/min",
    "outer_steps": "syncer/outer_steps",
    "bytes_up": "bytes/up",
    "bytes_down": "bytes/down",
    "ddp_equivalent": "bytes/ddp_equivalent",
    "loss_global": "loss/global",
    "loss_eval": "loss/eval",
    "loss_train": "loss/train",
    # the data ledger (docs/data.md), in samples only while it is on
    "data_epoch": "data/epoch",
    "data_merged_share": "data/merged_share",
    "data_in_flight": "data/in_flight",
    "data_lost": "data/lost",
    "data_reissued": "data/reissued",
    "data_merged_tokens": "data/merged_tokens",
}
LEARNER_SCALARS = {"tokens_per_s": "tokens_per_s", "loss": "loss", "blocked_frac": "blocked_frac", "step": "step"}


@dataclass(frozen=True)
class Point:
    """The scalars of one moment: `values` by name, at wall time `t` and step `step`."""

    t: float
    step: int
    values: dict[str, float]


def number(value: Any) -> float | None:
    """A finite int/float as a float; anything else (None, bool, NaN, text) as None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    f = float(value)
    return f if f == f and f not in (float("inf"), float("-inf")) else None


@dataclass
class _Rounds:
    """Rounds merged since the last sample."""

    merge_s: list[float] = field(default_factory=list)
    grace_used_s: list[float] = field(default_factory=list)
    contributors: list[float] = field(default_factory=list)

    def add(self, record: dict[str, Any]) -> None:
        for key, into in (("merge_s", self.merge_s), ("grace_used_s", self.grace_used_s)):
            v = number(record.get(key))
            if v is not None:
                into.append(v)
        who = record.get("contributors")
        if isinstance(who, list):
            self.contributors.append(float(len(who)))

    def values(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.merge_s:
            out["rounds/merge_latency_s"] = sum(self.merge_s) / len(self.merge_s)
            out["rounds/merge_latency_max_s"] = max(self.merge_s)
        if self.grace_used_s:
            out["rounds/grace_used_s"] = sum(self.grace_used_s) / len(self.grace_used_s)
        if self.contributors:
            out["rounds/contributors"] = sum(self.contributors) / len(self.contributors)
            out["rounds/count"] = float(len(self.contributors))
        return out


def sample_values(sample: dict[str, Any]) -> dict[str, float]:
    """The scalars of one "sample" record: the fleet's, each learner's (with the data ledger, its
    merged tokens: `learner/<id>/data_merged_tokens`), and the bandwidth ratio."""
    out = {name: v for key, name in SAMPLE_SCALARS.items() if (v := number(sample.get(key))) is not None}
    moved = (number(sample.get("bytes_up")) or 0.0) + (number(sample.get("bytes_down")) or 0.0)
    ddp = number(sample.get("ddp_equivalent"))
    if moved > 0 and ddp is not None:
        out["bytes/ddp_over_moved"] = ddp / moved
    learners = sample.get("learners")
    if isinstance(learners, dict):
        for lid, row in sorted(learners.items()):
            if not isinstance(row, dict):
                continue
            for key, name in LEARNER_SCALARS.items():
                v = number(row.get(key))
                if v is not None:
                    out[f"learner/{lid}/{name}"] = v
    by_learner = sample.get("data_tokens_by_learner")
    if isinstance(by_learner, dict):
        for lid, tokens in sorted(by_learner.items()):
            if (v := number(tokens)) is not None:
                out[f"learner/{lid}/data_merged_tokens"] = v
    return out


class Points:
    """Feeds metrics records in order; returns a Point per sample (step: seconds since `t0`)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self._rounds = _Rounds()

    def feed(self, records: list[dict[str, Any]]) -> list[Point]:
        out: list[Point] = []
        for record in records:
            kind = record.get("kind")
            if kind == "round":
                self._rounds.add(record)
            elif kind == "sample":
                t = number(record.get("t"))
                if t is None:
                    continue
                values = sample_values(record) | self._rounds.values()
                self._rounds = _Rounds()
                out.append(Point(t=t, step=max(0, int(t - self.t0)), values=values))
        return out


class PointSink(ABC):
    """A sink that writes one Point per metrics sample; subclasses say how (`write`)."""

    def __init__(self, t0: float) -> None:
        self.points = Points(t0)

    def on_events(self, records: list[dict[str, Any]]) -> None:  # noqa: B027 (points come from metrics only)
        pass

    def on_metrics(self, records: list[dict[str, Any]]) -> None:
        for point in self.points.feed(records):
            self.write(point)

    @abstractmethod
    def write(self, point: Point) -> None:
        """Write one point with the sink's library."""

    def tick(self, now: float) -> None:  # noqa: B027 (a sink with nothing to do on a tick)
        pass

    def close(self) -> None:  # noqa: B027 (a sink with nothing to release)
        pass
