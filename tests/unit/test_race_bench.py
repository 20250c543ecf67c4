"""bench/race.py's scoring (the run itself needs root, namespaces and minutes: it is a benchmark):
the fleet's first step from its samples, the curves within the window, the time to a target and
the ratio against data-parallel, and the verdict's numbers."""

from __future__ import annotations

from bench import race, race_thin


def test_the_fleet_starts_at_its_first_step_not_at_up() -> None:
    samples = [
        {"t": 10.0, "learners": {"learner-0": {"step": 0, "tokens": 0, "tokens_per_s": 0.0}}},
        {"t": 12.0, "learners": {"learner-0": {"step": 4, "tokens": 2000, "tokens_per_s": 1000.0}}},
    ]
    assert race.fleet_start(samples) == 10.0  # 2000 tokens at 1000/s: it started 2 s before
    assert race.fleet_start(samples[:1]) is None
    evals = [{"t": 9.0, "loss": 5.0}, {"t": 20.0, "loss": 3.0}, {"t": 200.0, "loss": 1.0}]
    assert race.fleet_curve(evals, 10.0, 120.0) == [(10.0, 3.0)]


def _runs() -> dict:
    link = {"bytes_total": 1e9, "peak_util": 0.9, "mean_util": 0.5, "blocked_share": 0.8}
    quiet = {"bytes_total": 1e7, "peak_util": 0.01, "mean_util": 0.005, "blocked_share": 0.01}
    return {
        "1gbit|data-parallel": {"curve": [(10.0, 3.0), (100.0, 2.0)], **link},
        "10mbit|data-parallel": {"curve": [(50.0, 4.0), (110.0, 3.5)], **link},
        "10mbit|synchronous DiLoCo": {"curve": [(10.0, 3.4), (60.0, 2.0)], **quiet},
        "10mbit|Decoupled DiLoCo": {"curve": [(5.0, 3.5), (20.0, 2.0)], **quiet},
    }


def test_time_to_the_loss_data_parallel_ended_at() -> None:
    rows = {(r["rate"], r["strategy"]): r for r in race.rows(_runs(), 120.0)}
    dec = rows[("10mbit", "Decoupled DiLoCo")]
    assert dec["DP's final loss here"] == 3.5 and dec["time to it s"] == 5.0
    assert dec["x sooner than DP"] == "22.0"  # DP got there at 110 s
    assert dec["time to DP 1gbit target s"] == 20.0
    verdict = race.verdict(list(rows.values()))
    assert verdict["decoupled >= 10x sooner than DP at 10mbit"] == 22.0
    assert verdict["decoupled >= 2x sooner than synchronous at 10mbit"] == 3.0  # 60 s against 20 s
    assert verdict["decoupled blocked < 2% at every rate"] == 0.01


def test_a_run_that_never_reaches_the_target_is_a_lower_bound() -> None:
    assert race._speedup(None, 10.0, 120.0) == ">= 12.0"
    assert race._speedup(50.0, None, 120.0) is None
    assert race.time_to([(1.0, 5.0), (2.0, None), (3.0, 2.0)], 2.5) == 3.0  # type: ignore[list-item]


def test_the_thin_race_times_each_way_to_synchronous_int4s_final_loss() -> None:
    link = {"bytes_total": 1e6, "peak_util": 1.0, "mean_util": 0.9, "blocked_share": 0.9}
    runs = {
        "data-parallel": {"curve": [(40.0, 5.5), (80.0, 5.4)], **link},
        "synchronous DiLoCo": {"curve": [(30.0, 5.0), (120.0, 3.0)], **link},
        "Decoupled DiLoCo": {"curve": [(10.0, 5.0), (100.0, 3.2)], **link, "blocked_share": 0.004},
        "Decoupled DiLoCo thin": {"curve": [(5.0, 4.0), (40.0, 2.9)], **link, "blocked_share": 0.005},
    }
    rows = {r["strategy"]: r for r in race_thin.rows(runs)}
    assert rows["Decoupled DiLoCo thin"]["time to DP's final loss s"] == 5.0
    assert rows["Decoupled DiLoCo thin"]["time to sync's final loss s"] == 40.0
    assert rows["Decoupled DiLoCo"]["time to sync's final loss s"] is None  # never got to 3.0
    verdict = race_thin.verdict(list(rows.values()))
    assert verdict["thin: x sooner than synchronous int4 to its final loss (target >= 2)"] == 3.0  # 120 s vs 40 s
    assert verdict["thin: blocked (target < 0.02)"] == 0.005
    # each way has its own fleet directory: the thin one does not share the decoupled one's
    assert [race.home_name(s) for s in race_thin.STRATEGIES[1:]] == ["synchronous", "decoupled", "decoupled-thin"]
    thin = race.fleet_settings(race.THIN)
    assert (thin["link"], thin["compression"], thin["outer_lr"], thin["outer_momentum"]) == ("thin", "topk", 1.0, 0.0)
    variant = race.fleet_settings(f"{race.THIN} H=16 topk_keep=128")
    assert (variant["H"], variant["topk_keep"], variant["link"]) == (16, 128, "thin")
    assert race.home_name(f"{race.THIN} H=16") == "decoupled-thin-h16"  # a valid run name
