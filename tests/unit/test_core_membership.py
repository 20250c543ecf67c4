"""The syncer core's membership, driven directly (no sockets, fake clock): where a (re)joining
learner's step counter resumes, learner_lost / learner_back and quorum events."""

from __future__ import annotations

import torch

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


def test_the_first_quorum_of_a_syncer_is_reached_not_regained() -> None:
    """A run's start is not a recovery: below quorum until the learners join, then `quorum_reached`
    once; only a quorum lost after that comes back as `quorum_regained`."""
    h = Harness(make_settings(quorum=2, liveness_s=3.0))
    assert not h.tick(0.5).events  # nobody yet: below quorum from the start, no event
    h.join_all(now=1.0)
    out = h.tick(1.0)
    assert not events_of(out, "quorum_regained")
    (ev,) = events_of(out, "quorum_reached")
    assert "3 live" in ev["detail"]
    h.beat("a", 3.0)
    assert events_of(h.tick(4.5), "quorum_lost")
    h.beat("b", 5.0)
    out = h.tick(5.0)
    assert events_of(out, "quorum_regained") and not events_of(out, "quorum_reached")


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


def _rejoin_during_a_round(**settings: object) -> Harness:
    """a and b push fragment 0; b dies and its new incarnation joins before the round closed."""
    h = Harness(make_settings(quorum=3, fragments=2, **settings))  # type: ignore[arg-type]
    h.join_all(now=1.0)
    delta = torch.full((h.plan.sizes()[0],), 0.01)
    h.push("a", 0, delta, 1.1)
    h.push("b", 0, delta, 1.2)
    h.hello("b", 1.3, incarnation="i2")
    return h


def test_a_lockstep_rejoiner_takes_its_old_push_out_of_the_open_round() -> None:
    """Left in, the old push closed round 0 with c's; the new b, which fetched fragment 0 as not
    merged yet, then pushed 0 again while a and c waited for its 1: the fleet stood still."""
    h = _rejoin_during_a_round(overlap=False)
    assert set(h.core.rounds[0].contributions) == {"a"}
    assert [e["detail"] for e in events_of(h.outs[-1], "drop")] == [
        "fragment 0: the previous incarnation's unmerged push (lock-step)"
    ]
    delta = torch.full((h.plan.sizes()[0],), 0.01)
    h.push("c", 0, delta, 1.4)
    h.tick(1.5)
    assert h.core.model is not None and h.core.model.versions[0] == 0  # waits for the new b
    h.push("b", 0, delta, 1.6)
    h.tick(1.7)
    assert h.core.model.versions[0] == 1  # a, c and the new b: one round, nobody waits on another


def test_a_decoupled_rejoiner_keeps_its_old_push() -> None:
    """Nothing waits on the fragment order off lock-step: the dead incarnation's work is merged."""
    h = _rejoin_during_a_round(overlap=True, round_clock="learner")
    assert set(h.core.rounds[0].contributions) == {"a", "b"}
    assert not events_of(h.outs[-1], "drop")


def test_merged_tokens_never_exceed_trained_ones_when_the_last_pushes_outrun_the_heartbeats() -> None:
    """A learner's last pushes can leave after its last heartbeat (a kill, `down`): what was
    merged of it counts as trained, in this incarnation and after its restart."""
    from syncer.fleet import Ledger

    fleet = Ledger(["a"], liveness_s=3.0, started=0.0)
    me = {"learner": "a", "host": "h", "device": "cpu", "pid": 1, "batch_size": 8}
    fleet.hello({**me, "incarnation": "i1"}, 0.0)
    fleet.heartbeat("a", {"step": 10, "tokens": 100, "state": "running"}, 1.0)
    fleet.merged("a", 160, 1.0, fragments=1, weight=1.0, now=1.5)  # pushed after that heartbeat
    assert fleet.trained_tokens() == 160 >= fleet.merged_tokens
    fleet.hello({**me, "incarnation": "i2"}, 2.0)  # restarted: the 160 are its base
    fleet.heartbeat("a", {"step": 12, "tokens": 40, "state": "running"}, 3.0)
    assert fleet.trained_tokens() == 200 and fleet.state_dict()["learners"]["a"]["tokens"] == 40
