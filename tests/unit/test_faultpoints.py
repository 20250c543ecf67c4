"""Named fault points: the spec parser and "pause at the N-th hit" (the crash tests rely on both)."""

from __future__ import annotations

import pytest

from syncer.common import faultpoints


def test_parse_names_hits_and_seconds() -> None:
    assert faultpoints._parse("checkpoint@3=30,merge=2, push") == {
        "checkpoint": (3, 30.0),
        "merge": (1, 2.0),
        "push": (1, 1.0),
    }
    assert faultpoints._parse("nope=3,merge=x,fetch@y=1,") == {}


def test_hit_pauses_once_at_the_nth_time(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    slept: list[float] = []
    monkeypatch.setattr(faultpoints.time, "sleep", slept.append)
    monkeypatch.setattr(faultpoints, "_ACTIVE", {"merge": (3, 7.0)})
    monkeypatch.setattr(faultpoints, "_HITS", {})
    for _ in range(5):
        faultpoints.hit("merge")
        faultpoints.hit("checkpoint")  # not asked for: never pauses
    assert slept == [7.0]
    assert capsys.readouterr().out == "fault point merge (hit 3): pausing 7 s\n"
