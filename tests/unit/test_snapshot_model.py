"""The typed status snapshot: its JSON is the contract (`status --json`, docs/status.md): every
key a recorded snapshot had comes back unchanged, `version` is added, and a reader of a malformed
or older snapshot gets defaults, never a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dldctl.observe.snapshot_model import SCHEMA, VERSION, Figures, Snapshot

SNAPSHOTS = Path(__file__).parent.parent / "data" / "snapshots"


def _same_where_given(given: object, back: object) -> bool:
    """`back` has every key of `given` with the same value (keys may be added, none renamed)."""
    if isinstance(given, dict) and isinstance(back, dict):
        return all(k in back and _same_where_given(v, back[k]) for k, v in given.items())
    if isinstance(given, list) and isinstance(back, list):
        return len(given) == len(back) and all(map(_same_where_given, given, back))
    return given == back and type(given) is type(back)


@pytest.mark.parametrize("name", ["recorded_healthy", "recorded_below_quorum", "recorded_syncer_dead", "recorded_down"])
def test_a_recorded_snapshot_keeps_every_key_and_gains_its_version(name: str) -> None:
    given = json.loads((SNAPSHOTS / f"{name}.json").read_text())
    snap = Snapshot.from_json(given)
    back = snap.to_json()
    assert _same_where_given(given, back)
    assert back["version"] == VERSION and back["schema"] == SCHEMA
    assert Snapshot.from_json(json.loads(json.dumps(back))) == snap  # JSON and back: the same snapshot


def test_the_typed_fields_read_what_the_operator_reads() -> None:
    snap = Snapshot.from_json(json.loads((SNAPSHOTS / "recorded_healthy.json").read_text()))
    assert snap.syncer.alive and snap.syncer.outer_steps == 490 and snap.quorum.live == 4
    assert [r.id for r in snap.learners] == ["learner-0", "learner-1", "learner-2", "learner-3"]
    assert snap.learners[1].restarts == 1 and snap.learners[1].extra["joins"] == 2
    assert snap.events[0].kind == "up" and snap.figures.tokens_merged == 1436928
    assert snap.figures.loss.global_ is None and snap.figures.scored_loss == snap.loss.eval


def test_a_malformed_snapshot_reads_as_defaults() -> None:
    snap = Snapshot.from_json({"syncer": "?", "loss": {"global": "2.3", "train": True}, "learners": [1, {"step": "x"}]})
    assert snap.syncer.outer_steps is None and snap.loss.global_ is None and snap.loss.train is None
    assert snap.figures.outer_steps == 0
    assert len(snap.learners) == 1 and snap.learners[0].step is None and snap.version == VERSION


def test_figures_from_a_metrics_sample_match_the_snapshots_names() -> None:
    sample = {"kind": "sample", "outer_steps": 600, "goodput": 0.8341, "tokens_merged": 10, "bytes_up": 15674960}
    sample |= {"loss_global": 2.3076, "loss_eval": 2.4, "global_off": None}
    figures = Figures.from_sample(sample)
    assert (figures.outer_steps, figures.goodput, figures.bytes_up) == (600, 0.8341, 15674960)
    assert figures.loss.global_ == 2.3076 and figures.scored_loss == 2.3076


def test_the_view_sections_read_odd_values_as_defaults_and_keep_their_json() -> None:
    given = {
        "syncer": {"alive": True, "warnings": ["w", 3], "risks": "x", "rejected": {"stale": 2, "bad": "?"}},
        "supervisor": {"state": "hung", "pid": "12", "heartbeat_age_s": float("nan"), "watchdog": "?"},
        "data": {"order": "ledger", "epoch": 1, "lost": "many", "tokens_by_learner": {"learner-0": 5, "x": None}},
        "guard": {"trips": 2.0, "last": "?"},
        "screen": {"learners": [{"learner": "learner-1", "state": "quarantined", "remaining_s": "soon"}, 7]},
        "shards": [{"name": "syncer", "up": 1, "fragments": [0, "a", 2]}, {"name": "syncer-1", "fragments": None}],
    }
    snap = Snapshot.from_json(given)
    assert snap.syncer.warnings == ("w",) and snap.syncer.risks == () and snap.syncer.rejected_total == 2
    assert snap.supervisor is not None and snap.supervisor.state == "hung" and snap.supervisor.pid is None
    assert snap.supervisor.heartbeat_age_s is None and snap.supervisor.watchdog is None
    assert snap.data is not None and snap.data.epoch == 1 and snap.data.lost is None
    assert snap.data.tokens_by_learner == {"learner-0": 5}
    assert snap.guard is not None and snap.guard.trips == 2 and snap.guard.last.loss is None
    assert snap.screen is not None and [r.remaining_s for r in snap.screen.learners] == [None]
    assert snap.shards is not None and snap.shards[0].fragments == (0, 2) and not snap.shards[0].up
    assert snap.shards[1].fragments is None
    back = snap.to_json()
    assert back["data"]["epoch"] == 1 and type(back["data"]["epoch"]) is int  # an int stays an int
    assert "lost" not in back["data"]  # a figure the ledger does not know (not a number) is left out, not null
    assert back["supervisor"]["state"] == "hung" and back["shards"][0]["name"] == "syncer"
    assert Snapshot.from_json(json.loads(json.dumps(back))) == snap


def test_an_absent_or_null_section_stays_so() -> None:
    assert Snapshot.from_json({"data": None}).to_json()["data"] is None
    back = Snapshot.from_json({}).to_json()
    assert not {"data", "supervisor", "guard", "screen", "shards"} & set(back)
    assert Snapshot.from_json(None) == Snapshot.from_json({})  # not an object: all defaults
