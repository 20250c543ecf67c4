"""`dldctl report`: a run's metrics and events turned into PNG plots and a markdown summary.

Reads two JSON-lines files of the run directory, written by the syncer, the supervisor and chaos:
`metrics.jsonl` ("round" records, one per merge, and "sample" records every ~2 s) and
`events.jsonl` (joins, deaths, restarts, faults, quorum changes, ...). It works on a finished run
and on a live one: a half-written last line, a malformed line or an unknown kind is skipped.

Writes into the output directory the plots of `report_plots` (loss.png: loss vs tokens merged,
a segment per stretch after a rollback; goodput.png; throughput.png: tokens/s per learner;
bandwidth.png: bytes/s against the data-parallel equivalent; quorum.png; headline.png: the
data-parallel/bytes-moved ratio and goodput over time) and summary.md linking them (with a "Data"
section where the syncer kept the data ledger: `data_rows`). What each plot
draws, with gaps as gaps and no rate across a restart, is `report_series` (pure, unit-tested).
A run whose global model was not scored says so, and why (syncer/common/unscored.py).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from dldctl.errors import RunError
from dldctl.observe import report_series as rs
from dldctl.observe import runs
from dldctl.observe.runrecord import RunRecord
from dldctl.observe.snapshot_model import Figures
from dldctl.observe.view_data import fmt_bytes, fmt_duration
from dldctl.rundir import RunDir
from syncer.common import unscored

PLOTS = ("loss.png", "goodput.png", "throughput.png", "bandwidth.png", "quorum.png", "headline.png")


_number = rs.number


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
    events = read_jsonl(run_dir / "events.jsonl")
    why = unscored.from_records(samples, events, runs.eval_every(RunDir(run_dir)))
    return RunRecord(run_dir.resolve().name, samples, rounds, events, why)


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
        if key != "loss_global" or values or not run.unscored:
            rows.append((f"{label} loss (final / min)", f"{_fmt(final)} / {_fmt(best)}"))
    if run.unscored:
        rows.append(("global model", f"not scored ({run.unscored})".replace("|", "\\|")))  # a markdown cell
    return rows


def _traffic_rows(end: Figures) -> list[tuple[str, str]]:
    up, down, ddp = end.bytes_up, end.bytes_down, end.ddp_equivalent
    moved = up + down
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
    last = run.samples[-1] if run.samples else None
    end = Figures.from_sample(last) if last else Figures()  # where the run ended, as `down` and `runs` say
    trained, merged = end.tokens_trained, end.tokens_merged
    share = f" ({100 * merged / trained:.1f}% merged)" if trained else ""
    measured = [s for part in rs.pieces(run.samples, run.events) for s in part]  # not a blind restarted syncer's
    full = [s for s in measured if s["t"] >= run.t0 + 60.0]  # windows that span a whole minute
    windows = [v for v in (_number(s.get("goodput_window")) for s in full) if v is not None]
    goodput = end.goodput
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
        ("tokens trained / merged", f"{trained:,.0f} / {merged:,.0f}{share}"),
        *_traffic_rows(end),
        ("outer steps", "-" if last is None or "outer_steps" not in last else f"{end.outer_steps}"),
        *_round_rows(run),
        *_honesty_rows(run),
    ]


def _honesty_rows(run: RunRecord) -> list[tuple[str, str]]:
    """What the plots leave blank and where the run went back."""
    spans = rs.no_data_spans(run.samples, run.events)
    total = sum(b - a for a, b in spans)
    marks = rs.rollback_marks(rs.loss_segments(run.samples, run.events))
    return [
        ("no data (gaps, syncer restarts)", f"{len(spans)} stretch(es), {total:.1f} s" if spans else "none"),
        ("rollbacks", "; ".join(m.label for m in marks) if marks else "none"),
        ("quarantined learners", quarantine_text(run.events)),
    ]


def quarantine_text(events: Sequence[dict]) -> str:
    """Who the syncer's screen quarantined, how often, and the numbers of the last time."""
    shut = [e for e in events if e.get("kind") == "quarantined"]
    if not shut:
        return "none"
    last: dict[str, dict] = {}
    for e in shut:
        last[str(e.get("target"))] = e
    counts = {lid: sum(1 for e in shut if str(e.get("target")) == lid) for lid in last}
    return "; ".join(f"{lid} {counts[lid]}x, last: {str(e.get('detail', ''))[:160]}" for lid, e in sorted(last.items()))


