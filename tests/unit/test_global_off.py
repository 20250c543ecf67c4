"""A run whose global model is not scored says so, and why, everywhere: the reasons and how they
are read back (syncer/common/unscored.py), the syncer's status snapshot and metrics sample, the
export's config.json, the live and plain views, `dldctl runs`, `dldctl report`, `dldctl export`'s
document and `up --wait`'s warning. Pure parts and run directories written here; the real
syncer is tests/integration/test_global_off.py."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from dldctl import rundir
from dldctl.commands.run import global_off_settled, global_off_warning
from dldctl.observe import report, runs
from dldctl.observe.view import render_live, render_plain
from dldctl.runstate import RunState
from syncer import checkpoint
from syncer.common import modelexport, strictjson, unscored
from syncer.common.resolved import ResolvedConfig, SyncerSection
from syncer.common.settings import RunSettings
from syncer.core import Outbox
from syncer.evaluator import GlobalEvaluator, Scoring
from syncer.shardscore import ShardScoring
from syncer.status import sample_record, snapshot
from tests.unit.coreharness import Harness, events_of, make_settings
from tests.unit.test_view import history_of, load

BUILD = "cannot build the model on the syncer: ModuleNotFoundError: No module named 'nosuch_mod'"


class _Broken:
    """The evaluator's seam (syncer/evaluator.py) as one that could not build its model."""

    def __init__(self, problem: str | None) -> None:
        self.problem, self.busy = problem, False

    def results(self) -> list[Any]:
        return []

    def submit(self, snap: Any) -> bool:
        return False


# ---------------------------------------------------------------- the reasons (pure)


def test_each_reason_has_a_short_form_and_the_settings_one_is_on_purpose() -> None:
    assert unscored.words(BUILD)[0] == "cannot build model (ModuleNotFoundError)"
    assert unscored.words(unscored.event_detail(BUILD))[0] == "cannot build model (ModuleNotFoundError)"
    old_event = "cannot score the global model on the syncer: ImportError: boom; make the model factory importable"
    assert unscored.words(old_event)[0] == "cannot build model (ImportError)"
    assert unscored.words("scoring failed: RuntimeError: shapes")[0] == "scoring failed"
    assert unscored.words(unscored.elsewhere(1))[0] == "shards on other hosts"
    assert unscored.words(unscored.EVERY_OFF)[0] == unscored.EVERY_OFF
    assert unscored.words("something new: details") == ("something new: details", "something new")
    assert unscored.on_purpose(unscored.EVERY_OFF) and not unscored.on_purpose(BUILD)
    assert "importable" in unscored.event_detail(BUILD) and BUILD in unscored.event_detail(BUILD)
    assert unscored.fix(unscored.EVERY_OFF) == ""


def _sample(t: float, **kw: Any) -> dict[str, Any]:
    return {"t": t, "kind": "sample", "loss_global": None, **kw}


OFF_EVENT = {"t": 5.0, "kind": "global_eval_off", "target": "syncer", "detail": unscored.event_detail(BUILD)}


@pytest.mark.parametrize(
    ("samples", "events", "every", "expected"),
    [
        ([_sample(1.0, global_off=None, loss_global=2.0)], [], 0, unscored.EVERY_OFF),  # the settings first
        ([_sample(1.0, global_off=BUILD)], [], None, BUILD),  # the syncer's own word
        ([_sample(9.0, global_off=None)], [OFF_EVENT], None, None),  # the newest sample says it is scored
        ([_sample(9.0)], [OFF_EVENT], None, OFF_EVENT["detail"]),  # an older run: its event
        ([_sample(9.0, loss_global=2.1)], [OFF_EVENT], 32, None),  # a score after the event
        ([_sample(1.0, loss_global=2.1)], [OFF_EVENT], 32, OFF_EVENT["detail"]),  # ... not before it
        ([], [], 32, None),  # nothing says it is not scored
    ],
)
def test_the_reason_is_read_back_from_what_a_run_left(
    samples: list[dict], events: list[dict], every: int | None, expected: str | None
) -> None:
    assert unscored.from_records(samples, events, every) == expected


