"""`dldctl report`: a run's metrics and events turned into PNG plots and a markdown summary.

Reads two JSON-lines files of the run directory, written by the syncer, the supervisor and chaos:
`metrics.jsonl` ("round" records, one per merge, and "sample" records every ~2 s) and
`events.jsonl` (joins, deaths, restarts, faults, quorum changes, ...). It works on a finished run
and on a live one: a half-written last line, a malformed line or an unknown kind is skipped.

Writes into the output directory: loss.png (train/eval loss vs tokens merged), goodput.png
(goodput over time, faults marked), throughput.png (tokens/s per learner), bandwidth.png (bytes/s
against the data-parallel equivalent, log scale), quorum.png (live learners and round
contributors against the minimum) and summary.md linking them. Plots use matplotlib's object API
on the Agg canvas: no display is needed and no pyplot global state is touched.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dldctl.errors import RunError
from dldctl.observe.view_data import fmt_bytes, fmt_duration

PLOTS = ("loss.png", "goodput.png", "throughput.png", "bandwidth.png", "quorum.png")
FAULT_STYLES = {  # event kind -> marker colour on the goodput plot
    "fault_inject": "tab:purple",
    "death": "tab:red",
    "syncer_death": "black",
    "host_unreachable": "tab:orange",
}


@dataclass
class RunRecord:
    """What the run directory holds, split by kind and sorted by time."""

    name: str
    samples: list[dict]
    rounds: list[dict]
    events: list[dict]

    @property
    def t0(self) -> float:
        """The first time stamp of any record (the run's start as far as the files know)."""
        return min(r["t"] for r in self.samples + self.rounds + self.events)

    @property
    def t1(self) -> float:
        """The last time stamp of any record."""
        return max(r["t"] for r in self.samples + self.rounds + self.events)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def read_jsonl(path: Path) -> list[dict]:
    """The objects of a JSON-lines file and of its rotated segment (PATH.1, max_log_mb) that have a
    numeric `t` and a `kind`, sorted by `t` (a missing file is empty; undecodable lines, such as
    a half-written last one, are skipped)."""
    text = _read_text(path.with_name(path.name + ".1")) + "\n" + _read_text(path)
    records = []
    for raw in text.splitlines():
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict) and _number(record.get("t")) is not None and isinstance(record.get("kind"), str):
            records.append(record)
    return sorted(records, key=lambda r: r["t"])


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise RunError(f"cannot read {path}: {exc.strerror or exc}") from exc


