"""What `report`'s plots draw, on recorded runs with faults in them (no plotting here).

tests/data/run_faults is a real local fleet (three gpt-tiny learners, tests/data/record_run_faults.py):
`chaos kill learner-1`, `chaos pause learner-2` a second later, then `chaos kill syncer`; the
restarted syncer resumed from an older checkpoint, so tokens merged and outer steps went back, and
its first sample knew no learner (all "unreachable", 0 tokens/s, 0 live). tests/data/run_recorded
has a syncer restart from a checkpoint too. Each test first checks that the trap is in the data
(what the old plots drew), then that the series do not fall into it.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from dldctl.observe import report_series as rs

DATA = Path(__file__).resolve().parents[1] / "data"


def load(name: str) -> tuple[list[dict], list[dict], float]:
    def read(file: str) -> list[dict]:
        return sorted((json.loads(x) for x in (DATA / name / file).read_text().splitlines()), key=lambda r: r["t"])

    metrics, events = read("metrics.jsonl"), read("events.jsonl")
    samples = [m for m in metrics if m["kind"] == "sample"]
    return samples, events, min(r["t"] for r in metrics + events)


@pytest.fixture(scope="module")
def faults() -> tuple[list[dict], list[dict], float]:
    return load("run_faults")


def restart(events: list[dict]) -> tuple[float, float]:
    """(the syncer's death, the restarted syncer's start) in wall time."""
    death = next(e["t"] for e in events if e["kind"] == "syncer_death")
    return death, next(e["t"] for e in events if e["kind"] == "syncer_start" and e["t"] > death)


def around(line: rs.Line, t0: float, start: float, end: float) -> list[float]:
    """The y values a line has between two wall times."""
    return [y for x, y in zip(line.x, line.y) if start <= x + t0 <= end]


def test_the_restarted_syncers_blind_sample_is_in_the_recording(faults: tuple[list[dict], list[dict], float]) -> None:
    samples, events, _ = faults
    _, started = restart(events)
    first = next(s for s in samples if s["t"] > started)
    assert first["quorum_live"] == 0 and first["tokens_per_s"] == 0
    assert {r["state"] for r in first["learners"].values()} == {"unreachable"}
    assert all(r["tokens_per_s"] == 0 for r in first["learners"].values())
    assert rs.blind(samples, events).count(True) >= 1


def test_throughput_and_live_count_never_drop_to_zero_across_the_syncer_restart(
    faults: tuple[list[dict], list[dict], float],
) -> None:
    samples, events, t0 = faults
    death, started = restart(events)
    first_known = next(s["t"] for s, b in zip(samples, rs.blind(samples, events)) if s["t"] > started and not b)
    lines = rs.throughput_lines(samples, events, t0) + rs.quorum_lines(samples, events, t0)
    assert [line.label for line in lines] == ["learner-0", "learner-1", "learner-2", "total", "live", "minimum quorum"]
    for line in lines:
        during = around(line, t0, death - 5.0, first_known - 0.01)
        assert 0.0 not in during, line.label
        assert any(math.isnan(y) for y in during), f"{line.label} is not broken across the restart"
        assert len(line.x) == len(line.y)
    live = lines[4]
    assert min(y for y in around(live, t0, first_known, math.inf) if not math.isnan(y)) >= 2


def test_a_learner_the_syncer_cannot_hear_has_no_throughput_not_zero(
    faults: tuple[list[dict], list[dict], float],
) -> None:
    samples, events, t0 = faults
    killed = next(e["t"] for e in events if e["kind"] == "fault_inject" and e["target"] == "learner-1")
    deaf = next(s for s in samples if s["t"] > killed and s["learners"]["learner-1"]["state"] == "unreachable")
    assert deaf["learners"]["learner-1"]["tokens_per_s"] == 0  # what the old plot drew
    lines = {line.label: line for line in rs.throughput_lines(samples, events, t0)}
    x = deaf["t"] - t0
    assert math.isnan(lines["learner-1"].y[lines["learner-1"].x.index(x)])
    assert lines["learner-0"].y[lines["learner-0"].x.index(x)] == deaf["learners"]["learner-0"]["tokens_per_s"]


def naive_rates(samples: list[dict], counter: Callable[[dict], float | None]) -> list[float]:
    """The old plot's rates: every pair of successive samples with a rise, gaps and restarts included."""
    out = []
    for a, b in itertools.pairwise(samples):
        va, vb = counter(a), counter(b)
        if va is not None and vb is not None and vb > va:
            out.append((vb - va) / (b["t"] - a["t"]))
    return out


