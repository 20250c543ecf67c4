"""`dldctl report`: the thin command around `dldctl.observe.report.build_report`.

The CLI resolves `--run NAME` (or the most recent run) to a run directory and calls
`report_command`; errors are DldErrors (RunError) that the CLI prints as one red line.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape

from dldctl.observe.report import build_report


def report_command(run_dir: Path, out: Path | None = None, console: Console | None = None) -> list[Path]:
    """Write the plots and summary of `run_dir` into `out` (default: `run_dir/report`) and list them."""
    out_dir = Path(out) if out is not None else Path(run_dir) / "report"
    paths = build_report(Path(run_dir), out_dir)
    console = console or Console(highlight=False)
    console.print(f"[bold green]report[/] of {escape(Path(run_dir).name)} written to {escape(str(out_dir))}")
    for path in paths:
        console.print(f"  {escape(str(path))}")
    return paths
