"""bench/wallclock_seeds.py: the window-end mean and the paired ratios across runs (the runs it
reads take 11-17 minutes each: they are bench/wallclock.py's own); wallclock.py's default throttle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import wallclock_seeds as ws

SYNC = "synchronous DiLoCo"


def _result(seed: int, mine: list[tuple[float, float]], theirs: list[tuple[float, float]]) -> dict:
    """A wallclock.py-shaped result: curves of (t, loss), the final row = the last point."""

    def curve(points: list[tuple[float, float]]) -> list[dict]:
        return [{"t": t, "tokens": 0, "eval_loss": loss} for t, loss in points]

    return {
        "duration_s": 100.0,
        "seed": seed,
        "settings": {"lr": 0.001},
        "rows": [
            {"strategy": ws.DEFAULTS, "eval loss": mine[-1][1]},
            {"strategy": SYNC, "eval loss": theirs[-1][1]},
        ],
        "runs": {ws.DEFAULTS: {"curve": curve(mine)}, SYNC: {"curve": curve(theirs)}},
    }


def test_end_mean_takes_only_the_window_tail() -> None:
    points = [(50, 9.0), (89, 2.0), (95, 1.0), (104, 3.0), (120, 9.0)]
    res = {"curve": [{"t": t, "eval_loss": loss} for t, loss in points]}
    assert ws.end_mean(res, 100.0, 12.0) == pytest.approx(2.0)
    assert ws.end_mean({"curve": []}, 100.0, 12.0) is None


def test_the_end_mean_can_disagree_with_the_final_point(tmp_path: Path) -> None:
    # run 1: the defaults lower at every point; run 2: lower on the tail's mean, higher on the last point
    one = _result(1, [(90, 1.60), (100, 1.60)], [(90, 1.70), (100, 1.70)])
    two = _result(2, [(90, 1.60), (95, 1.60), (100, 1.66)], [(90, 1.70), (95, 1.70), (100, 1.65)])
    paths = []
    for i, res in enumerate((one, two)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(res))
    out = tmp_path / "seeds.json"
    assert ws.main([*map(str, paths), "--out", str(out)]) == 0
    rows = {r["strategy"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[SYNC]["defaults won, final"] == "1/2"
    assert rows[SYNC]["defaults won, end mean"] == "2/2"
    assert rows[SYNC]["defaults / it, final"] == pytest.approx((1.60 / 1.70 + 1.66 / 1.65) / 2)
    assert rows[ws.DEFAULTS]["defaults won, final"] is None


def test_a_file_that_is_not_a_result_is_a_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    with pytest.raises(SystemExit, match="cannot read the results"):
        ws.main([str(bad), "--out", str(tmp_path / "o.json")])


def test_wallclock_emulates_one_device_per_learner_where_cores_are_short() -> None:
    from bench import wallclock

    assert wallclock.dedicated_throttle(2) == 3.0  # 4 learners x 1/3 core on 2 cores
    assert wallclock.dedicated_throttle(None) == 3.0
    assert wallclock.dedicated_throttle(wallclock.LEARNERS + 2) == 1.0
    with pytest.raises(SystemExit, match="--throttle must be >= 1"):
        wallclock.main(["--throttle", "0.5", "--out", "/nonexistent/never-written.json"])
