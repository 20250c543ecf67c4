"""The metrics exporters with the real libraries on a real local fleet: Prometheus scraped over
HTTP and parsed by prometheus_client's own parser, TensorBoard read back by TensorBoard's own
reader, W&B written by wandb in offline mode. The supervisor is killed once mid-run: the watchdog's
new supervisor serves the endpoint again and goes on where the old one stopped (no sample twice,
none lost), and `down` hands the run's last records over, so the export ends where the run did.
"""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from dldctl.ports import free_port
from dldctl.testing import DldctlHome, alive, inventory_text, local_host, read_jsonl, wait_until
from tests.e2e.fleetutil import run_table

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def scrape(port: int) -> dict[str, list[Any]]:
    """The endpoint's samples by name, parsed by the Prometheus client's own parser ({} if down)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar, read back by TensorBoard's own event reader."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea
    from tensorboard.util import tensor_util

    acc = pea.EventAccumulator(str(logdir), size_guidance={pea.TENSORS: 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars", tag
        out[tag] = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
    return out


def test_prometheus_tensorboard_and_wandb_see_the_run(tmp_path: Path) -> None:
    port = free_port()
    inv = tmp_path / "inv.toml"
    inv.write_text(
        run_table("exports", quorum=1)
        + inventory_text({}, [local_host("here", 2)]).split("\n", 1)[1]
        + f"\n[metrics]\ntensorboard = true\nprometheus_port = {port}\nwandb = true\n"
    )
    with DldctlHome(tmp_path / "home") as dl:
        said = dl("up", str(inv), "-d", "--wait")
        assert f"metrics: Prometheus on http://127.0.0.1:{port}/metrics" in said.stdout + said.stderr
        run = dl.latest_run()
        assert run is not None
        first = wait_until(
            lambda: (m := scrape(port)) and len(m.get("dldctl_learner_tokens_per_s", [])) == 2 and m, 90, "a scrape"
        )
        assert {s.labels["learner"] for s in first["dldctl_learner_tokens_per_s"]} == {"learner-0", "learner-1"}
        assert all(s.labels["run"] == run.name for s in first["dldctl_fleet_goodput"])
        assert first["dldctl_round_merge_seconds_count"][0].value > 0
        assert first["dldctl_sample_age_seconds"][0].value < 10
        assert first["dldctl_events_total"], "events are counted by kind"

        # the watchdog's new supervisor serves again and goes on from where the killed one stopped
        old = dl.state().supervisor
        assert old is not None
        os.kill(old.pid, signal.SIGKILL)
        wait_until(lambda: not alive(old.pid, old.start_ticks), 10, "the supervisor to die")
        wait_until(lambda: (s := dl.state().supervisor) and s.pid != old.pid, 30, "a new supervisor")
        name = "dldctl_fleet_tokens_merged"
        merged = first[name][0].value
        # the new supervisor serves from its first sample on: a scrape before it has no fleet figures yet
        wait_until(
            lambda: (m := scrape(port).get("dldctl_fleet_tokens_merged")) and m[0].value > merged, 60, "new figures"
        )
        dl.down()

    samples = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "sample"]
    scalars = tensorboard_scalars(run / "tensorboard")
    goodput = scalars["fleet/goodput"]
    # each sample once (a SIGKILL between handing over and saving the position may repeat one)
    assert len(samples) <= len(goodput) <= len(samples) + 1, (len(samples), len(goodput))
    assert [s for s, _ in goodput] == sorted(s for s, _ in goodput), "steps only rise"
    assert goodput[-1][1] == pytest.approx(samples[-1]["goodput"], rel=1e-6), "down hands over the last sample"
    assert {"loss/global", "quorum/live", "bytes/ddp_over_moved", "rounds/merge_latency_s"} <= set(scalars)
    assert {"learner/learner-0/tokens_per_s", "learner/learner-1/tokens_per_s"} <= set(scalars)

    wandb_files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert wandb_files, "wandb wrote an offline run"
    assert any(b"fleet/goodput" in f.read_bytes() for f in wandb_files)
    assert all(run.name in f.name for f in wandb_files), "one W&B run id for the whole dldctl run"
