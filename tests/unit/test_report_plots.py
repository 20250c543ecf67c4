"""The report's plots: the bandwidth plot's rate averaged over a window (no sawtooth of rounds),
its mean over the run, never a rate across a syncer restart; and on recorded runs, every legend
beside its axes, covering no line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dldctl.observe import report_plots as rp
from dldctl.observe.report import load_run

RECORDED = Path(__file__).resolve().parents[1] / "data"


def counter(sample: dict) -> float | None:
    return sample.get("bytes")


def bursts(start: float, seconds: int, every: int, size: float, base: float = 0.0) -> list[dict]:
    """One sample a second; the counter grows by `size` at every `every`-th: bytes moving per round."""
    return [{"t": start + i, "bytes": base + size * (i // every)} for i in range(seconds + 1)]


def test_a_rate_of_bursts_is_averaged_into_a_flat_line() -> None:
    part = bursts(100.0, 60, every=4, size=400.0)
    window = rp.smoothing_window([part], counter)
    assert window == rp.SMOOTH_MIN_S  # 4 steps of 4 s are under the floor
    line = rp.window_rate("r", [part], counter, 100.0, window)
    drawn = [y for x, y in zip(line.x, line.y, strict=True) if x >= window]
    assert drawn and all(80 <= y <= 120 for y in drawn), drawn  # 100 B/s, not 0 and 400 in turn
    assert min(line.x) >= window / 2  # nothing from the first seconds, when a rate is one burst or none
    assert rp.mean_rate([part], counter) == pytest.approx(6000 / 60)


def test_slow_rounds_widen_the_window() -> None:
    assert rp.smoothing_window([bursts(0.0, 120, every=10, size=1.0)], counter) == 4 * 10


def test_no_rate_across_a_restart_and_the_mean_leaves_the_gap_out() -> None:
    before = bursts(0.0, 30, every=2, size=20.0)  # 10 B/s
    after = bursts(50.0, 30, every=2, size=60.0, base=5.0)  # a restarted syncer's own counters: 30 B/s
    line = rp.window_rate("r", [before, after], counter, 0.0, 10.0)
    cut = [i for i, y in enumerate(line.y) if math.isnan(y)]
    assert len(cut) == 1
    assert all(x <= 30 for x in line.x[: cut[0]]) and all(x >= 50 for x in line.x[cut[0] + 1 :])
    assert all(y < 15 for y in line.y[: cut[0]]) and all(y > 20 for y in line.y[cut[0] + 1 :])
    assert rp.mean_rate([before, after], counter) == pytest.approx((300 + 900) / 60)
    assert rp.mean_rate([[{"t": 1.0, "bytes": None}]], counter) is None


@pytest.mark.parametrize("run", ["run_recorded", "run_faults"])
def test_every_legend_sits_beside_its_axes(run: str, tmp_path: Path) -> None:
    record = load_run(RECORDED / run)
    for name, draw in rp.WRITERS.items():
        fig = draw(record, tmp_path / name)
        fig.canvas.draw()
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is not None:
                assert not legend.get_window_extent().overlaps(ax.get_window_extent()), name


def test_the_bandwidth_plot_draws_a_smoothed_rate_and_its_mean(tmp_path: Path) -> None:
    fig = rp.plot_bandwidth(load_run(RECORDED / "run_recorded"), tmp_path / "bandwidth.png")
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels[0].startswith("DiLoCo up + down, ") and labels[0].endswith(" s window")
    assert labels[1].startswith("DiLoCo up + down, run mean ") and labels[1].endswith("B/s")
    assert any(label.startswith("data-parallel, run mean ") for label in labels)
