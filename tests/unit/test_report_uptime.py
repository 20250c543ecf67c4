"""`down`'s summary says how long the run ran (created -> stopped, as `dldctl runs` has its age),
not the uptime of the syncer that answered last: after a syncer restart that is a fraction of it."""

from __future__ import annotations

import time
from pathlib import Path

from dldctl.lifecycle.down import _run_age, summary
from dldctl.observe.snapshot_model import Snapshot
from dldctl.rundir import RunDir
from dldctl.runstate import RunState


def snapshot(uptime_s: float, loss_global: float = 1.62) -> Snapshot:
    """The parts of a syncer's status snapshot the summary reads (the restarted syncer's uptime)."""
    return Snapshot.from_json(
        {
            "syncer": {"outer_steps": 184},
            "goodput": 0.788,
            "tokens": {"trained": 5_242_368, "merged": 4_767_488},
            "loss": {"train": 1.68, "eval": 1.71, "global": loss_global},
            "bytes": {"up": 15_192_009, "down": 18_627_185, "ddp_equivalent": 25_890_308_096},
            "uptime_s": uptime_s,
        }
    )


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


def test_down_says_the_final_score_the_one_runs_and_export_read(tmp_path: Path) -> None:
    """The syncer's last answer came before its final score; the metrics log's newest sample,
    written as it shut down, has it: `down` says that one, as `dldctl runs` does."""
    from dldctl.observe import runs
    from syncer.common import jsonl

    run = run_dir(tmp_path, created=1_000.0, stopped_at=1_190.0)
    final = {"t": 1_189.0, "kind": "sample", "outer_steps": 186, "goodput": 0.8341, "loss_global": 2.3076}
    final |= {"tokens_trained": 5_300_000, "tokens_merged": 4_800_000, "loss_train": None, "loss_eval": None}
    final |= {"bytes_up": 15_674_960, "bytes_down": 18_700_000, "ddp_equivalent": 26_000_000_000}
    jsonl.append(run.metrics, {"t": 1_100.0, "kind": "sample", "outer_steps": 100, "loss_global": 2.9})
    jsonl.append(run.metrics, final)
    jsonl.append(run.metrics, {"t": 1_189.5, "kind": "round", "outer_steps": 186})
    answered = snapshot(uptime_s=48.62, loss_global=2.361)  # scored before the last rounds closed
    out = summary(run, answered, "", [])
    assert out["loss_global"] == 2.3076 == runs.row(run, 1_200.0)["loss_global"]
    assert out["outer_steps"] == 186 and out["goodput"] == 0.8341 and out["bytes_up"] == 15_674_960
    assert (out["loss_train"], out["loss_eval"]) == (1.68, 1.71)  # the learners' own, from while they ran


def test_down_prints_its_figures_for_people() -> None:
    """`down` without --json: percent, MB/GB, a duration, "none" for nothing killed."""
    from dldctl.commands.run import summary_rows

    raw = {"run": "r", "final_model": None, "killed": [], "goodput": 0.8341, "bytes_up": 15_674_960}
    raw |= {"ddp_equivalent": 25_890_308_096, "tokens_merged": 4_767_488, "loss_global": 2.3076, "uptime_s": 190.0}
    rows = dict(summary_rows(raw))
    assert rows["goodput"] == "83.4%" and rows["bytes_up"] == "15.7 MB" and rows["ddp_equivalent"] == "25.9 GB"
    assert rows["killed"] == "none" and rows["final_model"] == "none" and rows["tokens_merged"] == "4.8M"
    assert rows["loss_global"] == "2.3076" and rows["uptime"] == "3m10s"
    assert dict(summary_rows({"killed": ["learner-1", "syncer"]}))["killed"] == "learner-1, syncer"
