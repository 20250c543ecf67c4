"""The learner's outer-loop bookkeeping: the staggered sync schedule (one fragment every H/P
steps, each fragment once per H), the outer gradient mark - local (= global - local right after
an apply; only new work on a second push), applying a global fragment (overwrite with alpha 0,
mix with alpha 0.5) and the per-fragment counters.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from learner.outer import FragmentCounters, OuterState
from syncer.wire import fragments

SPECS = [
    fragments.TensorSpec("emb", (6, 4), "embedding"),
    fragments.TensorSpec("w", (4, 4)),
    fragments.TensorSpec("b", (4,)),
    fragments.TensorSpec("v", (3, 2)),
]


def _params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.nn.Parameter(torch.randn(s.shape, generator=g)) for s in SPECS}


def _state(
    count: int = 2, H: int = 8, alpha: float = 0.0, rebase: bool = False
) -> tuple[OuterState, dict[str, torch.nn.Parameter]]:
    plan = fragments.plan(SPECS, count)
    params = _params()
    g = torch.Generator().manual_seed(1)
    values = [(7 + p, torch.randn(plan.numel(p), generator=g)) for p in range(count)]
    return OuterState.start(plan, H, alpha, values, params, rebase=rebase), params


# -- schedule --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("H", "P"), [(8, 4), (8, 2), (8, 1), (4, 4), (64, 4), (6, 3), (12, 4)])
def test_schedule_one_fragment_every_H_over_P_steps(H: int, P: int) -> None:
    plan = fragments.plan([fragments.TensorSpec(f"t{i}", (3,)) for i in range(P)], P)
    state = OuterState(plan, H, 0.0)
    events = [(step, p) for step in range(1, 3 * H + 1) for p in state.due(step)]
    # one fragment at a time, exactly every H/P steps
    assert [step for step, _ in events] == list(range(H // P, 3 * H + 1, H // P))
    # each fragment exactly once per H steps, in fragment order
    for p in range(P):
        steps = [step for step, q in events if q == p]
        assert len(steps) == 3
        assert [b - a for a, b in itertools.pairwise(steps)] == [H, H]
    assert [p for _, p in events[:P]] == list(range(P))


def test_schedule_by_hand() -> None:
    # H = 8, P = 4: offsets 2, 4, 6, 0 -> steps 2, 4, 6, 8 sync fragments 0, 1, 2, 3
    plan = fragments.plan([fragments.TensorSpec(f"t{i}", (3,)) for i in range(4)], 4)
    state = OuterState(plan, 8, 0.0)
    assert [state.offset(p) for p in range(4)] == [2, 4, 6, 0]
    assert {step: state.due(step) for step in range(1, 11)} == {
        1: [],
        2: [0],
        3: [],
        4: [1],
        5: [],
        6: [2],
        7: [],
        8: [3],
        9: [],
        10: [0],
    }
    assert state.due(0) == [3]  # step 0 is never a real step (steps are 1-based); documented offset


def test_lockstep_phase_points_a_rejoiner_at_the_fragment_merged_next() -> None:
    # H = 8, P = 4: fragments merge in order 0, 1, 2, 3; two already merged once more than the rest
    plan = fragments.plan([fragments.TensorSpec(f"t{i}", (3,)) for i in range(4)], 4)
    state = OuterState(plan, 8, 0.0, base_version=[5, 5, 4, 4])
    phase = state.lockstep_phase()
    assert phase == 4
    # the first fragment due after H/P = 2 steps of training is fragment 2, the one merged next
    first = next((step, state.due(step + phase)) for step in range(1, 9) if state.due(step + phase))
    assert first == (2, [2])
    # a fleet at a whole turn (all equal) starts at fragment 0, as a fresh run does
    assert OuterState(plan, 8, 0.0, base_version=[3, 3, 3, 3]).lockstep_phase() == 0


# -- outer gradient and apply --------------------------------------------------------------------


def test_start_loads_the_global_state() -> None:
    state, params = _state()
    for p in range(2):
        assert torch.equal(state.plan.gather(p, params), state.mark[p])
    assert state.base_version == [7, 8]
    assert state.awaiting == [False, False]
    assert all(c == FragmentCounters() for c in state.counters)
    assert all(isinstance(t, torch.nn.Parameter) and t.requires_grad for t in params.values())


def _train(params: dict[str, torch.nn.Parameter], by: float) -> None:
    with torch.no_grad():
        for t in params.values():
            t.sub_(by)  # "training" moved every parameter by -by


def test_outer_gradient_is_mark_minus_local_and_moves_the_mark() -> None:
    state, params = _state()
    for _ in range(3):
        state.count_step(tokens=10, seconds=0.5)
    _train(params, 0.25)
    base = [m.clone() for m in state.mark]
    delta, counters = state.take_outer_gradient(0, params)
    assert delta.device.type == "cpu" and delta.dtype == torch.float32
    # right after an apply (here: the start) the mark is the global value: DiLoCo's global - local
    torch.testing.assert_close(delta, base[0] - state.plan.gather(0, params))
    torch.testing.assert_close(delta, torch.full_like(delta, 0.25))
    assert (counters.steps, counters.tokens, counters.time) == (3, 30, 1.5)
    assert state.awaiting[0] is True and state.awaiting[1] is False
    # the mark moved to the local value and the counters restarted: nothing is sent twice
    assert torch.equal(state.mark[0], state.plan.gather(0, params))
    assert state.counters[0] == FragmentCounters() and state.counters[1].steps == 3
    again, counters = state.take_outer_gradient(0, params)
    assert torch.equal(again, torch.zeros_like(again)) and counters.steps == 0
    # a second push before the reply carries only the work since the first
    state.count_step(tokens=10, seconds=0.5)
    _train(params, 0.125)
    second, counters = state.take_outer_gradient(0, params)
    torch.testing.assert_close(second, torch.full_like(second, 0.125))
    assert counters.steps == 1
    # the returned delta is independent of the state
    second.zero_()
    assert not torch.equal(state.mark[0], torch.zeros_like(state.mark[0]))


def test_apply_alpha_zero_overwrites() -> None:
    state, params = _state(alpha=0.0)
    _train(params, -1.0)
    state.count_step(tokens=100, seconds=0.5)
    state.take_outer_gradient(0, params)
    state.count_step(tokens=100, seconds=0.5)
    untouched = state.plan.gather(1, params)
    value = torch.arange(state.plan.numel(0), dtype=torch.float32)
    state.apply(0, 9, value, params)
    assert torch.equal(state.plan.gather(0, params), value)
    assert torch.equal(state.plan.gather(1, params), untouched)  # other fragment unchanged
    assert torch.equal(state.mark[0], value) and state.base_version[0] == 9
    value.add_(1.0)  # the mark is a copy
    assert not torch.equal(state.mark[0], value)
    delta, counters = state.take_outer_gradient(0, params)
    assert torch.equal(delta, torch.zeros_like(delta)) and counters.steps == 0
    assert state.awaiting[0] is True


def test_rebase_keeps_the_work_done_since_the_push_and_sends_it_next() -> None:
    state, params = _state(rebase=True)
    _train(params, -1.0)
    state.count_step(tokens=100, seconds=0.5)
    _pushed, _ = state.take_outer_gradient(0, params)  # mark = local at the push
    at_push = state.mark[0].clone()
    _train(params, -0.25)  # two steps while the reply is in flight
    state.count_step(tokens=100, seconds=0.5)
    state.count_step(tokens=100, seconds=0.5)
    since = state.plan.gather(0, params) - at_push
    value = torch.arange(state.plan.numel(0), dtype=torch.float32)
    state.apply(0, 9, value, params)
    torch.testing.assert_close(state.plan.gather(0, params), value + since)  # nothing dropped
    assert torch.equal(state.mark[0], value) and state.base_version[0] == 9 and not state.awaiting[0]
    delta, counters = state.take_outer_gradient(0, params)
    torch.testing.assert_close(delta, -since)  # the in-flight work goes with the next push
    assert (counters.steps, counters.tokens) == (2, 200)  # and its counters with it


def test_rebase_with_alpha_is_refused() -> None:
    from syncer.common.settings import RunSettings, SettingsError

    with pytest.raises(SettingsError, match="rebase"):
        RunSettings(rebase=True, alpha=0.5).validate()


def test_apply_resets_the_awaiting_flag_and_counters() -> None:
    state, params = _state()
    state.count_step(tokens=5, seconds=1.0)
    state.take_outer_gradient(1, params)
    assert state.awaiting == [False, True]
    state.count_step(tokens=5, seconds=1.0)
    state.apply(1, 4, state.mark[1].clone(), params)
    assert state.awaiting == [False, False]
    assert state.counters[1] == FragmentCounters() and state.counters[0].steps == 2


def test_apply_alpha_half_mixes() -> None:
    state, params = _state(alpha=0.5)
    local = state.plan.gather(1, params) + 2.0
    state.plan.scatter(1, local, {k: v.data for k, v in params.items()})
    value = torch.full((state.plan.numel(1),), 4.0)
    state.apply(1, 3, value, params)
    # theta = alpha * local + (1 - alpha) * global
    mixed = 0.5 * local + 0.5 * value
    torch.testing.assert_close(state.plan.gather(1, params), mixed)
    torch.testing.assert_close(state.mark[1], mixed)
    assert state.base_version[1] == 3


def test_counters_count_every_step_and_reset_on_apply() -> None:
    state, params = _state()
    for _ in range(5):
        state.count_step(tokens=64, seconds=0.1)
    for c in state.counters:
        assert (c.steps, c.tokens) == (5, 320) and c.time == pytest.approx(0.5)
    state.apply(0, 1, state.mark[0].clone(), params)
    assert (state.counters[0].steps, state.counters[0].tokens, state.counters[0].time) == (0, 0, 0.0)
    assert state.counters[1].steps == 5 and state.counters[1].tokens == 320
    state.count_step(tokens=10, seconds=1.0)
    assert (state.counters[0].steps, state.counters[0].tokens) == (1, 10)
    assert (state.counters[1].steps, state.counters[1].tokens) == (6, 330)


def test_full_outer_cycle_matches_manual_computation() -> None:
    """Train a bit, send mark - local, receive global - lr * delta, apply: local == new global."""
    state, params = _state(count=2, H=4, alpha=0.0)
    with torch.no_grad():
        params["w"].mul_(0.9)
        params["emb"].add_(0.01)
    for p in range(2):
        base = state.mark[p].clone()
        delta, _ = state.take_outer_gradient(p, params)
        new_global = base - 0.7 * delta
        state.apply(p, state.base_version[p] + 1, new_global, params)
        assert torch.equal(state.plan.gather(p, params), new_global)
    assert state.base_version == [8, 9]
