"""learner.files.Slowdown: a slowed learner (throttle, `dldctl chaos slow`) stretches each step by
its factor, but a step the process spent stopped in (a chaos pause) does not count as compute.
Unbounded, a throttled learner paused 20 s sat idle 20 s more after SIGCONT, and the e2e test that
kills the syncer right after a pause saw it log no step."""

from __future__ import annotations

import pytest

from learner.files import Slowdown


def test_a_steady_step_is_stretched_by_its_factor() -> None:
    s = Slowdown()
    assert s.wait_s(0.1, 2.0) == pytest.approx(0.1)
    assert s.wait_s(0.1, 3.0) == pytest.approx(0.2)
    assert s.wait_s(0.1, 1.0) == 0.0  # not slowed: no wait


def test_a_step_stretched_by_a_pause_waits_at_most_a_few_steps_more() -> None:
    s = Slowdown()
    for _ in range(20):
        s.wait_s(0.05, 2.0)
    wait = s.wait_s(20.0, 2.0)  # SIGSTOP for 20 s during this step
    assert wait == pytest.approx(Slowdown.STRETCH * 0.05)
    assert s.wait_s(0.05, 2.0) == pytest.approx(0.05, rel=0.2)  # and the next steps are as before


def test_a_real_change_of_pace_is_followed() -> None:
    s = Slowdown()
    s.wait_s(0.05, 2.0)
    for _ in range(60):  # the host really got 4x slower: the bound grows with the average
        last = s.wait_s(0.2, 2.0)
    assert last == pytest.approx(0.2)
