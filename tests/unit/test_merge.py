"""The syncer's pure merge core, against values computed by hand: token weights, weighted mean,
radial-directional averaging (RDA), per-segment merge (plain mean for embeddings), the Nesterov
outer step (torch.optim.SGD semantics), the grace window, the round-closing rule, robust
clipping, the fleet fraction and the EMA.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from syncer import merge
from syncer.common import smallmath

FAST = settings(max_examples=100, deadline=None, derandomize=True)


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# -- token weights -----------------------------------------------------------------------------


def test_token_weight_is_tokens_squared_over_steps() -> None:
    assert merge.token_weight(100, 10) == 1000.0  # 100 * (100 / 10)
    assert merge.token_weight(2048, 16) == 262144.0  # 2048 * 128
    assert merge.token_weight(3, 2) == 4.5  # 3 * 1.5
    # twice the batch over the same steps: 4x the weight; same tokens in half the steps: 2x
    assert merge.token_weight(200, 10) == 4 * merge.token_weight(100, 10)
    assert merge.token_weight(100, 5) == 2 * merge.token_weight(100, 10)


@pytest.mark.parametrize(("tokens", "steps"), [(0, 10), (100, 0), (-5, 10), (100, -1), (0, 0)])
def test_token_weight_degenerate_is_zero(tokens: int, steps: int) -> None:
    assert merge.token_weight(tokens, steps) == 0.0


# -- weighted mean -------------------------------------------------------------------------------


def test_weighted_mean_by_hand() -> None:
    a, b = _t(1.0, 2.0, 3.0), _t(5.0, -2.0, 0.0)
    # weights 1 and 3: (1*a + 3*b) / 4 = (16/4, -4/4, 3/4)
    out = merge.weighted_mean([a, b], [1.0, 3.0])
    assert torch.allclose(out, _t(4.0, -1.0, 0.75))
    # the inputs are untouched
    assert torch.equal(a, _t(1.0, 2.0, 3.0)) and torch.equal(b, _t(5.0, -2.0, 0.0))
    # scale invariance of the weights
    assert torch.allclose(merge.weighted_mean([a, b], [10.0, 30.0]), out)
    assert torch.equal(merge.weighted_mean([a], [7.0]), a)


def test_weighted_mean_needs_positive_total() -> None:
    with pytest.raises(ValueError):
        merge.weighted_mean([_t(1.0)], [0.0])
    with pytest.raises(ValueError):
        merge.weighted_mean([_t(1.0), _t(2.0)], [1.0, -1.0])


# -- RDA -----------------------------------------------------------------------------------------


def test_rda_two_orthogonal_vectors_by_hand() -> None:
    # v1 = (3, 0), |v1| = 3, weight 1;  v2 = (0, 4), |v2| = 4, weight 3;  total weight 4
    # mean norm   = (1*3 + 3*4) / 4 = 15/4 = 3.75
    # mean unit   = (1*(1, 0) + 3*(0, 1)) / 4 = (0.25, 0.75),  |.| = sqrt(0.625) = sqrt(10)/4
    # direction   = (0.25, 0.75) / (sqrt(10)/4) = (1, 3) / sqrt(10)
    # RDA         = 3.75 * (1, 3) / sqrt(10) = (1.1858541, 3.5575624)
    out = merge.rda_tensor([_t(3.0, 0.0), _t(0.0, 4.0)], [1.0, 3.0])
    expected = 3.75 * _t(1.0, 3.0) / math.sqrt(10.0)
    assert torch.allclose(out, expected, rtol=1e-6, atol=0)
    assert torch.allclose(out, _t(1.1858541, 3.5575624), rtol=1e-6)
    assert float(torch.linalg.vector_norm(out)) == pytest.approx(3.75, rel=1e-6)
    # a plain weighted mean would give (0.75, 3), norm 3.09 < 3.75: RDA keeps the norm
    mean = merge.weighted_mean([_t(3.0, 0.0), _t(0.0, 4.0)], [1.0, 3.0])
    assert torch.allclose(mean, _t(0.75, 3.0))


def test_rda_equal_weights_orthogonal_units_keeps_norm() -> None:
    # M orthogonal unit vectors, equal weights: a mean has norm 1/sqrt(M), RDA has norm 1
    vs = [torch.eye(4)[i] for i in range(4)]
    out = merge.rda_tensor(vs, [1.0] * 4)
    assert torch.allclose(out, torch.full((4,), 0.5))
    assert float(torch.linalg.vector_norm(merge.weighted_mean(vs, [1.0] * 4))) == pytest.approx(0.5)


def test_rda_parallel_vectors_average_their_norms() -> None:
    # same direction, norms 2 and 6, weights 3 and 1: norm (3*2 + 1*6)/4 = 3, direction (1, 0)
    out = merge.rda_tensor([_t(2.0, 0.0), _t(6.0, 0.0)], [3.0, 1.0])
    assert torch.allclose(out, _t(3.0, 0.0))


def test_rda_special_cases() -> None:
    one = _t(1.0, -2.0)
    out = merge.rda_tensor([one], [5.0])
    assert torch.equal(out, one) and out is not one
    # opposite directions, equal weight: directions cancel -> zero (not NaN)
    out = merge.rda_tensor([_t(1.0, 0.0), _t(-1.0, 0.0)], [1.0, 1.0])
    assert torch.equal(out, _t(0.0, 0.0))
    # a zero vector contributes its zero norm to the mean norm but no direction
    # norm = (1*0 + 1*4)/2 = 2, direction (0, 1)
    out = merge.rda_tensor([_t(0.0, 0.0), _t(0.0, 4.0)], [1.0, 1.0])
    assert torch.allclose(out, _t(0.0, 2.0))
    out = merge.rda_tensor([_t(0.0, 0.0), _t(0.0, 0.0)], [1.0, 1.0])
    assert torch.equal(out, _t(0.0, 0.0))


@FAST
@given(
    vectors=st.lists(st.lists(st.floats(-100, 100, width=32), min_size=5, max_size=5), min_size=2, max_size=5),
    weights=st.lists(st.floats(0.01, 100), min_size=5, max_size=5),
)
def test_property_rda_norm_is_weighted_mean_norm(vectors: list[list[float]], weights: list[float]) -> None:
    vs = [torch.tensor(v, dtype=torch.float32) for v in vectors]
    ws = weights[: len(vs)]
    out = merge.rda_tensor(vs, ws)
    assert bool(torch.isfinite(out).all())
    norms = [float(torch.linalg.vector_norm(v)) for v in vs]
    mean_norm = sum(w * n for w, n in zip(ws, norms)) / sum(ws)
    got = float(torch.linalg.vector_norm(out))
    if got > 0:
        assert got == pytest.approx(mean_norm, rel=1e-4, abs=1e-5)
    # and never longer than the longest contribution
    assert got <= max(norms) * (1 + 1e-5) + 1e-6


# -- merge per segment -----------------------------------------------------------------------


def test_merge_rda_per_segment_and_mean_for_embeddings() -> None:
    # fragment of 5 values: [dense 2 | embedding 2 | dense 1]
    segments = [(0, 2, "dense"), (2, 2, "embedding"), (4, 1, "dense")]
    d1 = _t(3.0, 0.0, 1.0, 2.0, 2.0)
    d2 = _t(0.0, 4.0, 5.0, -2.0, 6.0)
    w = [1.0, 3.0]
    out = merge.merge([d1, d2], w, segments, "rda")
    # dense [0:2]: the hand-computed RDA of (3,0),(0,4) with weights 1,3 (see above)
    assert torch.allclose(out[0:2], 3.75 * _t(1.0, 3.0) / math.sqrt(10.0), rtol=1e-6)
    # embedding [2:4]: plain weighted mean (1*(1,2) + 3*(5,-2)) / 4 = (4, -1)
    assert torch.allclose(out[2:4], _t(4.0, -1.0))
    # dense [4:5]: parallel scalars 2 and 6: norm (1*2 + 3*6)/4 = 5, sign +
    assert torch.allclose(out[4:5], _t(5.0))
    # the rule "mean" ignores segments
    assert torch.allclose(merge.merge([d1, d2], w, segments, "mean"), merge.weighted_mean([d1, d2], w))
    # the inputs are untouched
    assert torch.equal(d1, _t(3.0, 0.0, 1.0, 2.0, 2.0))


def test_merge_rda_differs_from_mean_on_dense_segments_only() -> None:
    segments = [(0, 3, "embedding"), (3, 3, "dense")]
    d1, d2 = torch.tensor([1.0, 0, 0, 1, 0, 0]), torch.tensor([0.0, 1, 0, 0, 1, 0])
    rda, mean = merge.merge([d1, d2], [1, 1], segments, "rda"), merge.merge([d1, d2], [1, 1], segments, "mean")
    assert torch.equal(rda[:3], mean[:3])
    assert not torch.allclose(rda[3:], mean[3:])
    assert float(torch.linalg.vector_norm(rda[3:])) == pytest.approx(1.0)


def test_merge_single_contribution_is_itself() -> None:
    d = _t(1.0, 2.0, 3.0)
    for rule in ("rda", "mean"):
        out = merge.merge([d], [42.0], [(0, 3, "dense")], rule)
        assert torch.equal(out, d) and out is not d


def test_merge_zero_weights_fall_back_to_equal_weights() -> None:
    out = merge.merge([_t(2.0, 0.0), _t(0.0, 4.0)], [0.0, 0.0], [(0, 2, "embedding")], "rda")
    assert torch.allclose(out, _t(1.0, 2.0))


def test_merge_errors() -> None:
    with pytest.raises(ValueError):
        merge.merge([], [], [], "rda")
    with pytest.raises(ValueError):
        merge.merge([_t(1.0), _t(2.0)], [1.0, 1.0], [(0, 1, "dense")], "median")


# -- Nesterov outer step -------------------------------------------------------------------------


def test_nesterov_step_by_hand() -> None:
    # theta 1, grad 0.5, buf 0, lr 0.7, momentum 0.9:
    # buf' = 0.9*0 + 0.5 = 0.5; update = 0.5 + 0.9*0.5 = 0.95; theta' = 1 - 0.7*0.95 = 0.335
    theta, buf = merge.nesterov_step(_t(1.0), _t(0.5), _t(0.0))
    assert torch.allclose(theta, _t(0.335)) and torch.allclose(buf, _t(0.5))
    # second step, grad 0.5 again: buf'' = 0.45 + 0.5 = 0.95; update = 0.5 + 0.855 = 1.355
    # theta'' = 0.335 - 0.7*1.355 = -0.6135
    theta, buf = merge.nesterov_step(theta, _t(0.5), buf)
    assert torch.allclose(theta, _t(-0.6135)) and torch.allclose(buf, _t(0.95))


def test_nesterov_step_does_not_modify_inputs() -> None:
    theta, grad, buf = _t(1.0, 2.0), _t(0.1, 0.2), _t(0.3, 0.4)
    merge.nesterov_step(theta, grad, buf)
    assert torch.equal(theta, _t(1.0, 2.0)) and torch.equal(grad, _t(0.1, 0.2)) and torch.equal(buf, _t(0.3, 0.4))


@pytest.mark.parametrize(("lr", "momentum"), [(0.7, 0.9), (1.0, 0.0), (0.3, 0.5)])
def test_nesterov_step_matches_torch_sgd(lr: float, momentum: float) -> None:
    g = torch.Generator().manual_seed(0)
    start = torch.randn(257, generator=g)
    grads = [torch.randn(257, generator=g) for _ in range(12)]
    param = torch.nn.Parameter(start.clone())
    opt = torch.optim.SGD([param], lr=lr, momentum=momentum, nesterov=momentum > 0, dampening=0.0)
    theta, buf = start.clone(), torch.zeros(257)
    for grad in grads:
        opt.zero_grad()
        param.grad = grad.clone()
        opt.step()
        theta, buf = merge.nesterov_step(theta, grad, buf, lr, momentum)
        torch.testing.assert_close(theta, param.detach(), rtol=1e-5, atol=1e-6)
        if momentum > 0:
            torch.testing.assert_close(buf, opt.state[param]["momentum_buffer"], rtol=1e-5, atol=1e-6)


def test_nesterov_defaults_are_diloco_values() -> None:
    import inspect

    params = inspect.signature(merge.nesterov_step).parameters
    assert params["lr"].default == 0.7 and params["momentum"].default == 0.9
    param = torch.nn.Parameter(_t(1.0, -1.0))
    opt = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    theta, buf = _t(1.0, -1.0), torch.zeros(2)
    for k in range(5):
        grad = _t(0.1 * (k + 1), -0.2)
        param.grad = grad.clone()
        opt.step()
        theta, buf = merge.nesterov_step(theta, grad, buf)
    torch.testing.assert_close(theta, param.detach())


def test_merge_folds_factors_and_scale_without_copying() -> None:
    """factors (robust clip) and scale (fleet share) give merge([f*d]) * scale; out may be deltas[0]."""
    g = torch.Generator().manual_seed(3)
    segments = [(0, 40, "dense"), (40, 24, "embedding"), (64, 36, "dense")]
    deltas = [torch.randn(100, generator=g) for _ in range(3)]
    weights, factors, scale = [1.0, 2.0, 0.5], [1.0, 0.25, 0.8], 0.6
    for rule in ("rda", "mean"):
        expected = merge.merge([d * f for d, f in zip(deltas, factors)], weights, segments, rule) * scale
        copies = [d.clone() for d in deltas]
        got = merge.merge(copies, weights, segments, rule, factors=factors, scale=scale)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
        assert all(torch.equal(c, d) for c, d in zip(copies, deltas))  # inputs untouched
        sq = merge.segment_sqnorms(copies, segments)
        inplace = merge.merge(copies, weights, segments, rule, factors=factors, scale=scale, sqnorms=sq, out=copies[0])
        assert inplace is copies[0]
        torch.testing.assert_close(inplace, expected, rtol=1e-5, atol=1e-7)


def test_nesterov_change_in_place_matches_nesterov_step() -> None:
    g = torch.Generator().manual_seed(4)
    theta, buf, residual = torch.randn(300, generator=g), torch.zeros(300), torch.randn(300, generator=g) * 1e-3
    for _ in range(5):
        grad = torch.randn(300, generator=g)
        new_theta, new_buf = merge.nesterov_step(theta, grad, buf, 0.7, 0.9)
        change = merge.nesterov_change_(residual.clone(), grad.clone(), buf, 0.7, 0.9)
        torch.testing.assert_close(buf, new_buf)
        torch.testing.assert_close(change, residual + (new_theta - theta), rtol=1e-5, atol=1e-6)
        theta = new_theta


# -- grace window --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gamma", "tau", "t_step", "t_quorum", "t_sync", "expected"),
    [
        (0.5, 2, 1.0, 0.3, 0.2, 0.75),  # slack 2 - 0.5 = 1.5, * 0.5
        (0.5, 2, 1.0, 1.5, 0.5, 0.0),  # slack exactly 0
        (0.5, 2, 1.0, 2.0, 0.5, 0.0),  # negative slack -> 0, never negative
        (0.5, 0, 1.0, 0.0, 0.0, 0.0),  # no overlap, no grace
        (0.0, 2, 1.0, 0.0, 0.0, 0.0),  # gamma 0 disables it
        (0.9, 4, 0.25, 0.1, 0.1, 0.72),  # slack 1 - 0.2 = 0.8, * 0.9
        (0.5, 2, 3.0, 0.0, 0.0, 3.0),  # quorum at once: half the overlap
    ],
)
def test_grace_window(gamma: float, tau: int, t_step: float, t_quorum: float, t_sync: float, expected: float) -> None:
    assert merge.grace_window(gamma, tau, t_step, t_quorum, t_sync) == pytest.approx(expected)


@FAST
@given(st.floats(0, 0.99), st.integers(0, 10), st.floats(0, 100), st.floats(0, 100), st.floats(0, 100))
def test_property_grace_window_bounds(gamma: float, tau: int, t_step: float, t_quorum: float, t_sync: float) -> None:
    g = merge.grace_window(gamma, tau, t_step, t_quorum, t_sync)
    assert 0.0 <= g <= gamma * tau * t_step + 1e-9


# -- should_close --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("now", "contributors", "quorum", "quorum_at", "grace", "all_in", "expected"),
    [
        (10.0, 0, 1, None, 0.0, False, False),  # nothing in
        (10.0, 1, 2, None, 0.0, True, False),  # below quorum, even if "all live" are in
        (10.0, 1, 2, 5.0, 0.0, True, False),  # below quorum whatever quorum_at says
        (10.0, 2, 2, None, 0.0, True, False),  # quorum_at unknown: not closable
        (10.0, 2, 2, 9.0, 5.0, True, True),  # every live learner in: close at once
        (10.0, 2, 2, 9.0, 5.0, False, False),  # inside the grace window: wait
        (14.0, 2, 2, 9.0, 5.0, False, True),  # grace expired exactly: close
        (13.999, 2, 2, 9.0, 5.0, False, False),
        (9.0, 2, 2, 9.0, 0.0, False, True),  # no grace: close at quorum
        (10.0, 3, 2, 9.0, 5.0, False, False),  # above quorum still waits for grace
        (20.0, 3, 2, 9.0, 5.0, False, True),
    ],
)
def test_should_close(
    now: float, contributors: int, quorum: int, quorum_at: float | None, grace: float, all_in: bool, expected: bool
) -> None:
    assert merge.should_close(now, contributors, quorum, quorum_at, grace, all_in) is expected


# -- clipping, fleet fraction, ema -------------------------------------------------------------


def test_clip_factors() -> None:
    # median of (1, 2, 10) and no history is 2; multiple 2 -> limit 4: 10 is scaled to 4
    assert merge.clip_factors([1.0, 2.0, 10.0], [], 2.0) == [1.0, 1.0, 0.4]
    # history pulls the reference: median of (1, 2, 10, 1, 1) is 1 -> limit 2
    assert merge.clip_factors([1.0, 2.0, 10.0], [1.0, 1.0], 2.0) == [1.0, 1.0, 0.2]
    # disabled
    assert merge.clip_factors([1.0, 100.0], [], 0.0) == [1.0, 1.0]
    assert merge.clip_factors([], [1.0], 2.0) == []
    # a zero norm is never "clipped"
    assert merge.clip_factors([0.0, 3.0, 3.0], [], 1.0) == [1.0, 1.0, 1.0]
    # a single contribution is its own median: never clipped by a multiple >= 1
    assert merge.clip_factors([123.0], [], 1.0) == [1.0]


def test_fleet_fraction() -> None:
    assert merge.fleet_fraction(500, 1000) == 0.5
    assert merge.fleet_fraction(1500, 1000) == 1.0
    assert merge.fleet_fraction(0, 1000) == 0.0
    assert merge.fleet_fraction(-5, 1000) == 0.0
    assert merge.fleet_fraction(10, 0) == 1.0
    assert merge.fleet_fraction(10, -1) == 1.0


def test_ema() -> None:
    assert smallmath.ema(None, 3.0) == 3.0
    assert smallmath.ema(1.0, 3.0, 0.9) == pytest.approx(1.2)
    assert smallmath.ema(1.0, 3.0, 0.8) == pytest.approx(1.4)


def test_a_round_of_part_of_a_period_takes_that_part_of_the_momentum_step() -> None:
    assert merge.partial_momentum(0.9, 1.0) == (0.9, 0.9) and merge.partial_momentum(0.9, 1.3) == (0.9, 0.9)
    decay, look = merge.partial_momentum(0.9, 0.25)
    assert decay == pytest.approx(0.9**0.25) and look == pytest.approx(0.225)
    assert merge.partial_momentum(0.0, 0.5) == (0.0, 0.0)  # plain averaging has no momentum to share
    # an empty partial round (no gradient) moves the model by lr * look * decay * buf, not lr * 0.81 * buf
    buf = torch.ones(10)
    change = merge.nesterov_change_(torch.zeros(10), torch.zeros(10), buf, 0.7, 0.9, share=0.1)
    torch.testing.assert_close(change, torch.full((10,), -0.7 * 0.09 * 0.9**0.1))
    whole = merge.nesterov_change_(torch.zeros(10), torch.zeros(10), torch.ones(10), 0.7, 0.9)
    torch.testing.assert_close(whole, torch.full((10,), -0.7 * 0.81))
