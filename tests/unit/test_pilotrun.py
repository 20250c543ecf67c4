"""A run's measured constants (dldctl/observe/pilotrun.py), on a real recorded run and on
hand-made records for the rules the real run does not show."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path
from typing import Any

import pytest

from dldctl.observe import pilotrun
from dldctl.rundir import RunDir
from syncer.common.settings import RunSettings

PILOT = Path(__file__).resolve().parents[1] / "data" / "pilot_run"  # bench/pilot_runs.py's m4_mtbf20


def pilot_dir(tmp_path: Path) -> Path:
    """The recorded pilot (4 learners, 2 at half speed, the monkey's kills and 5 s pauses every
    20 s on average for 4 minutes) as a run directory."""
    run = tmp_path / "pilot"
    shutil.copytree(PILOT, run)
    with gzip.open(run / "metrics.jsonl.gz", "rb") as src, open(run / "metrics.jsonl", "wb") as dst:
        shutil.copyfileobj(src, dst)
    return run


def test_the_recorded_pilot_measures_its_window_faults_and_costs(tmp_path: Path) -> None:
    rec = pilotrun.read(RunDir(pilot_dir(tmp_path)))
    assert all(e.get("action") in ("kill", "pause") for e in rec.events if e["kind"] == "fault_inject")
    assert all(isinstance(e.get("spare"), bool) for e in rec.events if e["kind"] == "restart")
    p = pilotrun.measure(rec)
    g = p.goodput
    assert g.learners == 4 and 240 < g.window_s < 260
    assert 0.9 < g.goodput < 1.0
    assert g.kinds() == {"pause": 4, "kill": 8}
    kills = [f for f in p.faults if f.kind == "kill"]
    for f in kills:  # the supervisor restarts it, it says hello again, then it is merged again
        assert f.restart_s is not None and f.rejoin_s is not None and f.contributing_s is not None
        assert 0 < f.restart_s <= f.rejoin_s <= f.contributing_s < 10
        assert f.cost is not None and f.cost.down_s == f.rejoin_s and f.cost.lost_s > 0
    for f in p.faults:
        if f.kind == "pause":  # `--fault-duration 5s`: undone by the supervisor 5 s later
            assert f.cost is not None and f.cost.down_s == pytest.approx(5.0, abs=0.5) and f.cost.lost_s == 0
    assert p.lost_tokens > 0 and p.notes == []
    fast, slow = p.step_s["learner-0"][1], p.step_s["learner-2"][1]
    assert 2.0 < slow / fast < 4.0  # the slow host is throttled to half speed, and loses CPU too
    assert g.efficiency() == pytest.approx(g.goodput / (1 - g.cost_share()))


def test_the_recorded_pilot_measures_its_wire(tmp_path: Path) -> None:
    p = pilotrun.measure(pilotrun.read(RunDir(pilot_dir(tmp_path))), target_loss=2.5)
    w = p.wire
    assert (w.sites, w.H, w.fragments, w.max_lag) == (4, 32, 4, 0)
    assert 0 < w.up_bytes < w.down_bytes * 2 and w.down_bytes > 0
    assert 0 <= w.blocked < 0.1 and 0.005 < w.step_s < 0.2
    assert w.time_to_target_s is not None and 0 < w.time_to_target_s < g_window(p)
    up, down = p.bytes_per_token
    assert 1 < up < 20 and 1 < down < 20 and p.compression == "int4"


def g_window(p: pilotrun.Pilot) -> float:
    return p.window[1] - p.window[0]


def sample(t: float, goodput: float, **rows: dict[str, Any]) -> dict[str, Any]:
    return {"t": t, "goodput": goodput, "tokens_trained": 0, "tokens_merged": 0, "learners": rows}


def records(events: list[dict[str, Any]], learners: int = 2) -> pilotrun.Records:
    row = {"step": 5, "state": "running", "tokens_per_s": 1000.0}
    rows = {f"learner-{i}": row for i in range(learners)}
    samples = [sample(100.0 + 10 * i, 0.5, **rows) for i in range(11)]
    start = [{"t": 90.0, "kind": "syncer_start", "target": "syncer"}]
    return pilotrun.Records(start + events, samples, [], [], RunSettings(), learners, "hand")


def fault(t: float, detail: str, **fields: object) -> dict[str, Any]:
    return {"t": t, "kind": "fault_inject", "target": "learner-1", "detail": detail, **fields}


def test_the_structured_action_wins_over_the_words_and_a_slow_down_costs_its_lost_share() -> None:
    undo = {"t": 150.0, "kind": "fault_undo", "target": "learner-1", "detail": "x"}
    p = pilotrun.measure(records([fault(130.0, "SIGSTOP", action="slow", factor=2.0), undo]))
    (f,) = p.faults
    assert f.kind == "slow" and f.undone_s == 20.0
    assert f.cost is not None and f.cost.down_s == pytest.approx(10.0)


def test_a_kill_never_back_costs_the_rest_of_the_window_and_unknown_kinds_are_noted() -> None:
    p = pilotrun.measure(records([fault(180.0, "kill -KILL pid 5"), fault(150.0, "cut off for 5 s")]))
    kinds = {f.kind: f for f in p.faults}
    assert kinds["kill"].cost is not None and kinds["kill"].cost.down_s == pytest.approx(20.0)
    assert kinds["partition"].cost is not None and kinds["partition"].cost.down_s == 0.0
    assert p.notes == ["a partition fault's cost is not modelled: counted as none"]


def test_the_window_starts_once_every_learner_trained_and_faults_before_it_do_not_count() -> None:
    rec = records([fault(95.0, "kill -KILL pid 5")])
    rec.samples[0]["learners"]["learner-1"] = {"step": 0, "state": "joining"}
    p = pilotrun.measure(rec)
    assert p.window == (110.0, 200.0) and p.faults == []
    assert p.goodput.goodput == pytest.approx(0.5 * (200 - 90 - (110 - 90)) / 90)  # the syncer's, windowed


def test_a_run_that_never_trained_is_one_clear_error() -> None:
    rec = records([])
    rec.samples = []
    with pytest.raises(ValueError, match="run hand has no syncer samples"):
        pilotrun.measure(rec)
    rec = records([])
    for s in rec.samples:
        s["learners"] = {}
    with pytest.raises(ValueError, match="never all trained at once"):
        pilotrun.measure(rec)


def test_warm_spares_are_modelled_from_the_hosts_and_a_fresh_processs_start_up(tmp_path: Path) -> None:
    p = pilotrun.measure(pilotrun.read(RunDir(pilot_dir(tmp_path))))
    spares = p.goodput.spares
    assert spares is not None and spares.per_host == 2 and spares.delay_s == 1.0
    assert 2.0 < spares.cold_start_s < 20.0  # the learners' first start to their first join
    assert p.spares_from.startswith("the fleet's first start")  # no kill of this run waited
    kills = [f for f in p.faults if f.kind == "kill"]
    assert all(f.spare for f in kills)  # every restart took the host's warm spare


def test_a_kill_right_after_another_on_its_host_did_not_find_its_spare_ready() -> None:
    events = [{"t": 50.0, "kind": "start", "target": f"learner-{i}", "detail": ""} for i in range(2)] + [
        {"t": 54.0, "kind": "join", "target": f"learner-{i}", "detail": ""} for i in range(2)
    ]
    events += [
        fault(120.0, "kill", action="kill"),
        {"t": 120.5, "kind": "restart", "target": "learner-1", "detail": "", "spare": True},
        {"t": 121.0, "kind": "rejoin", "target": "learner-1", "detail": ""},
        fault(123.0, "kill", action="kill"),
        {"t": 123.5, "kind": "restart", "target": "learner-1", "detail": "pid 9 (warm spare)"},
        {"t": 127.0, "kind": "rejoin", "target": "learner-1", "detail": ""},
    ]
    rec = records(events)
    rec.hosts = {"learner-0": "a", "learner-1": "a"}
    p = pilotrun.measure(rec)
    first, second = (f.cost for f in p.faults)
    assert first is not None and second is not None
    assert first.spare_ready and first.down_s == pytest.approx(1.0)
    assert not second.spare_ready and second.down_s == pytest.approx(4.0)  # it waited for the spare
    # that spare started a delay after the restart at 120.5 and was ready at 127: 5.5 s of start-up,
    # longer than the fleet's own first start (4 s), which is only the fallback
    assert p.goodput.spares is not None and p.goodput.spares.cold_start_s == pytest.approx(5.5)
    assert p.spares_from == "median of 1 kills that waited for a spare"
