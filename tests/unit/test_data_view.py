"""The data ledger where the operator looks: `dldctl status` (live and `--once`) renders the
snapshot's `data` as one line and each learner's merged tokens, and nothing without it; `--json`
keeps it (from the last sample while the syncer is down); `dldctl report` has a "Data" section;
the exporters carry `data/...` scalars (`dldctl_data_...` gauges)."""

from __future__ import annotations

import copy
import io
import json
import socket
from pathlib import Path

import pytest
from rich.console import Console

from dldctl import rundir
from dldctl.observe import report, snapshot
from dldctl.observe.snapshot_model import Snapshot
from dldctl.observe.view import History, plan_sections, render_live, render_plain
from dldctl.observe.view_ledger import data_text
from dldctl.runstate import Proc, ProcStatus, RunState
from dldctl.supervise.metricpoints import Points, sample_values
from syncer.common import jsonl

SNAPSHOTS = Path(__file__).resolve().parents[1] / "data" / "snapshots"
DATA = {
    "order": "ledger",
    "epoch": 1,
    "units": 412,
    "unit_tokens": 16384,
    "merged": 180,
    "partial": 2,
    "merged_share": 0.4417,
    "in_flight": 9,
    "queued_again": 1,
    "lost": 7,
    "reissued": 6,
    "epochs_done": 0,
    "merged_tokens": 2949120,
    "tokens_by_learner": {"learner-0": 1228800, "learner-1": 614400},
    "off_ledger_tokens": 0,
}
HEADLINE = "epoch 1 · 44.2% merged · 9 in flight · 7 lost → 6 reissued"


def snap(data: dict | None = DATA) -> dict:
    out = json.loads((SNAPSHOTS / "recorded_healthy.json").read_text())
    out["data"] = copy.deepcopy(data)
    return out


def live(snapshot_: dict, width: int = 100, height: int = 34) -> str:
    console = Console(record=True, width=width, height=height, file=io.StringIO())
    history = History()
    history.add(snapshot_)
    console.print(render_live(snapshot_, history, snapshot_["now"]))
    return console.export_text()


def plain(snapshot_: dict) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render_plain(snapshot_, snapshot_["now"]))
    return console.export_text()


def test_the_live_view_has_the_ledgers_line_and_each_learners_merged_tokens() -> None:
    text = live(snap())
    assert "─ data ledger" in text and HEADLINE in text and "182/412 units" in text
    header = next(row for row in text.splitlines() if " learner " in row and " hb " in row)
    assert " merged " in header
    rows = {row.split()[1]: row for row in text.splitlines() if row.startswith("│ learner-")}
    assert "1.2M" in rows["learner-0"] and "614.4k" in rows["learner-1"] and " 0 " in rows["learner-2"]


@pytest.mark.parametrize("width", [80, 60, 40])
def test_a_narrow_terminal_keeps_whole_figures(width: int) -> None:
    text = live(snap(), width=width, height=24)
    line = next(row for row in text.splitlines() if "epoch 1 · 44.2%" in row)
    assert "…" not in line  # parts drop whole, never a figure's digits
    if width >= 62:
        assert HEADLINE in line


def test_without_a_ledger_the_view_shows_none_of_it() -> None:
    for data in (None, "missing"):
        s = snap(None)
        if data == "missing":
            del s["data"]  # a syncer from before the ledger
        text, once = live(s), plain(s)
        assert "data ledger" not in text and " merged " not in text.split("─ learners")[1].splitlines()[1]
        assert "\ndata " not in once and data_text(Snapshot.from_json(s)) == ""
    assert "data" not in plan_sections(40, 4) and plan_sections(40, 4, data=True)["data"] == 3


def test_once_has_a_data_row_and_a_merged_column() -> None:
    text = plain(snap({**DATA, "off_ledger_tokens": 4096}))
    row = next(r for r in text.splitlines() if r.startswith("data "))
    assert HEADLINE in row and "1 queued again" in row and "2.9M tokens" in row and "2 partly merged" in row
    assert "4.1k tokens off the ledger" in row
    table = next(r for r in text.splitlines() if r.startswith("learner ") and " hb" in r)
    assert " merged " in table


# ---------------------------------------------------------------- --json: the snapshot


@pytest.fixture()
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> rundir.RunDir:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    run = rundir.create("ledger")
    syncer = {"advertise": "127.0.0.1", "port": 1, "control_port": closed}
    run.config.write_text(
        json.dumps({"version": 1, "run_id": "l-1", "run": {"insecure": True}, "syncer": syncer, "learners": []})
    )
    with run.locked():
        run.write_state(
            RunState(status="up", created=1000.0, procs={"syncer": Proc("syncer", "local", ProcStatus.DEAD)})
        )
    return run


