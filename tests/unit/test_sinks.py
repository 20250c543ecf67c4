"""The metrics sinks' pure parts and the supervisor's feed: records to named scalars, Prometheus
families, the [metrics] table's errors, and reading each record once across rotation and restarts."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from dldctl import extras, inventory
from dldctl.errors import ConfigError
from dldctl.supervise.feeds import Feeds, Position, read_new
from dldctl.supervise.metricpoints import Point, Points, sample_values
from dldctl.supervise.sink_prom import families, metric_name

RECORDED = Path(__file__).resolve().parents[1] / "data" / "run_recorded" / "metrics.jsonl"


def sample(t: float, **extra: Any) -> dict[str, Any]:
    base = {"t": t, "kind": "sample", "goodput": 0.5, "bytes_up": 10, "bytes_down": 30, "ddp_equivalent": 4000}
    return base | extra


def test_a_sample_becomes_named_scalars_and_nothing_is_invented() -> None:
    values = sample_values(
        sample(1.0, loss_global=None, loss_eval=2.5, learners={"learner-0": {"tokens_per_s": 10.0, "loss": None}})
    )
    assert values["fleet/goodput"] == 0.5 and values["loss/eval"] == 2.5
    assert "loss/global" not in values, "a null loss is left out, not 0"
    assert values["bytes/ddp_over_moved"] == 100.0
    assert values["learner/learner-0/tokens_per_s"] == 10.0 and "learner/learner-0/loss" not in values


def test_rounds_are_aggregated_into_the_next_sample_and_steps_count_from_the_run_start() -> None:
    points = Points(t0=100.0)
    rounds = [{"kind": "round", "merge_s": m, "grace_used_s": 0.1, "contributors": ["a", "b"]} for m in (0.2, 0.4)]
    first = points.feed([*rounds, sample(102.7)])
    assert [p.step for p in first] == [2]
    assert first[0].values["rounds/merge_latency_s"] == pytest.approx(0.3)
    assert first[0].values["rounds/merge_latency_max_s"] == 0.4 and first[0].values["rounds/count"] == 2
    second = points.feed([sample(104.0)])
    assert "rounds/count" not in second[0].values, "the rounds are counted once"


def test_the_recorded_run_gives_one_point_per_sample_with_rising_steps() -> None:
    records = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    samples = [r for r in records if r["kind"] == "sample"]
    points = Points(t0=samples[0]["t"]).feed(records)
    assert len(points) == len(samples)
    steps = [p.step for p in points]
    assert steps == sorted(steps) and steps[-1] == int(samples[-1]["t"] - samples[0]["t"])


def test_prometheus_families_label_learners_and_leave_rounds_to_the_histograms() -> None:
    point = Point(t=10.0, step=0, values={"fleet/goodput": 0.9, "learner/l-1/loss": 2.0, "rounds/count": 3.0})
    fams = {f.name: f for f in families(point, "run-a", now=12.5)}
    assert metric_name("fleet/tokens_per_s") == "dldctl_fleet_tokens_per_s"
    assert fams["dldctl_fleet_goodput"].samples[0].labels == {"run": "run-a"}
    assert fams["dldctl_learner_loss"].samples[0].labels == {"run": "run-a", "learner": "l-1"}
    assert fams["dldctl_sample_age_seconds"].samples[0].value == 2.5
    assert not any(name.startswith("dldctl_rounds") for name in fams)
    assert families(None, "run-a", 0.0) == []


@pytest.mark.parametrize(
    ("table", "key", "words"),
    [
        ("tensorbord = true", "metrics.tensorbord", "did you mean 'tensorboard'"),
        ("prometheus_port = 70000", "metrics.prometheus_port", "not a port"),
        ('prometheus_bind = "localhost:9"', "metrics.prometheus_bind", "not an IP address"),
        ('wandb_mode = "cloud"', "metrics.wandb_mode", "offline, online"),
        ('prometheus_port = "9464"', "metrics.prometheus_port", "must be"),
    ],
)
def test_a_bad_metrics_table_is_one_line_naming_the_key(tmp_path: Path, table: str, key: str, words: str) -> None:
    path = tmp_path / "inv.toml"
    path.write_text(f'[[hosts]]\nname = "h"\naddress = "local"\n\n[metrics]\n{table}\n')
    with pytest.raises(ConfigError) as err:
        inventory.load(path)
    assert err.value.key == key and words in err.value.line(), err.value.line()


def test_the_metrics_table_survives_the_run_directorys_copy_and_names_its_extras(tmp_path: Path) -> None:
    path = tmp_path / "inv.toml"
    path.write_text('[[hosts]]\nname = "h"\naddress = "local"\n\n[metrics]\ntensorboard = true\nprometheus_port = 9\n')
    inv = inventory.load(path)
    assert inventory.parse(inventory.to_dict(inv), str(path)).metrics == inv.metrics
    assert extras.exporter_modules(inv) == [("tensorboard", "tensorboard"), ("prometheus_client", "prometheus_port")]
    assert inventory.default_inventory().metrics.any is False, "every exporter is off by default"


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.events: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []
        self.fail = fail

    def on_events(self, records: list[dict[str, Any]]) -> None:
        self.events += records

    def on_metrics(self, records: list[dict[str, Any]]) -> None:
        if self.fail:
            raise RuntimeError("exporter down")
        self.metrics += records

    def tick(self, now: float) -> None:
        pass

    def close(self) -> None:
        pass


def append(path: Path, *records: dict[str, Any], torn: str = "") -> None:
    with open(path, "a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records) + torn)


def test_each_record_is_handed_over_once_across_a_restart_and_a_rotation(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    append(metrics, {"n": 1}, {"n": 2}, torn='{"n": 3')  # a line still being written waits
    first = Recorder()
    Feeds(tmp_path, [first]).poll(0.0)
    assert [r["n"] for r in first.metrics] == [1, 2]
    with open(metrics, "a") as fh:
        fh.write("}\n")
    append(metrics, {"n": 4})
    os.replace(metrics, tmp_path / "metrics.jsonl.1")  # rotated before the next poll read the tail
    append(metrics, {"n": 5})
    again = Recorder()  # a restarted supervisor: its positions come from feeds.json
    feeds = Feeds(tmp_path, [again])
    for _ in range(3):
        feeds.poll(0.0)
    assert [r["n"] for r in again.metrics] == [3, 4, 5]


def test_a_failing_sink_is_reported_once_and_the_others_still_get_their_records(tmp_path: Path) -> None:
    append(tmp_path / "metrics.jsonl", {"n": 1})
    lines: list[str] = []
    good, bad = Recorder(), Recorder(fail=True)
    feeds = Feeds(tmp_path, [bad, good], report=lines.append)
    feeds.poll(0.0)
    append(tmp_path / "metrics.jsonl", {"n": 2})
    feeds.poll(0.0)
    assert [r["n"] for r in good.metrics] == [1, 2]
    assert feeds.failures == 2 and len(lines) == 1 and "exporter down" in lines[0]


def test_a_missing_file_is_no_error_and_is_read_from_its_start_once_it_appears(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    assert read_new(path, Position()) == ([], Position())
    append(path, {"k": "a"})
    records, at = read_new(path, Position())
    assert records == [{"k": "a"}] and at.offset == path.stat().st_size


def test_up_refuses_a_prometheus_port_in_use_before_it_creates_a_run(tmp_path: Path) -> None:
    from dldctl.supervise.sinks import preflight

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = tmp_path / "inv.toml"
        path.write_text(f'[[hosts]]\nname = "h"\naddress = "local"\n\n[metrics]\nprometheus_port = {port}\n')
        inv = inventory.load(path)
        with pytest.raises(ConfigError) as err:
            preflight(inv)
        assert err.value.key == "metrics.prometheus_port" and f"127.0.0.1:{port}" in err.value.line()
    preflight(inv)  # free again: no error