# ---------------------------------------------------------------- the syncer


def test_a_syncer_that_cannot_build_the_model_says_why_in_status_samples_and_one_event() -> None:
    h = Harness(make_settings(quorum=2))
    h.join_all()
    scoring = Scoring(_Broken(BUILD))  # type: ignore[arg-type]
    outs = [Outbox(), Outbox()]
    scoring.tick(h.core, 1.0, outs[0])
    scoring.tick(h.core, 2.0, outs[1])
    (event,) = events_of(outs[0], "global_eval_off") + events_of(outs[1], "global_eval_off")
    assert BUILD in event["detail"] and "importable" in event["detail"]
    snap = snapshot(h.core, 2.0)
    assert snap["loss"]["global"] is None and snap["loss"]["global_off"] == BUILD
    assert snap["guard"]["off"] == BUILD
    assert sample_record(snap, 2.0, {})["global_off"] == BUILD


def test_the_settings_turning_scoring_or_the_guard_off_are_said_as_such() -> None:
    h = Harness(make_settings(quorum=2, global_eval_every=0))
    assert snapshot(h.core, 1.0)["loss"]["global_off"] == unscored.EVERY_OFF  # before any tick
    scoring = Scoring(None)
    scoring.tick(h.core, 1.0, Outbox())
    assert scoring.off == unscored.EVERY_OFF and snapshot(h.core, 1.0)["guard"]["off"] == unscored.EVERY_OFF
    guarded = Harness(make_settings(quorum=2, quality_guard=0.0))
    Scoring(_Broken(None)).tick(guarded.core, 1.0, Outbox())  # type: ignore[arg-type]
    snap = snapshot(guarded.core, 1.0)
    assert snap["loss"]["global_off"] is None and snap["guard"]["off"] == unscored.GUARD_OFF


def test_a_scorer_that_works_or_still_builds_leaves_the_reason_null() -> None:
    h = Harness(make_settings(quorum=2))
    Scoring(_Broken(None)).tick(h.core, 1.0, Outbox())  # type: ignore[arg-type]
    snap = snapshot(h.core, 1.0)
    assert snap["loss"]["global_off"] is None and snap["guard"]["off"] is None


def test_a_sharded_syncer_with_a_shard_elsewhere_says_so() -> None:
    h = Harness(make_settings(quorum=2))
    scoring = ShardScoring(_Broken(None), 4, elsewhere=1)  # type: ignore[arg-type]
    out = Outbox()
    scoring.tick(h.core, 1.0, out)
    assert snapshot(h.core, 1.0)["loss"]["global_off"] == unscored.elsewhere(1)
    assert "another host" in events_of(out, "global_eval_off")[0]["detail"]


def test_the_real_evaluator_names_the_build_failure() -> None:
    ev = GlobalEvaluator(RunSettings(model="nosuch_mod_xyz:factory").to_dict())
    ev.start()
    ev.join(timeout=30)
    assert ev.problem is not None and ev.problem.startswith(unscored.BUILD) and "nosuch_mod_xyz" in ev.problem
    assert Scoring(ev).off == ev.problem


# ---------------------------------------------------------------- the export