def test_no_rate_is_computed_across_the_restart(faults: tuple[list[dict], list[dict], float]) -> None:
    samples, events, t0 = faults
    old = naive_rates(samples, rs.ddp_bytes)
    assert max(old) > 3.5 * statistics.median(old)  # the spike after the restart
    ours, ddp = rs.bandwidth_lines(samples, events, t0)
    assert ddp.label == "data-parallel equivalent" and ours.label.startswith("Decoupled DiLoCo")
    rates = [y for y in ddp.y if not math.isnan(y)]
    assert max(rates) < 2.0 * statistics.median(rates)
    death, started = restart(events)
    assert all(math.isnan(y) for y in around(ddp, t0, death, started + 3.0))  # the first after it: no base
    assert len(rates) >= len(samples) - 6


def test_pieces_cut_at_a_time_gap_and_at_a_counter_reset() -> None:
    def sample(t: float, merged: int) -> dict:
        return {"t": t, "kind": "sample", "tokens_merged": merged, "bytes_up": merged, "learners": {}}

    rows = [sample(t, 100 * i) for i, t in enumerate((0, 2, 4, 6, 40, 42, 44))] + [sample(46, 50), sample(48, 60)]
    for row in rows:
        row["learners"] = {"learner-0": {"state": "running", "tokens_per_s": 5.0}}
    parts = rs.pieces(rows)
    assert [[s["t"] for s in part] for part in parts] == [[0, 2, 4, 6], [40, 42, 44], [46, 48]]
    line = rs.piece_line("x", parts, lambda s: rs.number(s["tokens_merged"]), 0.0)
    assert line.x == [0, 2, 4, 6, 6, 40, 42, 44, 44, 46, 48]
    assert [math.isnan(y) for y in line.y] == [False] * 4 + [True] + [False] * 3 + [True] + [False] * 2
    rate = rs.rate_line("r", parts, lambda s: rs.number(s["bytes_up"]), 0.0)
    assert [y for y in rate.y if not math.isnan(y)] == [50.0, 50.0, 50.0, 50.0, 50.0, 5.0]  # none across a cut
    assert rs.no_data_spans(rows, []) == [(6, 40), (44, 46)]


def test_a_syncer_start_between_two_samples_is_a_cut_even_without_a_gap() -> None:
    samples, events, _ = load("run_recorded")
    _, started = restart(events)
    parts = rs.pieces(samples, events)
    assert len(parts) == 2 and parts[1][0]["t"] >= started > parts[0][-1]["t"]
    assert parts[1][0]["t"] - parts[0][-1]["t"] < rs.GAP_INTERVALS * rs.sample_interval(samples)


@pytest.mark.parametrize("name", ["run_faults", "run_recorded"])
def test_loss_is_split_at_the_rollback_and_marked(name: str) -> None:
    samples, events, _ = load(name)
    merged = [s["tokens_merged"] for s in samples]
    assert any(b < a for a, b in itertools.pairwise(merged))  # the line the old plot doubled back on
    segments = rs.loss_segments(samples, events)
    assert len(segments) == 2
    lines = rs.loss_lines(segments)
    for line in lines["loss_train"]:
        assert line.x == sorted(line.x), "a line doubles back"
    kept = [line for line in lines["loss_train"] if not line.undone]
    undone = [line for line in lines["loss_train"] if line.undone]
    (mark,) = rs.rollback_marks(segments)
    back_to = segments[1][0]
    assert mark.x == back_to["tokens_merged"] and not math.isnan(mark.y)
    undid = segments[0][-1]["tokens_merged"] - back_to["tokens_merged"]
    assert mark.label == f"rollback to outer step {back_to['outer_steps']}, {undid:,} merged tokens undone"
    assert len(kept) == 2 and kept[0].x[-1] <= mark.x < kept[1].x[0] + 1
    assert len(undone) == 1 and min(undone[0].x[1:]) > mark.x and undone[0].x[0] == kept[0].x[-1]


