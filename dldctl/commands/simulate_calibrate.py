"""`dldctl simulate calibrate`: fit the simulator's time constants to a goodput table, predict the rest.

A thin shell over `dldctl/sim/calibrate.py`: read the reference table (the paper's by default, or
`--reference FILE.csv`), fit one time constant per strategy family on one column, print the
constants, the predicted table next to the reference and the errors, or JSON.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from dldctl.commands import simulate_common as sc
from dldctl.errors import UsageError
from dldctl.sim import calibrate as cal
from dldctl.sim import goodput as gp
from dldctl.sim.paper import PAPER_COLUMN, PAPER_SOURCE, PAPER_TABLE1_CSV
from dldctl.units import format_count, parse_count, parse_duration

SCHEMA_CALIBRATE = "dldctl.simulate.calibrate/1"


def load_reference(path: Path | None) -> tuple[cal.Reference, str]:
    """The table and where it came from; a bad file is one UsageError naming it and the line."""
    if path is None:
        return cal.parse_reference(PAPER_TABLE1_CSV), PAPER_SOURCE
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--reference {path}: cannot read it ({exc})") from None
    try:
        return cal.parse_reference(text), str(path)
    except cal.ReferenceError as exc:
        raise UsageError(f"--reference {path}, {exc.where}: {exc.why}") from None


def _label(cell: cal.Cell) -> str:
    name = sc.LABELS[cell.strategy]
    return f"{name} M={cell.learners}" if cell.learners else name


def cells_table(ref: cal.Reference, cells: tuple[cal.Cell, ...]) -> Table:
    """Reference / predicted (error) per cell; the calibration column is marked."""
    table = Table(title="goodput %: reference / predicted (error, points)", title_justify="left")
    table.add_column("strategy", no_wrap=True)
    for n in ref.chips:
        mark = " (fit)" if any(c.calibration and c.chips == n for c in cells) else ""
        table.add_column(f"{format_count(n)} chips{mark}", justify="right", no_wrap=True)
    rows: dict[str, list[str]] = {}
    for c in cells:
        text = f"{100 * c.reference:.0f} / {100 * c.predicted:.1f} [dim]({c.error_points:+.1f})[/]"
        rows.setdefault(_label(c), []).append(text)
    for label, texts in rows.items():
        table.add_row(label, *texts)
    return table


def calibrate(
    reference: Path | None = typer.Option(
        None, "--reference", help="CSV: strategy,learners,<chips>,... rows in %. Default: the paper's table."
    ),
    column: str | None = typer.Option(None, "--column", help="The chip count to fit on (default: the first column)."),
    mtbi_years: float = typer.Option(1.0, "--mtbi-years", help="Mean time between interruptions per chip, years."),
    step_time: str = typer.Option("6s", "--step-time", help="Time of one training step."),
    recovery: str = typer.Option("30m", "--recovery", help="Failure until the failed replica is back in service."),
    failure_domain: str = typer.Option("128", "--failure-domain", help="Chips one failure takes out."),
    checkpoint_cost: str = typer.Option("1s", "--checkpoint-cost", help="Time one checkpoint blocks the job."),
    rate_cv: float = typer.Option(1.0, "--rate-cv", help="Variation of the failure rate between periods."),
    rate_period: str = typer.Option("1h", "--rate-period", help="How long one failure rate holds."),
    hours: float = typer.Option(168.0, "--hours", help="Simulated wall time per run, hours."),
    seeds: int = typer.Option(6, "--seeds", help="Monte Carlo runs per evaluation."),
    as_json: bool = typer.Option(False, "--json", help=f"Print JSON (schema in {sc.SIM_DOC})."),
) -> None:
    """Fit one time constant per strategy family on one column of a goodput table, predict the rest.

    Example: dldctl simulate calibrate            (the Decoupled DiLoCo paper's Table 1, fit at 150k)

    Example: dldctl simulate calibrate --reference my_fleet.csv --column 4096 --mtbi-years 5.8
    """
    if seeds < 1:
        raise UsageError(f"--seeds must be >= 1 (got {seeds})")
    ref, source = load_reference(reference)
    fit_on = (
        sc.parse("--column", column, parse_count) if column else (PAPER_COLUMN if reference is None else ref.chips[0])
    )
    if fit_on not in ref.chips:
        raise UsageError(f"--column {fit_on}: not a column of {source} (columns: {', '.join(map(str, ref.chips))})")
    base = sc.build(
        gp.FleetParams,
        sc.FLEET_FLAGS,
        chips=max(ref.chips),
        learners=max([r.learners or 1 for r in ref.rows]),
        mtbi_s=mtbi_years * gp.YEAR_S,
        step_time_s=sc.parse("--step-time", step_time, parse_duration),
        recovery_s=sc.parse("--recovery", recovery, parse_duration),
        failure_domain=sc.parse("--failure-domain", failure_domain, parse_count),
        checkpoint_cost_s=sc.parse("--checkpoint-cost", checkpoint_cost, parse_duration),
        rate_cv=rate_cv,
        rate_period_s=sc.parse("--rate-period", rate_period, parse_duration),
        horizon_s=hours * 3600.0,
    )
    seed_list = list(range(seeds))
    if not as_json:
        sc.stdout().print(f"[dim]fitting {len(cal.FAMILY_FIELD)} time constants on {format_count(fit_on)} chips ...[/]")
    constants = cal.calibrate(base, ref, fit_on, seed_list)
    cells = cal.predict(base, ref, constants, fit_on, seed_list)
    _report(ref, source, fit_on, constants, cells, as_json)


def _report(
    ref: cal.Reference,
    source: str,
    fit_on: int,
    constants: dict[str, float],
    cells: tuple[cal.Cell, ...],
    as_json: bool,
) -> None:
    summary = cal.error_summary(cells)
    if as_json:
        sc.emit_json(
            {
                "schema": SCHEMA_CALIBRATE,
                "reference": source,
                "column": fit_on,
                "constants_s": constants,
                "errors": summary,
                "cells": [
                    {
                        "strategy": c.strategy,
                        "learners": c.learners,
                        "chips": c.chips,
                        "reference": c.reference,
                        "predicted": c.predicted,
                        "calibration": c.calibration,
                    }
                    for c in cells
                ],
            }
        )
        return
    out = sc.stdout()
    out.print(f"reference: {source}; fitted on {format_count(fit_on)} chips")
    flags = " ".join(f"{sc.FLEET_FLAGS[k]} {v:g}s" for k, v in constants.items())
    out.print(f"constants: {flags}")
    out.print(cells_table(ref, cells))
    out.print(
        f"{summary['cells']} predicted cells: mean |error| {summary['mean_abs_points']:.1f} points, "
        f"max {summary['max_abs_points']:.1f}"
    )
