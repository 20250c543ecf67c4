"""The syncer core's membership, driven directly (no sockets, fake clock): where a (re)joining
learner's step counter resumes, learner_lost / learner_back and quorum events."""

from __future__ import annotations

from syncer import status
from tests.unit.coreharness import Harness, events_of, make_settings, sent_of


def test_the_welcome_says_where_a_step_counter_resumes() -> None:
    """A restarted learner continues its own counter (lr schedule, steps budget); a learner new
    to a fleet under way takes the live learners' median; heartbeats of a new incarnation still
    at 0 neither rewind the counter nor count its steps twice."""
    h = Harness(make_settings())
    assert sent_of(h.hello("a", 1.0), "welcome")[0][1]["step"] == 0
    h.upload_init("a", 1.1)
    for lid, step in (("b", 0), ("c", 0)):
        assert sent_of(h.hello(lid, 1.2), "welcome")[0][1]["step"] == step
    for lid, step in (("a", 600), ("b", 500), ("c", 700)):
        h.beat(lid, 2.0, step=step)
    total = h.core.fleet.steps_total
    assert sent_of(h.hello("a", 2.1, incarnation="i2"), "welcome")[0][1]["step"] == 600  # rejoin: its own
    h.beat("a", 2.2, state="joining", step=0)
    assert h.core.fleet.learners["a"].step == 600 and h.core.fleet.steps_total == total
    h.beat("a", 2.3, step=610)
    assert h.core.fleet.steps_total == total + 10
    assert sent_of(h.hello("d", 2.4), "welcome")[0][1]["step"] == 610  # late joiner: median of a, b, c
    assert sent_of(h.hello("d", 2.5), "welcome")[0][1]["step"] == 610  # a reconnect: unchanged


def test_quorum_lost_and_regained_events() -> None:
    h = Harness(make_settings(quorum=2, liveness_s=3.0))
    h.join_all(now=1.0)
    assert not h.tick(1.0).events  # first observation: no event
    h.beat("a", 3.0)
    out = h.tick(4.5)  # b, c silent for 3.5 s > liveness
    (ev,) = events_of(out, "quorum_lost")
    assert "1 live" in ev["detail"]
    assert not events_of(h.tick(4.6), "quorum_lost")  # reported once
    snap = status.snapshot(h.core, 4.6)
    assert snap["quorum"]["below_quorum"] is True and snap["quorum"]["live"] == 1
    h.beat("b", 5.0)
    (ev,) = events_of(h.tick(5.0), "quorum_regained")
    assert "2 live" in ev["detail"]


def test_learner_lost_and_back_but_not_for_a_quick_rejoin() -> None:
    h = Harness(make_settings(quorum=1, liveness_s=3.0))
    h.join_all(now=1.0)
    h.tick(1.0)
    h.beat("a", 3.0)
    h.beat("b", 3.0)
    out = h.tick(4.5)  # c silent for 3.5 s
    assert [(e["target"], e["detail"]) for e in events_of(out, "learner_lost")] == [("c", "silent for 3.5 s")]
    h.beat("c", 5.0)
    assert [e["target"] for e in events_of(h.tick(5.0), "learner_back")] == ["c"]
    # b restarts within liveness_s (a warm spare): its new process says hello and is joining again
    h.hello("b", 5.5, incarnation="i2")
    out = h.tick(5.6)
    assert not events_of(out, "learner_lost") and not events_of(out, "learner_back")
    h.beat("b", 6.0)
    assert not events_of(h.tick(6.0), "learner_back")