LEDGER_EVENTS = ("epoch_done", "units_requeued", "units_partial", "data_mismatch")


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def data_rows(run: RunRecord) -> list[tuple[str, str]]:
    """The data ledger's final figures (docs/data.md): the newest sample's `data_*` keys and the
    ledger's events by kind; [] for a run without the ledger (`data_order = "shards"`, a factory
    that takes no units, or a syncer from before it)."""
    last = next((s for s in reversed(run.samples) if _number(s.get("data_epoch")) is not None), None)
    counts = Counter(e["kind"] for e in run.events if e["kind"] in LEDGER_EVENTS)
    if last is None and not counts:
        return []
    last = last or {}
    share = _number(last.get("data_merged_share"))
    rows = [
        ("data epoch", f"{_count(_number(last.get('data_epoch')))} ({counts.get('epoch_done', 0)} merged whole)"),
        ("units of this epoch merged", "-" if share is None else f"{100 * share:.1f}%"),
        ("units in flight", _count(_number(last.get("data_in_flight")))),
        (
            "units lost / reissued (run total)",
            f"{_count(_number(last.get('data_lost')))} / {_count(_number(last.get('data_reissued')))}",
        ),
        ("tokens merged by the ledger", _count(_number(last.get("data_merged_tokens")))),
    ]
    by_learner = last.get("data_tokens_by_learner")
    if isinstance(by_learner, dict) and by_learner:
        cells = (f"{lid}: {_count(_number(v))}" for lid, v in sorted(by_learner.items(), key=lambda kv: _lid(kv[0])))
        rows.append(("tokens merged per learner", ", ".join(cells)))
    rows.append(("ledger events", ", ".join(f"{kind} {counts.get(kind, 0)}" for kind in LEDGER_EVENTS)))
    return rows


def _lid(name: str) -> tuple[int, str]:
    tail = name.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else 1 << 30, name)


def write_summary(run: RunRecord, path: Path) -> None:
    """summary.md: the table, the data ledger's (when the run kept one), event counts by kind, and the plots."""
    out = [f"# Run report: {run.name}", "", "| | |", "|---|---|"]
    out += [f"| {what} | {value} |" for what, value in summary_rows(run)]
    ledger = data_rows(run)
    if ledger:
        out += ["", "## Data", "", "| | |", "|---|---|"] + [f"| {what} | {value} |" for what, value in ledger]
    out += ["", "## Events", ""]
    counts = Counter(e["kind"] for e in run.events)
    if counts:
        out += ["| kind | count |", "|---|---|"] + [f"| {k} | {v} |" for k, v in sorted(counts.items())]
    else:
        out.append("No events recorded.")
    out += ["", "## Plots", ""] + [f"![{name[:-4]}]({name})" for name in PLOTS] + [""]
    path.write_text("\n".join(out), encoding="utf-8")


def build_report(run_dir: Path, out_dir: Path) -> list[Path]:
    """Write the plots (PLOTS) and summary.md of `run_dir` into `out_dir`; return their paths."""
    from dldctl.observe.report_plots import WRITERS  # matplotlib: only when a report is drawn

    run = load_run(Path(run_dir))
    out_dir = Path(out_dir)
    paths = [out_dir / name for name in PLOTS] + [out_dir / "summary.md"]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in paths[:-1]:
            WRITERS[path.name](run, path)
        write_summary(run, paths[-1])
    except OSError as exc:
        raise RunError(
            f"cannot write the report to {out_dir}: {exc.strerror or exc}", hint="choose another directory with --out"
        ) from exc
    return paths
