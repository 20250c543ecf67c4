"""bench/shard_transfer.py's harness, small: two real shard processes of one run (gpt-tiny
shapes, CURVE), learner-0 uploading through the real `SyncerLink`, then fresh joiners fetching
from both shards at once, each shard's time and bytes measured, and the raw TCP baselines."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import loadgen_core as core
from bench import shard_transfer

pytestmark = pytest.mark.timeout(120)


def test_a_joiner_fetches_from_every_shard_and_the_baselines_run(tmp_path: Path) -> None:
    specs = core.manifest("gpt-tiny")
    run = shard_transfer.run_settings("gpt-tiny", 4, {})
    series = shard_transfer.measure(2, specs, run, times=2, tmp=str(tmp_path))
    assert series.shards == 2 and len(series.fetches) == 2
    assert sum(series.bytes_per_shard) == 4 * core.param_count(specs) and all(series.bytes_per_shard)
    for fetch in series.fetches:
        assert len(fetch.per_shard) == 2 and 0 < min(fetch.per_shard) <= fetch.total == max(fetch.per_shard)
    assert len(series.tcp_one) == 2 and all(len(t) == 2 and min(t) > 0 for t in series.tcp_all)
    row = shard_transfer.row(series)
    assert row["aggregate MB/s"] > 0 and row["per shard vs tcp stream"] > 0
    assert not list(tmp_path.iterdir()), "the run directory is removed"
