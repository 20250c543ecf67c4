"""Where an operator reads about a quarantined learner: the live and plain views' notes, the
report's summary (the syncer's side: tests/unit/test_judge.py, tests/integration/test_quarantine.py)."""

from __future__ import annotations

from dldctl.observe.report import quarantine_text
from dldctl.observe.snapshot_model import Snapshot
from dldctl.observe.view_panels import header_notes, quarantine_note

ROW = {
    "learner": "learner-1",
    "state": "quarantined",
    "remaining_s": 27.0,
    "quarantines": 1,
    "rejected": 3,
    "reason": "fragment 2: norm 8.2e+06x the fragment's recent median",
}


def test_the_views_name_the_quarantined_learner_with_why_and_for_how_long() -> None:
    rows = [ROW, {**ROW, "learner": "learner-3"}]
    snap = Snapshot.from_json({"status": "up", "syncer": {"alive": True}, "screen": {"learners": rows}})
    note = quarantine_note(snap)
    assert note.startswith("QUARANTINED: learner-1 for 27s (+1 more): fragment 2: norm 8.2e+06x"), note
    assert "QUARANTINED: learner-1" in header_notes(snap, 0.0).plain
    released = Snapshot.from_json({"screen": {"learners": [{**ROW, "state": "probation", "remaining_s": 0.0}]}})
    assert quarantine_note(released) == "" and quarantine_note(Snapshot()) == ""


def test_the_report_names_each_quarantined_learner_how_often_and_the_last_reason() -> None:
    events = [
        {"kind": "quarantined", "target": "learner-1", "detail": "30 s (quarantine 1): first"},
        {"kind": "death", "target": "learner-1", "detail": "x"},
        {"kind": "quarantined", "target": "learner-1", "detail": "60 s (quarantine 2): second"},
    ]
    assert quarantine_text(events) == "learner-1 2x, last: 60 s (quarantine 2): second"
    assert quarantine_text([]) == "none"
