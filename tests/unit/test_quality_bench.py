"""bench/quality.py's rows and plot when the data-parallel baseline failed (the run itself takes
minutes: it is a benchmark). A failed baseline once crashed the plot before the JSON was written,
losing a 25-minute run's DiLoCo results."""

from __future__ import annotations

from pathlib import Path

from bench import quality


def _rows(dp_loss: float | None) -> list[dict]:
    extra = {"runs": 1}
    return [
        quality.row("data-parallel (gloo)", 100, dp_loss, dp_loss, extra),  # type: ignore[arg-type]
        quality.row("DiLoCo tau=2", 100, 1.7, dp_loss, extra),
    ]


def test_rows_without_a_baseline_have_no_gap_and_still_plot(tmp_path: Path) -> None:
    rows = _rows(None)
    assert rows[1]["vs DP"] is None
    quality.plot(rows, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 0


def test_rows_with_a_baseline_carry_the_gap(tmp_path: Path) -> None:
    rows = _rows(1.6)
    assert abs(rows[1]["vs DP"] - 0.0625) < 1e-9
    quality.plot(rows, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 0
