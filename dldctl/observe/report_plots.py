"""The PNG plots of `dldctl report`, drawn from the series of `report_series` (matplotlib, Agg).

Each function draws one figure of a `RunRecord` into a file (and returns it). What is drawn (where lines break,
where a rollback is, what a fault line says) is decided in `report_series`, which is pure and
unit-tested; this module only maps it onto axes: NaN breaks a line, the time between two pieces of
measurement is shaded "no data", fault lines carry their labels on staggered rows near the top,
every legend sits beside its axes, where it covers no line. The one shaping done here is the
bandwidth plot's: a rate averaged over a few rounds, and its mean (pure functions, tested).
Plots use matplotlib's object API on the Agg canvas: no display, no pyplot global state.
"""

from __future__ import annotations

import itertools
import math
import statistics
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dldctl.observe import report_series as rs
from dldctl.observe.view_data import fmt_rate

if TYPE_CHECKING:
    from dldctl.observe.runrecord import RunRecord

FAULT_COLOURS = {  # mark kind -> line colour
    "fault_inject": "tab:purple",
    "death": "tab:red",
    "syncer_death": "black",
    "host_unreachable": "tab:orange",
}
ROW_STEP = 0.075  # axes fraction between two label rows
LEGEND_WIDTH = 38  # characters of a legend label's line
SMOOTH_MIN_S = 20.0  # the shortest window a plotted rate is averaged over
SMOOTH_STEPS = 4  # ... and at least this many of its counter's steps
Counter = Callable[[dict], float | None]  # a sample's running total (bytes moved so far)


def _figure(title: str, xlabel: str, ylabel: str, rows: int = 1) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(9, 4.5 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]
    axes[0].set_title(title)
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    return fig, axes


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded yet", ha="center", va="center", transform=ax.transAxes, color="grey")


def _drawn(line: rs.Line) -> bool:
    return any(not math.isnan(y) for y in line.y)


def shade_gaps(ax: Any, run: RunRecord) -> None:
    """Grey the time between two pieces of measurement (a gap or a syncer restart): no data."""
    label: str | None = "no data (gap, restart)"
    for start, end in rs.no_data_spans(run.samples, run.events):
        ax.axvspan(start - run.t0, end - run.t0, color="grey", alpha=0.15, lw=0, label=label)
        label = None


