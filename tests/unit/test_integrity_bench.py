"""bench/integrity.py's judgement of one class (`row`), on recorded-shaped data: a sharded run's
scores are unguarded (`good` null) and count as no guard trip; a flagged score does."""

from __future__ import annotations

from typing import Any

from bench import badlearner, integrity


def _run(scores: list[dict[str, Any]], final: float, tokens: int) -> dict[str, Any]:
    return {
        "inspect": {"scores": scores, "quorum": [(50.0, integrity.LEARNERS)]},
        "chaos": {"t": 20.0, "detail": "x"},
        "training_started": 0.0,
        "training_ended": 60.0,
        "eval_loss": final,
        "tokens_merged": tokens,
    }


def _scores(good: bool | None, losses: list[float]) -> list[dict[str, Any]]:
    return [{"t": 10.0 * i, "loss": x, "tokens_merged": 1000 * i, "good": good} for i, x in enumerate(losses, 1)]


def test_a_sharded_runs_unguarded_scores_are_no_trips_and_are_judged_like_any() -> None:
    clean = _run(_scores(True, [3.0, 2.8, 2.6, 2.4, 2.2]), 2.2, 5000)
    sharded = _run(_scores(None, [3.0, 2.8, 2.6, 2.4, 2.2]), 2.2, 5000)
    out = integrity.row("sharded", sharded, [clean])
    assert out["guard trips"] == 0 and out["met"], out
    assert abs(out["final vs clean"]) < 1e-9
    flagged = _run(
        [*_scores(True, [3.0, 2.8]), {"t": 30.0, "loss": 9.0, "tokens_merged": 3000, "good": False}], 2.2, 3000
    )
    assert integrity.row("x", flagged, [clean])["guard trips"] == 1


def test_an_unguarded_curve_is_a_reference_curve() -> None:
    assert integrity.at_tokens(_scores(None, [3.0, 2.0]), 1500) == 2.5


def test_the_clean_run_trains_longer_than_the_longest_class() -> None:
    at, longest, settle = 40.0, 60.0, 45.0
    clean = integrity.plan_for("clean", None, longest, {}, at, integrity.clean_settle(at, longest, settle))
    faulted = integrity.plan_for("x", lambda f, s, d: "", longest, {}, at, settle)
    assert clean.duration_s is not None and faulted.duration_s is not None
    assert clean.duration_s == faulted.duration_s * (1 + integrity.CLEAN_MARGIN)


def test_the_rate_is_a_line_through_the_window_not_two_noisy_scores() -> None:
    """A steady drop of 0.01 a second with +-2% alternating noise on every score: the rate reads
    the same for two runs whose scores at the window's two ends happen to be noisy both ways."""

    def noisy(sign: int) -> dict[str, Any]:
        scores = [
            {"t": t, "loss": (3.0 - 0.01 * t) * (1 + sign * 0.02 * (-1) ** int(t)), "tokens_merged": 100 * t}
            for t in range(100)
        ]
        return {"inspect": {"scores": scores}, "training_started": 0.0}

    ratio = badlearner.rate_ratio(noisy(1), noisy(-1), (0.0, 20.0, 80.0))
    assert ratio is not None and abs(ratio - 1.0) < 0.05, ratio
    assert badlearner.rate_ratio(noisy(1), {"inspect": {"scores": []}, "training_started": 0.0}, (0, 20, 80)) is None


def test_a_rest_class_is_held_to_the_fleet_without_the_bad_learner() -> None:
    """Losing a learner for good costs the fleet its plateau (the fleet without it is behind the
    clean one at equal tokens); a rest class is judged against that fleet, and says both."""
    clean = _run(_scores(True, [3.0, 2.8, 2.6, 2.4, 2.2]), 2.2, 5000)
    without = _run(_scores(True, [3.1, 2.9, 2.7, 2.5, 2.3]), 2.3, 5000)
    rest = _run(_scores(True, [3.1, 2.9, 2.7, 2.5, 2.3]), 2.3, 5000)
    out = integrity.versus_without(rest, {"clean": clean, "without": without})
    assert out["final vs without"] is not None and abs(out["final vs without"]) < 1e-9
    assert out["without vs clean"] is not None and abs(out["without vs clean"] - (2.3 / 2.2 - 1)) < 1e-9