def load_run(run_dir: Path) -> RunRecord:
    """Read a run directory; RunError when it holds no metrics yet."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunError(f"run directory {run_dir} does not exist", hint="name a run with --run")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    samples = [m for m in metrics if m["kind"] == "sample"]
    rounds = [m for m in metrics if m["kind"] == "round"]
    if not samples and not rounds:
        raise RunError(
            f"run {run_dir.name} has no metrics yet ({run_dir / 'metrics.jsonl'} is missing or empty)",
            hint="wait for the syncer's first sample, or pick another run with --run",
        )
    return RunRecord(run_dir.resolve().name, samples, rounds, read_jsonl(run_dir / "events.jsonl"))


# ---------------------------------------------------------------- plots


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Any]:
    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded yet", ha="center", va="center", transform=ax.transAxes, color="grey")


def _series(rows: list[dict], key: str, t0: float | None = None) -> tuple[list[float], list[float]]:
    """(x, y) for the rows where `key` is a number; x is `t - t0` (or `t` if t0 is None)."""
    xs, ys = [], []
    for row in rows:
        y = _number(row.get(key))
        if y is not None:
            xs.append(row["t"] - (t0 or 0.0))
            ys.append(y)
    return xs, ys


def plot_loss(run: RunRecord, path: Path) -> None:
    """Train and eval loss (the learners') and the global model's loss against tokens merged."""
    fig, ax = _figure("loss vs tokens merged", "tokens merged", "loss")
    drawn = False
    for key, style, label in (
        ("loss_train", "-", "train"),
        ("loss_eval", "o-", "eval"),
        ("loss_global", "s-", "global model (syncer)"),
    ):
        points = [(_number(s.get("tokens_merged")), _number(s.get(key))) for s in run.samples]
        points = [(x, y) for x, y in points if x is not None and y is not None]
        if points:
            ax.plot([x for x, _ in points], [y for _, y in points], style, label=label, markersize=4)
            drawn = True
    if drawn:
        ax.legend()
    else:
        _no_data(ax, "loss")
    fig.savefig(path)


def _fault_markers(ax: Any, run: RunRecord) -> None:
    labelled = set()
    for event in run.events:
        colour = FAULT_STYLES.get(event["kind"])
        if colour is None:
            continue
        label = None if event["kind"] in labelled else event["kind"]
        labelled.add(event["kind"])
        ax.axvline(event["t"] - run.t0, color=colour, linestyle="--", alpha=0.7, linewidth=1, label=label)


def plot_goodput(run: RunRecord, path: Path) -> None:
    """Goodput (whole run and last 60 s) over time, with a dashed line at every fault and death."""
    fig, ax = _figure("goodput over time", "time since start (s)", "goodput (%)")
    for key, label in (("goodput", "whole run"), ("goodput_window", "last 60 s")):
        xs, ys = _series(run.samples, key, run.t0)
        if xs:
            ax.plot(xs, [100 * y for y in ys], label=label)
    ax.set_ylim(0, 105)
    _fault_markers(ax, run)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right", fontsize="small")
    if not run.samples:
        _no_data(ax, "goodput")
    fig.savefig(path)


def plot_throughput(run: RunRecord, path: Path) -> None:
    """Tokens/s of each learner over time, and the fleet's total."""
    fig, ax = _figure("throughput", "time since start (s)", "tokens/s")
    ids = sorted({lid for s in run.samples if isinstance(s.get("learners"), dict) for lid in s["learners"]})
    for lid in ids:
        rows = [
            {"t": s["t"], "v": s["learners"][lid].get("tokens_per_s")}
            for s in run.samples
            if isinstance(s.get("learners"), dict) and isinstance(s["learners"].get(lid), dict)
        ]
        xs, ys = _series(rows, "v", run.t0)
        ax.plot(xs, ys, label=lid, linewidth=1.2)
    xs, ys = _series(run.samples, "tokens_per_s", run.t0)
    if xs:
        ax.plot(xs, ys, "k--", label="total", linewidth=1)
        ax.legend(fontsize="small", ncol=2)
    else:
        _no_data(ax, "throughput")
    fig.savefig(path)


def _rates(samples: list[dict], value: Callable[[dict], float | None], t0: float) -> tuple[list[float], list[float]]:
    """Per-second rates of a cumulative counter between successive samples (resets skipped)."""
    xs, ys = [], []
    for prev, cur in itertools.pairwise(samples):
        a, b, dt = value(prev), value(cur), cur["t"] - prev["t"]
        if a is not None and b is not None and dt > 0 and b - a > 0:
            xs.append(cur["t"] - t0)
            ys.append((b - a) / dt)
    return xs, ys


def _moved(sample: dict) -> float | None:
    up, down = _number(sample.get("bytes_up")), _number(sample.get("bytes_down"))
    return None if up is None or down is None else up + down


def plot_bandwidth(run: RunRecord, path: Path) -> None:
    """Bytes/s up + down against what data-parallel training would move for the same steps."""
    fig, ax = _figure("bandwidth vs data-parallel", "time since start (s)", "bytes/s (log scale)")
    ours = _rates(run.samples, _moved, run.t0)
    ddp = _rates(run.samples, lambda s: _number(s.get("ddp_equivalent")), run.t0)
    if ours[0]:
        ax.plot(*ours, label="Decoupled DiLoCo (up + down)", color="tab:green")
    if ddp[0]:
        ax.plot(*ddp, label="data-parallel equivalent", color="tab:orange")
    if ours[0] or ddp[0]:
        ax.set_yscale("log")
        ax.legend(fontsize="small")
    else:
        _no_data(ax, "traffic")
    fig.savefig(path)


def plot_quorum(run: RunRecord, path: Path) -> None:
    """Live learners (from samples) and contributors per round, with the minimum quorum as a line."""
    fig, ax = _figure("quorum", "time since start (s)", "learners")
    xs, ys = _series(run.samples, "quorum_live", run.t0)
    if xs:
        ax.step(xs, ys, where="post", label="live", color="tab:blue")
    rounds = [(r["t"] - run.t0, len(r["contributors"])) for r in run.rounds if isinstance(r.get("contributors"), list)]
    if rounds:
        ax.plot([x for x, _ in rounds], [y for _, y in rounds], ".", label="round contributors", color="tab:green")
    mx, my = _series(run.samples or run.rounds, "quorum_min" if run.samples else "quorum", run.t0)
    if mx:
        ax.step(mx, my, where="post", label="minimum quorum", color="tab:red", linestyle="--")
    top = max(ys + [y for _, y in rounds] + my, default=1)
    ax.set_ylim(0, top + 1)
    ax.yaxis.get_major_locator().set_params(integer=True)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="lower right")
    else:
        _no_data(ax, "quorum")
    fig.savefig(path)


# ---------------------------------------------------------------- summary


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _loss_rows(run: RunRecord) -> list[tuple[str, str]]:
    rows = []
    for key, label in (("loss_train", "train"), ("loss_eval", "eval"), ("loss_global", "global model")):
        values = [v for v in (_number(s.get(key)) for s in run.samples) if v is not None]
        final, best = (values[-1], min(values)) if values else (None, None)
        rows.append((f"{label} loss (final / min)", f"{_fmt(final)} / {_fmt(best)}"))
    return rows


