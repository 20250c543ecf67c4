"""Shared helpers for the benchmarks in bench/ (stdlib + rich only; torch is optional).

Every benchmark in this folder follows the same shape, and these helpers make that shape cheap:

- `parse_args(name, description)`: the common command line, `--quick` (about a minute on 2
  cores) and `--out PATH` (default `bench/results/<name>.json`); add your own options through
  the `extra` callback.
- `measure(fn, repeat=..., warmup=...)`: run `fn` a few times after a warm-up and get a `Timing`
  (best, median, worst, all samples) in seconds. Report `best` or `median` and show the spread:
  the machine may be shared, so a single sample means little.
- `print_table(title, rows, columns)`: a rich table from a list of dicts.
- `write_json(path, payload)`: write the results together with machine info (cpu count, torch
  and python versions, `platform.processor()`, allocator/thread-pool environment variables), the
  command line and a timestamp.
- `overrides("H=64,rebase=true")`: `[run]` overrides from the command line, typed like the
  RunSettings defaults (the fleet benchmarks' `--set` / `--extra`).

A benchmark also runs its baseline in the same process and reports its result as a ratio to it,
so numbers stay comparable across machines. Typical use:

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as python bench/<name>.py
    from bench import common
    args = common.parse_args("syncer_throughput", __doc__)
    t = common.measure(lambda: work(), repeat=5 if args.quick else 20)
    rows = [{"case": "work", "median_ms": t.median * 1e3, "spread": t.spread}]
    common.print_table("Work", rows)
    common.write_json(args.out, {"rows": rows})
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncer.common.atomic import atomic_write

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
_ENV_PREFIXES = ("MALLOC_", "THP_", "OMP_", "MKL_", "LD_PRELOAD", "PYTORCH_")


def parse_args(
    name: str,
    description: str | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
    argv: Sequence[str] | None = None,
) -> argparse.Namespace:
    """`--quick` and `--out PATH` (default bench/results/<name>.json), plus whatever `extra` adds."""
    parser = argparse.ArgumentParser(
        prog=f"bench/{name}.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short run (about a minute on 2 cores)")
    parser.add_argument("--out", type=Path, default=RESULTS / f"{name}.json", help="where to write the JSON results")
    if extra is not None:
        extra(parser)
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Timing:
    """Samples of one measured function, in seconds: wall clock, and this thread's CPU time.

    On a shared machine the CPU time (`.cpu`) is the better "per core" figure: it leaves out the
    time the thread waited for a core (cache and memory contention still show in both).
    """

    samples: tuple[float, ...] = field(default_factory=tuple)
    cpu_samples: tuple[float, ...] = field(default_factory=tuple)

    @property
    def best(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def worst(self) -> float:
        return max(self.samples)

    @property
    def spread(self) -> float:
        """(worst - best) / best: 0.05 means the slowest sample took 5% longer than the fastest."""
        return (self.worst - self.best) / self.best if self.best > 0 else 0.0

    @property
    def cpu(self) -> Timing:
        """The CPU-time samples as a Timing of their own (empty if none were taken)."""
        return Timing(self.cpu_samples)

    def __add__(self, other: Timing) -> Timing:
        return Timing(self.samples + other.samples, self.cpu_samples + other.cpu_samples)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "best_s": self.best,
            "median_s": self.median,
            "worst_s": self.worst,
            "spread": self.spread,
            "n": len(self.samples),
        }
        if self.cpu_samples:
            out["cpu"] = self.cpu.to_dict()
        return out


def measure(
    fn: Callable[[], Any], repeat: int = 7, warmup: int = 1, number: int = 1, setup: Callable[[], Any] | None = None
) -> Timing:
    """Time `fn` `repeat` times (each sample = `number` calls, divided back) after `warmup` calls.

    Each sample records wall-clock time (`time.perf_counter`) and this thread's CPU time
    (`time.thread_time`). `setup`, if given, runs before every sample and is not timed (e.g.
    rebuilding inputs that `fn` consumes). Use `.best` for throughput on a noisy shared machine,
    `.median` for a typical value, `.cpu` for CPU time; `.spread` says how noisy the run was.
    Samples from several calls can be pooled with `+` (e.g. to interleave two measurements).
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    wall, cpu = [], []
    for _ in range(max(1, repeat)):
        if setup is not None:
            setup()
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(number):
            fn()
        cpu.append((time.thread_time() - start_cpu) / number)
        wall.append((time.perf_counter() - start) / number)
    return Timing(tuple(wall), tuple(cpu))


def mb_per_s(nbytes: float, seconds: float) -> float:
    """Throughput in MB/s (10^6 bytes)."""
    return nbytes / seconds / 1e6 if seconds > 0 else float("inf")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or 0.01 <= abs(value) < 1e6:
            return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
        return f"{value:.3g}"
    return str(value)


def print_table(title: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> None:
    """Print `rows` (dicts) as a rich table; `columns` picks and orders keys (default: all, first-seen order)."""
    from rich.console import Console
    from rich.table import Table

    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if rows and isinstance(rows[0].get(col), str) else "right")
    for row in rows:
        table.add_row(*(_cell(row.get(col, "")) for col in columns))
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(width=250)
    console.print(table)


def machine_info() -> dict[str, Any]:
    """CPU count, processor, python and (if importable) torch version and thread count."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:  # pragma: no cover - every benchmark here has torch
        info["torch"] = None
    # settings that change what is measured (allocator, thread pools) when present
    info["env"] = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    return info


def _cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), else None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def shown(path: Path) -> str:
    """`path` relative to the repository when inside it (as results record it), else absolute."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def write_json(path: Path | str, payload: Mapping[str, Any]) -> Path:
    """Write `payload` plus machine info, the command line and a UTC timestamp to `path` (JSON)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        **payload,
    }
    atomic_write(path, json.dumps(doc, indent=2, default=str) + "\n")  # a stopped run never leaves half a file
    return path


def add_set_option(parser: argparse.ArgumentParser, help: str, default: Sequence[str] = ()) -> None:
    """`--set KEY=VALUE,...`, repeatable: every occurrence counts, a later key wins (`overrides`).
    A plain option kept only the last `--set` and dropped the others without a word."""
    parser.add_argument(
        "--set", action="append", default=list(default), metavar="KEY=VALUE,...", help=f"{help} (repeatable)"
    )


def overrides(spec: str | Sequence[str]) -> dict[str, Any]:
    """ "H=64,outer_lr=0.7" -> {"H": 64, "outer_lr": 0.7}, typed like the RunSettings defaults; a
    list (a repeated `--set`) is read in order, a later key winning."""
    from syncer.common.settings import RunSettings

    defaults = RunSettings().to_dict()
    out: dict[str, Any] = {}
    items = spec.split(",") if isinstance(spec, str) else [i for part in spec for i in part.split(",")]
    for item in filter(None, items):
        key, eq, value = item.partition("=")
        if not eq or key not in defaults:
            known = ", ".join(defaults)
            raise SystemExit(f"bench: override {item!r}: expected KEY=VALUE with a [run] key; known: {known}")
        kind = type(defaults[key])
        try:
            out[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
        except ValueError:
            raise SystemExit(f"bench: override {item!r}: {key} takes a {kind.__name__}, not {value!r}") from None
    return out
