"""`dldctl report`: the thin command around `dldctl.observe.report.build_report`.

The CLI resolves `--run NAME` (or the most recent run) to a run directory and calls
`report_command`; errors are DldErrors (RunError) that the CLI prints as one red line. With
`--json` it prints one `"schema": "dldctl.report/1"` object instead of the list (docs/status.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from dldctl.observe.report import build_report
from syncer.common import strictjson

SCHEMA = "dldctl.report/1"


def report_record(run_dir: Path, out_dir: Path, paths: list[Path]) -> dict[str, Any]:
    """The document of `report --json`: the run, where the report went, every file written."""
    return {
        "schema": SCHEMA,
        "run": Path(run_dir).name,
        "dir": str(run_dir),
        "out": str(out_dir),
        "files": [str(p) for p in paths],
    }


def report_command(
    run_dir: Path, out: Path | None = None, console: Console | None = None, *, json_out: bool = False
) -> list[Path]:
    """Write the plots and summary of `run_dir` into `out` (default: `run_dir/report`) and list them
    (with `json_out`: as one JSON object on stdout)."""
    out_dir = Path(out) if out is not None else Path(run_dir) / "report"
    paths = build_report(Path(run_dir), out_dir)
    if json_out:
        print(strictjson.dumps(report_record(Path(run_dir), out_dir, paths)), flush=True)
        return paths
    console = console or Console(highlight=False)
    console.print(f"[bold green]report[/] of {escape(Path(run_dir).name)} written to {escape(str(out_dir))}")
    for path in paths:
        console.print(f"  {escape(str(path))}")
    return paths
