"""bench/integrity.py's judgement of one class (`row`), on recorded-shaped data: a sharded run's
scores are unguarded (`good` null) and count as no guard trip; a flagged score does."""

from __future__ import annotations

from typing import Any

from bench import integrity


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