def test_json_with_the_syncer_down_keeps_the_ledger_of_its_last_sample(
    run: rundir.RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "syncer_status", lambda *_a, **_k: None)  # down: no 2 s wait for it
    assert snapshot.collect(run, now=1100.0)["data"] is None  # no sample: no ledger to speak of
    flat = {"data_epoch": 2, "data_merged_share": 0.5, "data_in_flight": 3, "data_lost": 4, "data_reissued": 4}
    jsonl.append(run.metrics, {"t": 1090.0, "kind": "sample", **flat, "data_merged_tokens": 10})
    data = snapshot.collect(run, now=1100.0)["data"]
    assert data == {
        "order": "ledger",
        "epoch": 2,
        "merged_share": 0.5,
        "in_flight": 3,
        "lost": 4,
        "reissued": 4,
        "merged_tokens": 10,
    }
    said = data_text(Snapshot.from_json({"data": data}))
    assert said == "epoch 2 · 50.0% merged · 3 in flight · 4 lost → 4 reissued · 10 tokens"


# ---------------------------------------------------------------- report and exports


SAMPLE = {
    "t": 1010.0,
    "kind": "sample",
    "goodput": 0.7,
    "data_epoch": 2,
    "data_merged_share": 0.25,
    "data_in_flight": 5,
    "data_lost": 12,
    "data_reissued": 11,
    "data_merged_tokens": 4_000_000,
    "data_tokens_by_learner": {"learner-10": 1_000_000, "learner-2": 3_000_000},
}


def write_run(where: Path, samples: list[dict], events: list[dict]) -> Path:
    where.mkdir()
    (where / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    (where / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in events))
    return where


def event(t: float, kind: str, target: str = "syncer") -> dict:
    return {"t": t, "kind": kind, "target": target, "detail": "..."}


def test_the_report_has_a_data_section_with_the_final_numbers(tmp_path: Path) -> None:
    events = [event(1001, "units_requeued", "learner-2"), event(1002, "units_requeued"), event(1003, "epoch_done")]
    early = {"t": 1000.0, "kind": "sample", "data_epoch": 1, "data_merged_share": 0.9}
    run = report.load_run(write_run(tmp_path / "r", [early, SAMPLE, {"t": 1020.0, "kind": "sample"}], events))
    rows = dict(report.data_rows(run))
    assert rows["data epoch"] == "2 (1 merged whole)" and rows["units of this epoch merged"] == "25.0%"
    assert rows["units in flight"] == "5" and rows["units lost / reissued (run total)"] == "12 / 11"
    assert rows["tokens merged by the ledger"] == "4,000,000"
    assert rows["tokens merged per learner"] == "learner-2: 3,000,000, learner-10: 1,000,000"
    assert rows["ledger events"] == "epoch_done 1, units_requeued 2, units_partial 0, data_mismatch 0"
    report.write_summary(run, tmp_path / "summary.md")
    text = (tmp_path / "summary.md").read_text()
    assert "## Data" in text and "| units in flight | 5 |" in text


def test_a_run_without_the_ledger_has_no_data_section(tmp_path: Path) -> None:
    run = report.load_run(write_run(tmp_path / "r", [{"t": 1.0, "kind": "sample", "goodput": 0.5}], []))
    assert report.data_rows(run) == []
    report.write_summary(run, tmp_path / "summary.md")
    assert "## Data" not in (tmp_path / "summary.md").read_text()


def test_the_exports_carry_the_ledgers_figures() -> None:
    values = sample_values(SAMPLE)
    assert {k: v for k, v in values.items() if k.startswith("data/")} == {
        "data/epoch": 2.0,
        "data/merged_share": 0.25,
        "data/in_flight": 5.0,
        "data/lost": 12.0,
        "data/reissued": 11.0,
        "data/merged_tokens": 4_000_000.0,
    }
    assert values["learner/learner-2/data_merged_tokens"] == 3_000_000.0
    assert not any(k.startswith("data/") for k in sample_values({"t": 1.0, "kind": "sample", "goodput": 0.5}))
    pytest.importorskip("prometheus_client")
    from dldctl.supervise.sink_prom import families

    (point,) = Points(1000.0).feed([SAMPLE])
    fams = {f.name: f for f in families(point, "run-a", 1012.0)}
    for name in ("epoch", "merged_share", "in_flight", "lost", "reissued", "merged_tokens"):
        assert fams[f"dldctl_data_{name}"].samples[0].labels == {"run": "run-a"}
    merged = {s.labels["learner"]: s.value for s in fams["dldctl_learner_data_merged_tokens"].samples}
    assert merged == {"learner-10": 1_000_000.0, "learner-2": 3_000_000.0}


def test_json_passes_shard_zeros_ledger_through(run: rundir.RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    answer = {"syncer": {"alive": True, "address": "tcp://127.0.0.1:1"}, "learners": [], "data": DATA}
    monkeypatch.setattr(snapshot, "syncer_status", lambda *_a, **_k: copy.deepcopy(answer))
    assert snapshot.collect(run, now=1100.0)["data"] == DATA
    monkeypatch.setattr(snapshot, "syncer_status", lambda *_a, **_k: {**answer, "data": None})
    assert snapshot.collect(run, now=1100.0)["data"] is None  # the ledger is off (data_order = "shards")
    older = {k: v for k, v in answer.items() if k != "data"}
    monkeypatch.setattr(snapshot, "syncer_status", lambda *_a, **_k: copy.deepcopy(older))
    assert snapshot.collect(run, now=1100.0)["data"] is None  # a syncer from before the ledger
