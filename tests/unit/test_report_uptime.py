"""`down`'s summary says how long the run ran (created -> stopped, as `dldctl runs` has its age),
not the uptime of the syncer that answered last: after a syncer restart that is a fraction of it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dldctl.lifecycle.down import _run_age, summary
from dldctl.rundir import RunDir
from dldctl.runstate import RunState


def snapshot(uptime_s: float) -> dict[str, Any]:
    """The parts of a syncer's status snapshot the summary reads (the restarted syncer's uptime)."""
    return {
        "syncer": {"outer_steps": 184},
        "goodput": 0.788,
        "tokens": {"trained": 5_242_368, "merged": 4_767_488},
        "loss": {"train": 1.68, "eval": 1.71, "global": 1.62},
        "bytes": {"up": 15_192_009, "down": 18_627_185, "ddp_equivalent": 25_890_308_096},
        "uptime_s": uptime_s,
    }


def run_dir(tmp_path: Path, created: float, stopped_at: float | None) -> RunDir:
    run = RunDir(tmp_path / "faults-20261202-140429")
    run.path.mkdir()
    run.write_state(RunState(status="down" if stopped_at else "stopping", created=created, stopped_at=stopped_at))
    return run


def test_uptime_is_the_runs_not_the_restarted_syncers(tmp_path: Path) -> None:
    run = run_dir(tmp_path, created=1_000.0, stopped_at=1_190.0)  # a 3 m 10 s run
    out = summary(run, snapshot(uptime_s=48.62), "", [])
    assert out["uptime_s"] == 190.0
    assert out["outer_steps"] == 184 and out["ddp_equivalent"] == 25_890_308_096


def test_uptime_without_a_stop_time_counts_to_now_and_without_a_state_is_unknown(tmp_path: Path) -> None:
    now = time.time()
    run = run_dir(tmp_path, created=now - 100.0, stopped_at=None)
    assert 99.0 <= summary(run, None, "", [])["uptime_s"] <= 160.0
    missing = RunDir(tmp_path / "never-created")
    assert summary(missing, snapshot(uptime_s=48.62), "", [])["uptime_s"] is None  # not the syncer's 48.62


def test_run_age() -> None:
    assert _run_age(10.0, 200.0) == 190.0
    assert _run_age(10.0, None) is None and _run_age(None, 200.0) is None
    assert _run_age(10.0, None, now=50.0) == 40.0 and _run_age(10.0, 30.0, now=50.0) == 20.0