def test_an_export_without_a_loss_says_why() -> None:
    def cfg(loss: float | None, said: str | None, every: int = 32) -> dict[str, Any]:
        return modelexport.model_config(
            run="r",
            settings={"model": "gpt-tiny", "global_eval_every": every},
            shapes={"w": (2, 2)},
            outer_step=4,
            tokens_merged=None,
            held_out_loss=loss,
            source="s",
            created=1.0,
            held_out_loss_missing=said,
        )

    assert cfg(2.5, "ignored")["held_out_loss_missing"] is None
    assert cfg(None, BUILD)["held_out_loss_missing"] == BUILD
    assert cfg(None, None, every=0)["held_out_loss_missing"] == unscored.EVERY_OFF
    assert cfg(None, None)["held_out_loss_missing"] == "not scored"
    assert modelexport.no_final_loss(None, 4) == "the global model was never scored"
    assert "outer step 3" in modelexport.no_final_loss({"outer_step": 3, "good": True}, 4)
    assert "flagged" in modelexport.no_final_loss({"outer_step": 4, "good": False, "loss": 9.0}, 4)


def test_the_syncers_own_export_carries_the_reason(tmp_path: Path) -> None:
    h = Harness(make_settings(quorum=2))
    h.join_all()
    Scoring(_Broken(BUILD)).tick(h.core, 1.0, Outbox())  # type: ignore[arg-type]
    directory, _ = checkpoint.export_model(h.core, tmp_path / "final_model.pt")
    config = modelexport.read_config(directory / modelexport.CONFIG)
    assert config["held_out_loss"] is None and config["held_out_loss_missing"] == BUILD


# ---------------------------------------------------------------- the views


def _off(reason: str) -> dict[str, Any]:
    snap = load("healthy")
    snap["loss"] = {**snap["loss"], "global": None, "global_off": reason}
    return snap


def _live(snap: dict[str, Any], width: int = 100, height: int = 30) -> str:
    console = Console(record=True, width=width, height=height, file=io.StringIO())
    console.print(render_live(snap, history_of(snap), snap["now"]))
    return console.export_text()


def _plain(snap: dict[str, Any]) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render_plain(snap, snap["now"]))
    return console.export_text()


def test_the_live_view_says_global_off_with_a_short_reason_and_the_full_one_in_the_header() -> None:
    live = _live(_off(BUILD), width=200, height=40)
    assert "global off: cannot build model (ModuleNotFoundError)" in live
    assert "global model not scored, quality guard off: cannot build the model" in live
    narrow = _live(_off(BUILD))  # 100 columns: a shorter form, never the bare dash
    assert "global off: cannot build model" in narrow and "global -" not in narrow
    on_purpose = _live(_off(unscored.EVERY_OFF), width=200, height=40)
    assert "global off: global_eval_every = 0" in on_purpose and "not scored, quality guard off" not in on_purpose
    assert "global off" not in _live(load("healthy"))


def test_the_plain_view_says_it_on_the_loss_line_and_in_the_notes() -> None:
    plain = _plain(_off(BUILD))
    assert "global off: cannot build model (ModuleNotFoundError)" in plain
    assert f"quality guard off: {BUILD}" in plain
    assert "global off" not in _plain(load("healthy"))


# ---------------------------------------------------------------- runs, report, export, up --wait


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> rundir.RunDir:
    """A run that is down, with its config.json and a metrics log whose samples say why."""
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path / "home"))
    made = rundir.create("off")
    with made.locked():
        made.write_state(RunState(status="down", run="off", created=1.0, stopped_at=2.0))
    settings = RunSettings(name="off", model="gpt-tiny", seq_len=32, batch_size=8, eval_batches=2, fragments=4)
    made.write_config(ResolvedConfig(run_id="off-1", run=settings, syncer=SyncerSection(port=1, control_port=2)))
    samples = [_sample(float(t), global_off=BUILD, loss_eval=2.5, outer_steps=t) for t in (1, 2, 3)]
    made.metrics.write_text("".join(strictjson.dumps(s) + "\n" for s in samples))
    made.events.write_text(strictjson.dumps(OFF_EVENT) + "\n")
    return made