def fault_lines(ax: Any, run: RunRecord) -> None:
    """A dashed line per fault and death; its label ("kill learner-1") on its row near the top."""
    marks = rs.label_rows(rs.fault_marks(run.events, run.t0), min_gap=(run.t1 - run.t0 + 1.0) / 10)
    transform = ax.get_xaxis_transform()  # x in data, y in axes fraction
    for m in marks:
        colour = FAULT_COLOURS.get(m.kind, "tab:grey")
        ax.axvline(m.x, color=colour, linestyle="--", alpha=0.7, linewidth=1)
        if m.label:
            ax.text(
                m.x,
                0.97 - m.row * ROW_STEP,
                f" {m.label}",
                transform=transform,
                fontsize=7,
                color=colour,
                ha="left",
                va="top",
                bbox={"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 0.5},
            )


def _legend(ax: Any) -> None:
    """The legend beside the axes, top-aligned, so that it never covers a line (constrained layout
    makes room); a long label wrapped, so that the plot keeps its width."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        wrapped = [textwrap.fill(label, LEGEND_WIDTH) for label in labels]
        ax.legend(
            handles,
            wrapped,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            borderaxespad=0.0,
            fontsize="small",
            ncol=1 + len(handles) // 14,
        )


def plot_loss(run: RunRecord, path: Path) -> Figure:
    """Loss against tokens merged, one segment per stretch that only moves forward, rollbacks marked
    and the work they undid faded."""
    fig, (ax,) = _figure("loss vs tokens merged", "tokens merged", "loss")
    segments = rs.loss_segments(run.samples, run.events)
    lines = rs.loss_lines(segments)
    styles = {"loss_train": ("-", "tab:blue"), "loss_eval": ("o-", "tab:orange"), "loss_global": ("s-", "tab:green")}
    faded: str | None = "undone by a rollback (faded)"
    for key, parts in lines.items():
        style, colour = styles[key]
        for i, line in enumerate(parts):
            alpha, label = (0.3, faded) if line.undone else (1.0, line.label if i == 0 else None)
            faded = None if line.undone else faded
            ax.plot(line.x, line.y, style, color=colour, label=label, markersize=4, alpha=alpha)
    for m in rs.rollback_marks(segments):
        if math.isnan(m.y):
            ax.axvline(m.x, color="tab:red", linestyle=":", label=m.label)
        else:
            ax.plot([m.x], [m.y], "X", color="tab:red", markersize=10, label=m.label)
    if lines:
        _legend(ax)
    else:
        _no_data(ax, "loss")
    fig.savefig(path)
    return fig


def plot_goodput(run: RunRecord, path: Path) -> Figure:
    """Goodput (whole run and last 60 s) over time, broken at gaps, each fault labelled."""
    fig, (ax,) = _figure("goodput over time", "time since start (s)", "goodput (%)")
    for line in rs.goodput_lines(run.samples, run.events, run.t0):
        ax.plot(line.x, line.y, label=line.label)
    ax.set_ylim(0, 115)
    shade_gaps(ax, run)
    fault_lines(ax, run)
    _legend(ax)
    if not run.samples:
        _no_data(ax, "goodput")
    fig.savefig(path)
    return fig


def plot_throughput(run: RunRecord, path: Path) -> Figure:
    """Tokens/s of each learner and the fleet's total; nothing drawn where the syncer did not know."""
    fig, (ax,) = _figure("throughput", "time since start (s)", "tokens/s")
    lines = rs.throughput_lines(run.samples, run.events, run.t0)
    for line in lines:
        total = line.label == "total"
        ax.plot(line.x, line.y, "k--" if total else "-", label=line.label, linewidth=1 if total else 1.2)
    shade_gaps(ax, run)
    fault_lines(ax, run)
    ax.set_ylim(bottom=0)
    _legend(ax)
    if not any(_drawn(line) for line in lines):
        _no_data(ax, "throughput")
    fig.savefig(path)
    return fig


def smoothing_window(parts: Sequence[list[dict]], counter: Counter) -> float:
    """Seconds a rate is averaged over: several of the counter's steps (bytes move once per round,
    so a rate between two samples is a sawtooth of bursts and silences), at least SMOOTH_MIN_S."""
    between: list[float] = []
    for part in parts:
        known = [(s["t"], v) for s in part if (v := counter(s)) is not None]
        rises = [b[0] for a, b in itertools.pairwise(known) if b[1] > a[1]]  # when a step landed
        between += [b - a for a, b in itertools.pairwise(rises)]
    typical = statistics.median(between) if between else 0.0
    return max(SMOOTH_MIN_S, SMOOTH_STEPS * typical)


def window_rate(label: str, parts: Sequence[list[dict]], counter: Counter, t0: float, window_s: float) -> rs.Line:
    """Per-second increase of a counter over the last `window_s` of its piece, at each sample once
    half a window (of a shorter piece: half the piece) lies behind it, so that the first seconds
    after a start or a restart are not read as a rate; a break between pieces, never a rate across one."""
    xs: list[float] = []
    ys: list[float] = []
    for part in parts:
        known = [(s["t"], v) for s in part if (v := counter(s)) is not None]
        ready = min(window_s, known[-1][0] - known[0][0]) / 2 if known else 0.0
        first = 0
        points = []
        for t, v in known:
            while known[first][0] < t - window_s:
                first += 1
            t_a, v_a = known[first]
            if t > t_a and t - known[0][0] >= ready:
                points.append((t - t0, (v - v_a) / (t - t_a)))
        if points and xs:
            xs, ys = [*xs, xs[-1]], [*ys, math.nan]
        xs += [x for x, _ in points]
        ys += [y for _, y in points]
    return rs.Line(label, xs, ys)


def mean_rate(parts: Sequence[list[dict]], counter: Counter) -> float | None:
    """The counter's increase per second over the time its pieces cover (gaps left out)."""
    grown = spent = 0.0
    for part in parts:
        known = [(s["t"], v) for s in part if (v := counter(s)) is not None]
        if len(known) > 1:
            grown += known[-1][1] - known[0][1]
            spent += known[-1][0] - known[0][0]
    return grown / spent if spent > 0 else None


def plot_bandwidth(run: RunRecord, path: Path) -> Figure:
    """Bytes/s up + down against what data-parallel training would move: each a rate smoothed over
    a few rounds (within pieces only) and its mean over the run, the legend beside the axes."""
    fig, (ax,) = _figure("bandwidth vs data-parallel", "time since start (s)", "bytes/s (log scale)")
    parts = rs.pieces(run.samples, run.events)
    series = (("DiLoCo up + down", rs.moved, "tab:green"), ("data-parallel", rs.ddp_bytes, "tab:orange"))
    drawn = False
    for label, counter, colour in series:
        window = smoothing_window(parts, counter)
        line = window_rate(f"{label}, {window:.0f} s window", parts, counter, run.t0, window)
        mean = mean_rate(parts, counter)
        if not _drawn(line) or mean is None:
            continue
        drawn = True
        ax.plot(line.x, line.y, label=line.label, color=colour)
        ax.axhline(mean, color=colour, linestyle=":", alpha=0.8, label=f"{label}, run mean {fmt_rate(mean)}")
    if drawn and any(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
        ax.set_yscale("log")
    shade_gaps(ax, run)
    _legend(ax)
    if not drawn:
        _no_data(ax, "traffic")
    fig.savefig(path)
    return fig


def plot_quorum(run: RunRecord, path: Path) -> Figure:
    """Live learners and the minimum quorum (steps, broken at gaps) and contributors per round."""
    fig, (ax,) = _figure("quorum", "time since start (s)", "learners")
    lines = rs.quorum_lines(run.samples, run.events, run.t0)
    styles = {"live": {"color": "tab:blue"}, "minimum quorum": {"color": "tab:red", "linestyle": "--"}}
    for line in lines:
        ax.step(line.x, line.y, where="post", label=line.label, **styles.get(line.label, {}))
    rounds = [(r["t"] - run.t0, len(r["contributors"])) for r in run.rounds if isinstance(r.get("contributors"), list)]
    if rounds:
        ax.plot([x for x, _ in rounds], [y for _, y in rounds], ".", label="round contributors", color="tab:green")
    if not run.samples and run.rounds:  # no samples: the rounds' own minimum
        least = [(r["t"] - run.t0, rs.number(r.get("quorum"))) for r in run.rounds]
        ax.step([x for x, _ in least], [y for _, y in least], where="post", label="minimum quorum", color="tab:red")
    top = max([y for line in lines for y in line.y if not math.isnan(y)] + [y for _, y in rounds], default=1)
    ax.set_ylim(0, top + 1.5)
    ax.yaxis.get_major_locator().set_params(integer=True)
    shade_gaps(ax, run)
    fault_lines(ax, run)
    _legend(ax)
    if not lines and not rounds:
        _no_data(ax, "quorum")
    fig.savefig(path)
    return fig


def plot_headline(run: RunRecord, path: Path) -> Figure:
    """The headline ratios over time: data-parallel-equivalent bytes per byte moved, and goodput."""
    fig, (top, bottom) = _figure("headline: traffic saved and goodput", "time since start (s)", "", rows=2)
    ratio = rs.ratio_line(run.samples, run.events, run.t0)
    top.set_ylabel("data-parallel bytes / bytes moved (x)")
    if _drawn(ratio):
        top.plot(ratio.x, ratio.y, color="tab:green", label=ratio.label)
        final = next((y for y in reversed(ratio.y) if not math.isnan(y)), None)
        if final is not None:
            top.axhline(final, color="tab:green", alpha=0.3, linestyle=":", label=f"run so far: {final:,.0f}x")
    else:
        _no_data(top, "traffic")
    shade_gaps(top, run)
    _legend(top)
    bottom.set_ylabel("goodput (%)")
    for line in rs.goodput_lines(run.samples, run.events, run.t0):
        bottom.plot(line.x, line.y, label=line.label)
    bottom.set_ylim(0, 115)
    shade_gaps(bottom, run)
    fault_lines(bottom, run)
    _legend(bottom)
    fig.savefig(path)
    return fig


WRITERS = {
    "loss.png": plot_loss,
    "goodput.png": plot_goodput,
    "throughput.png": plot_throughput,
    "bandwidth.png": plot_bandwidth,
    "quorum.png": plot_quorum,
    "headline.png": plot_headline,
}