def test_a_quality_guard_rollback_event_starts_a_segment_too() -> None:
    rows = [{"t": float(t), "tokens_merged": 10 * t, "outer_steps": t, "loss_train": 3.0 - t / 10} for t in range(6)]
    guard = {"t": 2.5, "kind": "quality_guard", "target": "syncer", "detail": "...: rolled back to the state of ..."}
    flagged = {"t": 3.5, "kind": "quality_guard", "target": "syncer", "detail": "...; no good state to roll back to"}
    segments = rs.loss_segments(rows, [guard, flagged])
    assert [[s["t"] for s in seg] for seg in segments] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    (mark,) = rs.rollback_marks(segments)
    assert mark.label == "rollback to outer step 3" and mark.y == pytest.approx(2.7)


def test_fault_lines_are_labelled_with_kind_and_target_on_separate_rows(
    faults: tuple[list[dict], list[dict], float],
) -> None:
    _, events, t0 = faults
    marks = rs.fault_marks(events, t0)
    assert [m.label for m in marks if m.label] == ["kill learner-1", "pause learner-2", "kill syncer"]
    assert {m.kind for m in marks if not m.label} == {"death", "syncer_death"}  # the kills said it
    kill, pause = (m for m in marks if m.label in ("kill learner-1", "pause learner-2"))
    assert pause.x - kill.x < 2.0 and kill.row != pause.row
    assert {m.row for m in marks if m.label == "kill syncer"} == {0}


def test_fault_actions_and_unclaimed_deaths() -> None:
    details = {
        "kill -KILL pid 15045 on here; back in >= 1 s": "kill",
        "chaos kill --signal KILL": "kill",
        "SIGSTOP for 4 s": "pause",
        "chaos pause --duration 15": "pause",
        "x3 slower for 10 s": "slow",
        "cut off from the syncer for 8 s": "partition",
        "chaos partition --duration 8": "partition",
        "": "fault",
    }
    assert {d: rs.fault_action(d) for d in details} == details
    events = [
        {"t": 5.0, "kind": "death", "target": "learner-3", "detail": "exit 1"},
        {"t": 9.0, "kind": "syncer_death", "target": "syncer", "detail": "exit -9"},
        {"t": 9.0, "kind": "host_unreachable", "target": "gpu-2", "detail": "ssh: timed out"},
        {"t": 9.5, "kind": "restart", "target": "syncer", "detail": ""},
    ]
    marks = rs.fault_marks(events, 0.0)
    assert [(m.label, m.row) for m in marks] == [("learner-3 died", 0), ("syncer died", 0), ("gpu-2 unreachable", 1)]


def test_label_rows_reuse_a_row_once_it_is_far_enough() -> None:
    marks = [rs.Mark(x, f"m{x}", "fault_inject") for x in (0.0, 1.0, 2.0, 3.0, 4.0, 30.0)]
    rows = [m.row for m in rs.label_rows(marks, min_gap=10.0, rows=4)]
    assert rows == [0, 1, 2, 3, 0, 0]  # the fifth, with every row taken, goes where the oldest label is


def test_the_headline_ratio_over_time(faults: tuple[list[dict], list[dict], float]) -> None:
    samples, events, t0 = faults
    line = rs.ratio_line(samples, events, t0)
    last = samples[-1]
    final = last["ddp_equivalent"] / (last["bytes_up"] + last["bytes_down"])
    assert line.y[-1] == pytest.approx(final) and round(final) == 771  # the summary's "771x"
    death, started = restart(events)
    assert any(math.isnan(y) for y in around(line, t0, death - 5.0, started + 3.0))
    assert all(y > 0 for y in line.y if not math.isnan(y))  # no 0 before the first step either
    goodput = rs.goodput_lines(samples, events, t0)
    assert [g.label for g in goodput] == ["whole run", "last 60 s"]
    assert goodput[0].y[-1] == pytest.approx(100 * last["goodput"])


def test_no_samples_no_lines() -> None:
    assert rs.pieces([]) == [] and rs.throughput_lines([], [], 0.0) == [] and rs.quorum_lines([], [], 0.0) == []
    assert rs.bandwidth_lines([], [], 0.0) == [] and rs.loss_segments([], []) == []
    assert rs.ratio_line([], [], 0.0).x == [] and rs.sample_interval([]) == rs.DEFAULT_INTERVAL_S


def test_a_fault_events_action_field_wins_over_its_words() -> None:
    event = {"t": 1.0, "kind": "fault_inject", "target": "learner-1", "detail": "kill -KILL pid 5", "action": "preempt"}
    assert rs.fault_kind(event) == "preempt"
    assert rs.fault_kind({**event, "action": None}) == "kill"  # a run older than the field
    assert rs.fault_marks([event], 0.0)[0].label == "preempt learner-1"