def _traffic_rows(last: dict) -> list[tuple[str, str]]:
    up, down, ddp = (_number(last.get(k)) for k in ("bytes_up", "bytes_down", "ddp_equivalent"))
    moved = (up or 0.0) + (down or 0.0)
    times = f" ({ddp / moved:,.0f}x what this run moved)" if ddp and moved else ""
    return [
        ("bytes up / down", f"{fmt_bytes(up)} / {fmt_bytes(down)} (total {fmt_bytes(moved)})"),
        ("data-parallel equivalent", f"{fmt_bytes(ddp)}{times}"),
    ]


def _round_rows(run: RunRecord) -> list[tuple[str, str]]:
    counts = [len(r["contributors"]) for r in run.rounds if isinstance(r.get("contributors"), list)]
    per_fragment = Counter(r.get("fragment") for r in run.rounds)
    frags = ", ".join(f"{k}: {v}" for k, v in sorted(per_fragment.items(), key=lambda kv: str(kv[0])))
    if not counts:
        return [("merge rounds", str(len(run.rounds)))]
    spread = ", ".join(f"{k}: {v}" for k, v in sorted(Counter(counts).items()))
    waits = [w for w in (_number(r.get("wait_quorum_s")) for r in run.rounds) if w is not None]
    grace = [g for g in (_number(r.get("grace_used_s")) for r in run.rounds) if g is not None]
    return [
        ("merge rounds", f"{len(run.rounds)} (per fragment {frags})"),
        (
            "contributors per round",
            f"mean {_mean(counts):.2f}, min {min(counts)}, max {max(counts)} (rounds by contributors {spread})",
        ),
        ("wait for quorum / grace used", f"mean {_fmt(_mean(waits), 2)} s / {_fmt(_mean(grace), 2)} s"),
    ]


def summary_rows(run: RunRecord) -> list[tuple[str, str]]:
    """The summary table: (what, value) pairs."""
    last = run.samples[-1] if run.samples else {}
    trained, merged = _number(last.get("tokens_trained")), _number(last.get("tokens_merged"))
    share = f" ({100 * merged / trained:.1f}% merged)" if trained and merged is not None else ""
    full = [s for s in run.samples if s["t"] >= run.t0 + 60.0]  # windows that span a whole minute
    windows = [v for v in (_number(s.get("goodput_window")) for s in full) if v is not None]
    goodput = _number(last.get("goodput"))
    return [
        ("run", run.name),
        ("duration", f"{fmt_duration(run.t1 - run.t0)} ({_utc(run.t0)} to {_utc(run.t1)})"),
        *_loss_rows(run),
        (
            "goodput (whole run)",
            "-"
            if goodput is None
            else f"{100 * goodput:.1f}%" + (f" (lowest 60 s window {100 * min(windows):.1f}%)" if windows else ""),
        ),
        ("tokens trained / merged", f"{trained or 0:,.0f} / {merged or 0:,.0f}{share}"),
        *_traffic_rows(last),
        ("outer steps", "-" if _number(last.get("outer_steps")) is None else f"{last['outer_steps']}"),
        *_round_rows(run),
    ]


def write_summary(run: RunRecord, path: Path) -> None:
    """summary.md: the table, event counts by kind, and the plots."""
    out = [f"# Run report: {run.name}", "", "| | |", "|---|---|"]
    out += [f"| {what} | {value} |" for what, value in summary_rows(run)]
    out += ["", "## Events", ""]
    counts = Counter(e["kind"] for e in run.events)
    if counts:
        out += ["| kind | count |", "|---|---|"] + [f"| {k} | {v} |" for k, v in sorted(counts.items())]
    else:
        out.append("No events recorded.")
    out += ["", "## Plots", ""] + [f"![{name[:-4]}]({name})" for name in PLOTS] + [""]
    path.write_text("\n".join(out), encoding="utf-8")


def build_report(run_dir: Path, out_dir: Path) -> list[Path]:
    """Write the five plots and summary.md of `run_dir` into `out_dir`; return their paths."""
    run = load_run(Path(run_dir))
    out_dir = Path(out_dir)
    writers = (plot_loss, plot_goodput, plot_throughput, plot_bandwidth, plot_quorum)
    paths = [out_dir / name for name in PLOTS] + [out_dir / "summary.md"]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for writer, path in zip(writers, paths):
            writer(run, path)
        write_summary(run, paths[-1])
    except OSError as exc:
        raise RunError(
            f"cannot write the report to {out_dir}: {exc.strerror or exc}", hint="choose another directory with --out"
        ) from exc
    return paths
