"""Chaos plans and verdicts, pure: the Poisson monkey (seeded, mean gap), experiment files (every
error names the table and key), checks on snapshots, and the per-fault report from events."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from dldctl.chaos import verdict
from dldctl.chaos.plan import PlanError, lookup, monkey_schedule, parse_check, parse_experiment


def test_monkey_is_reproducible_and_poisson() -> None:
    kw = dict(mtbf_s=20.0, duration_s=20_000.0, targets=["learner-0", "learner-1"], actions=["kill", "pause"])
    a = monkey_schedule(random.Random(7), **kw)
    assert a == monkey_schedule(random.Random(7), **kw)
    assert a != monkey_schedule(random.Random(8), **kw)
    gaps = [y.at - x.at for x, y in itertools.pairwise(a)]
    assert len(a) == pytest.approx(1000, rel=0.1)  # rate 1/mtbf
    assert statistics.mean(gaps) == pytest.approx(20.0, rel=0.1)
    assert statistics.pstdev(gaps) == pytest.approx(20.0, rel=0.15)  # exponential: sd = mean
    assert {f.action for f in a} == {"kill", "pause"} and all(0 < f.at < 20_000 for f in a)


def test_monkey_rejects_bad_input() -> None:
    with pytest.raises(PlanError, match="unknown action 'explode'"):
        monkey_schedule(random.Random(0), mtbf_s=1, duration_s=10, targets=["x"], actions=["explode"])
    with pytest.raises(PlanError):
        monkey_schedule(random.Random(0), mtbf_s=0, duration_s=10, targets=["x"], actions=["kill"])


def test_checks() -> None:
    snap = {"quorum": {"live": 3}, "syncer": {"alive": True}, "tokens": {"merged": 10}}
    assert parse_check("quorum.live >= 3").holds(snap)
    assert not parse_check("quorum.live > 3").holds(snap)
    assert parse_check("syncer.alive == true").holds(snap)
    assert not parse_check("missing.path >= 0").holds(snap)
    rising = parse_check("tokens.merged rising")
    assert rising.holds({"tokens": {"merged": 11}}, snap) and not rising.holds(snap, snap)
    assert lookup(snap, "syncer.alive") == 1.0
    for bad in ("quorum.live >>= 3", "import os", "quorum.live >= x"):
        with pytest.raises(PlanError):
            parse_check(bad)


EXPERIMENT = {
    "experiment": {"name": "t", "settle": 5},
    "steady_state": [{"check": "quorum.live >= 2"}],
    "fault": [
        {"at": 10, "action": "pause", "target": "learner-1", "duration": 4},
        {"at": 2, "action": "kill", "target": "learner-0", "down_for": 3},
    ],
    "abort": [{"check": "syncer.alive == false"}],
}


def test_experiment_parses_sorted_with_a_default_duration() -> None:
    exp = parse_experiment(EXPERIMENT)
    assert [f.action for f in exp.faults] == ["kill", "pause"]
    assert exp.duration == 10 + 4 + 5 and exp.faults[0].duration == 3


def test_experiment_durations_take_units() -> None:
    exp = parse_experiment(
        {
            "experiment": {"duration": "2m", "settle": "15s"},
            "fault": [
                {"at": "1m", "action": "pause", "target": "learner-0", "duration": "800ms"},
                {"at": 5, "action": "kill", "target": "learner-1", "down_for": "30s"},
            ],
        }
    )
    assert exp.duration == 120 and exp.settle_s == 15
    assert [(f.at, f.duration) for f in exp.faults] == [(5, 30), (60, 0.8)]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fault": [{"at": 1, "action": "nuke", "target": "x"}]}, "action 'nuke'"),
        ({"fault": [{"at": 1, "action": "pause", "target": "x", "lenght": 3}]}, "unknown key 'lenght'"),
        ({"fault": [{"action": "kill", "target": "x"}]}, "missing 'at'"),
        ({"fault": []}, "at least one"),
        ({"steady_state": [{}]}, "missing check"),
        ({"experiment": {"nmae": "x"}}, "[experiment]: unknown key 'nmae'"),
        ({"rollback": {"heal": True, "twice": 1}}, "[rollback]: unknown key"),
        ({"boom": {}}, "unknown table [boom]"),
        ({"fault": [{"at": "soon", "action": "kill", "target": "x"}]}, "[[fault]] #1 at: 'soon' is not a duration"),
        (
            {"fault": [{"at": 1, "action": "pause", "target": "x", "duration": -2}]},
            "[[fault]] #1 duration: must be >= 0",
        ),
        (
            {"fault": [{"at": 1, "action": "slow", "target": "x", "factor": 0.5}]},
            "[[fault]] #1 factor: a slow fault needs",
        ),
        (
            {"fault": [{"at": 1, "action": "slow", "target": "x", "factor": "x"}]},
            "[[fault]] #1 factor: must be a number",
        ),
        ({"experiment": {"duration": "long"}}, "[experiment] duration: 'long' is not a duration"),
    ],
)
def test_experiment_errors_name_the_key(change: dict, message: str) -> None:
    with pytest.raises(PlanError) as info:
        parse_experiment({**EXPERIMENT, **change})
    assert message in str(info.value)


def snap(t: float, goodput: float, live: int = 3, tokens: int = 0, merged: int = 0) -> dict:
    return {
        "now": t,
        "goodput_window": goodput,
        "quorum": {"live": live},
        "syncer": {"alive": True},
        "learners": [{"id": "learner-0", "tokens": tokens, "merged_tokens": merged}],
    }


def test_verdict_and_fault_report() -> None:
    exp = parse_experiment(EXPERIMENT)
    samples = [snap(100, 0.9, tokens=1000, merged=800), snap(103, 0.5), snap(110, 0.6), snap(140, 0.9)]
    events = [
        {"t": 102.5, "kind": "death", "target": "learner-0"},
        {"t": 106.0, "kind": "rejoin", "target": "learner-0"},
        {"t": 111.0, "kind": "fault_undo", "target": "learner-1"},
    ]
    result = verdict.evaluate(exp, samples, events, [102.0, 110.0])
    assert result.passed and result.reasons == []
    kill, pause = result.faults
    assert kill.detected_at == 102.5 and kill.back_at == 106.0 and kill.work_lost_tokens == 200
    assert kill.goodput_during == pytest.approx(0.5) and kill.goodput_after == pytest.approx(0.6)
    assert pause.detected_at is None and pause.back_at == 111.0  # too short to be noticed: back when undone
    text = verdict.markdown(exp, result)
    assert "PASS" in text and "learner-0" in text


def test_verdict_fails_when_steady_state_is_not_restored_or_aborted() -> None:
    exp = parse_experiment(EXPERIMENT)
    samples = [snap(100, 0.9), snap(140, 0.9, live=1)]
    result = verdict.evaluate(exp, samples, [], [101.0, None], aborted="abort condition syncer.alive == false")
    assert not result.passed
    assert any("not restored" in r for r in result.reasons) and any("aborted" in r for r in result.reasons)
    assert any("not injected" in r for r in result.reasons)


def test_a_bound_relative_to_the_start_parses_and_holds_against_the_first_snapshot() -> None:
    check = parse_check("loss.global <= start + 5%")
    assert check.throughout and check.relative == pytest.approx(0.05)
    first = {"loss": {"global": 2.0}}
    assert check.holds({"loss": {"global": 2.09}}, first) and not check.holds({"loss": {"global": 2.11}}, first)
    assert parse_check("goodput_window >= start - 10%").relative == pytest.approx(-0.10)
    assert parse_check("tokens.merged > start").relative == 0.0
    with pytest.raises(PlanError, match="start \\+ N%"):
        parse_check("loss.global <= begin + 5%")


def test_the_model_bound_fails_the_verdict_when_broken_in_between_even_if_healed_by_the_end() -> None:
    """A global model damaged by a fault and healed before the end still broke the hypothesis."""
    exp = parse_experiment({**EXPERIMENT, "steady_state": [{"check": "loss.global <= start + 5%"}]})

    def with_loss(t: float, loss: float | None) -> dict:
        return {**snap(t, 0.9), "loss": {"global": loss}}

    healthy = [with_loss(100, 2.0), with_loss(110, 2.05), with_loss(120, None), with_loss(140, 1.9)]
    assert verdict.evaluate(exp, healthy, [], [102.0, 110.0]).passed  # unknown while the syncer was away
    damaged = [with_loss(100, 2.0), with_loss(110, 3.4), with_loss(140, 1.9)]
    result = verdict.evaluate(exp, damaged, [], [102.0, 110.0])
    assert not result.passed
    (reason,) = result.reasons
    assert "broken during the experiment" in reason and "3.4 at t=10 s" in reason and "2.0 at the start" in reason
