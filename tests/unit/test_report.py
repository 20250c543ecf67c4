"""`report` on a recorded run (a learner killed and restarted, a pause, a partition below quorum,
a syncer restart) writes the six plots and a summary with the run's numbers."""

from __future__ import annotations

import io
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console

from dldctl.commands.report import report_command
from dldctl.errors import RunError
from dldctl.observe.report import PLOTS, build_report, load_run

RECORDED = Path(__file__).resolve().parents[1] / "data" / "run_recorded"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def records(name: str) -> list[dict]:
    return [json.loads(line) for line in (RECORDED / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], str]:
    out = tmp_path_factory.mktemp("report")
    paths = build_report(RECORDED, out)
    return paths, (out / "summary.md").read_text()


def test_writes_every_plot_as_png(report: tuple[list[Path], str]) -> None:
    paths, _ = report
    assert [p.name for p in paths] == [*list(PLOTS), "summary.md"]
    for path in paths[:-1]:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC), path
        assert len(data) > 10_000, path  # a drawn plot, not an empty canvas


def test_summary_has_the_runs_numbers(report: tuple[list[Path], str]) -> None:
    _, summary = report
    metrics = records("metrics.jsonl")
    rounds = [m for m in metrics if m["kind"] == "round"]
    samples = [m for m in metrics if m["kind"] == "sample"]
    last = samples[-1]
    assert summary.startswith("# Run report: run_recorded")
    assert "| duration | 3m00s" in summary
    assert f"| merge rounds | {len(rounds)} (per fragment 0: 22, 1: 22, 2: 22, 3: 22) |" in summary
    counts = Counter(len(r["contributors"]) for r in rounds)
    assert f"min 3, max 4 (rounds by contributors 3: {counts[3]}, 4: {counts[4]})" in summary
    assert f"| goodput (whole run) | {100 * last['goodput']:.1f}%" in summary
    assert f"{last['tokens_trained']:,} / {last['tokens_merged']:,}" in summary
    trains = [s["loss_train"] for s in samples if s["loss_train"] is not None]
    assert f"| train loss (final / min) | {trains[-1]:.3f} / {min(trains):.3f} |" in summary
    assert "| data-parallel equivalent | 33.6 GB (348x what this run moved) |" in summary
    assert f"| outer steps | {last['outer_steps']} |" in summary
    events = Counter(e["kind"] for e in records("events.jsonl"))
    for kind in ("death", "fault_inject", "restart", "syncer_death", "quorum_lost", "supervisor_start"):
        assert f"| {kind} | {events[kind]} |" in summary
    for name in PLOTS:
        assert f"]({name})" in summary


def test_a_run_with_faults_plots_every_figure_and_says_what_is_missing(tmp_path: Path) -> None:
    paths = build_report(RECORDED.parent / "run_faults", tmp_path)
    for path in paths[:-1]:
        assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 10_000, path
    summary = paths[-1].read_text()
    assert "| no data (gaps, syncer restarts) | 1 stretch(es), 6.7 s |" in summary
    assert "| rollbacks | rollback to outer step 112, 247,168 merged tokens undone |" in summary
    assert "| data-parallel equivalent | 25.8 GB (771x what this run moved) |" in summary
    assert "(lowest 60 s window 96.4%)" in summary  # not the blind restarted syncer's 70.8%
    assert "![headline](headline.png)" in summary


def test_live_run_with_a_half_written_line(tmp_path: Path) -> None:
    run = tmp_path / "live-run"
    shutil.copytree(RECORDED, run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"t": 1764409400.0, "kind": "shiny_new_kind", "x": 1}\n')
        f.write('{"t": 1764409401.0, "kind": "round", "fragment": 0, "contri')  # the syncer is mid-write
    with (run / "events.jsonl").open("a") as f:
        f.write("not json\n[1, 2]\n")
    loaded = load_run(run)
    assert len(loaded.rounds) == 88 and loaded.name == "live-run"
    paths = build_report(run, tmp_path / "out")
    assert all(p.exists() for p in paths)


def test_no_metrics_yet_is_a_run_error(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="no metrics yet"):
        build_report(tmp_path, tmp_path / "out")
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "events.jsonl").write_text('{"t": 1.0, "kind": "syncer_start", "target": "syncer", "detail": ""}\n')
    with pytest.raises(RunError, match="no metrics yet"):
        build_report(tmp_path, tmp_path / "out")
    with pytest.raises(RunError, match="does not exist"):
        build_report(tmp_path / "nope", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_sparse_run_still_plots(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"t": 10.0, "kind": "sample", "goodput": 0.0, "loss_train": None, "learners": {}}) + "\n"
    )
    paths = build_report(tmp_path, tmp_path / "out")
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in paths[:-1])
    assert "No events recorded." in paths[-1].read_text()


def test_report_command_defaults_to_run_dir_report(tmp_path: Path) -> None:
    run = tmp_path / "run_recorded"
    shutil.copytree(RECORDED, run)
    out = io.StringIO()
    paths = report_command(run, None, console=Console(file=out, width=200))
    assert paths[-1] == run / "report" / "summary.md"
    assert "summary.md" in out.getvalue() and "quorum.png" in out.getvalue()


def test_report_json_is_one_object_listing_the_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run_recorded"
    shutil.copytree(RECORDED, run)
    paths = report_command(run, tmp_path / "out", json_out=True)
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "dldctl.report/1" and doc["run"] == "run_recorded" and doc["out"] == str(tmp_path / "out")
    assert doc["files"] == [str(p) for p in paths] and doc["files"][-1].endswith("summary.md")