def test_runs_shows_why_instead_of_a_blank_loss(run: rundir.RunDir) -> None:
    row = runs.row(run, 10.0)
    assert row["global_off"] == BUILD and row["loss_global"] is None and row["loss_eval"] == 2.5
    assert runs.loss_cell(row) == "2.500 [yellow]global off: cannot build model (ModuleNotFoundError)[/]"
    assert runs.loss_cell({"loss_eval": 2.4, "global_off": None}) == "2.400"
    assert runs.loss_cell({"loss_eval": None, "global_off": "odd [x]"}).startswith("[yellow]global off: odd \\[x]")


def test_an_older_run_falls_back_to_its_event_and_its_settings(run: rundir.RunDir) -> None:
    run.metrics.write_text(strictjson.dumps(_sample(9.0)) + "\n")  # samples from before `global_off`
    assert runs.unscored_reason(run) == OFF_EVENT["detail"]
    run.events.write_text("")
    assert runs.unscored_reason(run) is None
    config = run.read_config()
    run.write_config(
        ResolvedConfig(run_id="off-1", run=RunSettings(name="off", global_eval_every=0), syncer=config.syncer)
    )
    assert runs.unscored_reason(run) == unscored.EVERY_OFF


def test_the_report_summary_says_the_global_model_was_not_scored_and_why(run: rundir.RunDir) -> None:
    rows = dict(report.summary_rows(report.load_run(run.path)))
    assert rows["global model"] == f"not scored ({BUILD})"
    assert "global model loss (final / min)" not in rows and rows["eval loss (final / min)"] == "2.500 / 2.500"


def test_export_doc_says_why_the_held_out_loss_is_null(run: rundir.RunDir) -> None:
    from dldctl.lifecycle import export as export_mod

    pytest.importorskip("safetensors")
    import torch

    from workload.gpt import build

    tensors = {n: p.detach().clone() for n, p in build("gpt-tiny", block_size=32).named_parameters()}
    torch.save({"state_dict": tensors, "outer_steps": 3, "run_id": "off-1", "held_out_loss": None}, run.final_model)
    doc = export_mod.export(run, run.path / "out")
    assert doc["held_out_loss"] is None and doc["held_out_loss_missing"] == BUILD
    written = json.loads(Path(doc["config"]).read_text())
    assert written["held_out_loss_missing"] == BUILD


def test_up_wait_warns_with_the_reason_and_keeps_it_in_its_record(run: rundir.RunDir) -> None:
    snap = {"loss": {"global": None, "global_off": BUILD}}
    assert global_off_settled(run, snap, 0.0) == BUILD
    assert global_off_settled(run, {"loss": {"global": 2.0, "global_off": None}}, 5.0) is None
    line = global_off_warning(BUILD)
    assert line.startswith("the global model is not scored, so the quality guard is off: " + BUILD)
    assert "importable" in line and "training goes on" in line
    assert global_off_warning(unscored.EVERY_OFF).endswith(unscored.EVERY_OFF)


def test_up_wait_prints_the_warning_once_merging_and_returns_the_reason(
    run: rundir.RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dldctl.commands import run as run_cmd

    def snap(steps: int, off: str | None) -> dict[str, Any]:
        return {
            "syncer": {"alive": True, "outer_steps": steps},
            "quorum": {"live": 1, "min": 1},
            "loss": {"global": None, "global_off": off},
        }

    shown = iter([snap(0, None), snap(3, None), snap(3, BUILD)])  # the reason comes a moment after the merges
    monkeypatch.setattr(run_cmd.snapshot, "collect", lambda _run: next(shown))
    monkeypatch.setattr(run_cmd.time, "sleep", lambda _s: None)
    console = Console(record=True, width=300, file=io.StringIO())
    merging = run_cmd._wait_merging(run, 60.0, console)
    assert merging == {"outer_steps": 3, "live": 1, "quorum": 1, "global_off": BUILD}
    text = console.export_text()
    assert f"warning: the global model is not scored, so the quality guard is off: {BUILD}" in text
    assert run_cmd.up_record(run, merging)["merging"]["global_off"] == BUILD
