"""Fit the simulator's three time constants to a reference goodput table, then predict the rest.

Pure: a table (parsed from CSV text), base parameters and seeds go in; constants and predicted
cells come out. Each strategy family has exactly one time constant, fitted on one column of the
table (one fleet size) and then used unchanged for every other cell:

    data-parallel           restart_s           the restart from a checkpoint
    elastic data-parallel   reconfig_s          the pause that drops failed replicas
    Decoupled DiLoCo        learner_reconfig_s  one learner's pause, shared by every M

A fit minimizes the squared goodput error of the family's rows in the calibration column over a
log-spaced grid, then refines by golden-section search. The Monte Carlo runs on fixed seeds
(common random numbers), so the objective is a deterministic function of the constant.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from dldctl.sim.goodput import DATA_PARALLEL, DILOCO, ELASTIC, STRATEGIES, FleetParams, simulate

FAMILY_FIELD = {DATA_PARALLEL: "restart_s", ELASTIC: "reconfig_s", DILOCO: "learner_reconfig_s"}
SEARCH_S = (0.5, 7200.0)  # the range a time constant is searched in, seconds


class ReferenceError(ValueError):
    """A reference table that cannot be read: `where` names the line or column at fault."""

    def __init__(self, where: str, why: str) -> None:
        self.where = where
        self.why = why
        super().__init__(f"{where}: {why}")


@dataclass(frozen=True)
class Row:
    """One strategy (and learner count, for DiLoCo) across the table's fleet sizes."""

    strategy: str
    learners: int | None
    goodput: tuple[float, ...]  # fractions, one per column


@dataclass(frozen=True)
class Reference:
    """A goodput table: columns are chip counts, rows strategies."""

    chips: tuple[int, ...]
    rows: tuple[Row, ...]


@dataclass(frozen=True)
class Cell:
    """One cell of the table: the reference value and the simulator's prediction."""

    strategy: str
    learners: int | None
    chips: int
    reference: float
    predicted: float
    calibration: bool  # in the column the constants were fitted on

    @property
    def error_points(self) -> float:
        """Predicted minus reference, in percentage points."""
        return 100.0 * (self.predicted - self.reference)


def _number(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ReferenceError(where, f"{text!r} is not a number") from None


def _header(cells: list[str]) -> tuple[int, ...]:
    if len(cells) < 3 or [c.strip().lower() for c in cells[:2]] != ["strategy", "learners"]:
        raise ReferenceError("line 1", "the header must be: strategy,learners,<chips>,<chips>,...")
    chips = tuple(int(_number(c, f"line 1, column {i + 3}")) for i, c in enumerate(cells[2:]))
    if any(n < 1 for n in chips) or len(set(chips)) != len(chips):
        raise ReferenceError("line 1", "chip counts must be distinct and >= 1")
    return chips


def _row(cells: list[str], width: int, line: int) -> Row:
    where = f"line {line}"
    strategy = cells[0].strip()
    if strategy not in STRATEGIES:
        raise ReferenceError(where, f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if len(cells) != width + 2:
        raise ReferenceError(where, f"{len(cells) - 2} values for {width} chip counts")
    learners = cells[1].strip()
    if (strategy == DILOCO) != bool(learners):
        raise ReferenceError(where, "learners is set for decoupled_diloco rows and only for them")
    values = tuple(_number(c, where) / 100.0 for c in cells[2:])
    if any(not 0.0 <= v <= 1.0 for v in values):
        raise ReferenceError(where, "goodput values are percentages between 0 and 100")
    return Row(strategy, int(_number(learners, where)) if learners else None, values)


def parse_reference(text: str) -> Reference:
    """Read a CSV table: `strategy,learners,<chips>,...`, then one row per strategy, goodput in %.

    Blank lines and lines starting with `#` are skipped. Raises ReferenceError naming the line.
    """
    lines = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip() and not line.startswith("#")]
    if not lines:
        raise ReferenceError("table", "is empty")
    parsed = [(n, next(csv.reader(io.StringIO(line)))) for n, line in lines]
    chips = _header(parsed[0][1])
    rows = tuple(_row(cells, len(chips), n) for n, cells in parsed[1:])
    if not rows:
        raise ReferenceError("table", "has a header but no rows")
    return Reference(chips, rows)


def with_constants(base: FleetParams, constants: dict[str, float]) -> FleetParams:
    """The base parameters with the fitted constants in place (the others as they were)."""
    return replace(
        base,
        restart_s=constants.get("restart_s", base.restart_s),
        reconfig_s=constants.get("reconfig_s", base.reconfig_s),
        learner_reconfig_s=constants.get("learner_reconfig_s", base.learner_reconfig_s),
    )


def mean_goodput(params: FleetParams, strategy: str, seeds: Sequence[int]) -> float:
    """Monte Carlo mean goodput of one strategy on one fleet."""
    return float(np.mean([simulate(strategy, params, np.random.default_rng(s)).goodput for s in seeds]))


def _fleet(base: FleetParams, row: Row, chips: int) -> FleetParams:
    learners = row.learners or 1
    return replace(base, chips=chips, learners=learners, quorum=min(base.quorum, learners))


def _golden(f: Callable[[float], float], lo: float, hi: float, steps: int) -> float:
    """Minimize f on [lo, hi] in log space by golden-section search."""
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = math.log(lo), math.log(hi)
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(math.exp(d))
    return math.exp((a + b) / 2.0)


def fit_family(base: FleetParams, ref: Reference, strategy: str, column: int, seeds: Sequence[int]) -> float:
    """The family's time constant that best reproduces its rows in column `column` (seconds)."""
    rows = [r for r in ref.rows if r.strategy == strategy]
    field = FAMILY_FIELD[strategy]
    chips = ref.chips[column]

    def loss(value: float) -> float:
        fitted = with_constants(base, {field: value})
        return sum((mean_goodput(_fleet(fitted, r, chips), strategy, seeds) - r.goodput[column]) ** 2 for r in rows)

    grid = np.geomspace(*SEARCH_S, num=15)
    losses = [loss(float(v)) for v in grid]
    best = int(np.argmin(losses))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, grid.size - 1)]
    return round(_golden(loss, float(lo), float(hi), steps=12), 1)


def calibrate(base: FleetParams, ref: Reference, column_chips: int, seeds: Sequence[int]) -> dict[str, float]:
    """Fit each family present in the table on the column of `column_chips` chips."""
    if column_chips not in ref.chips:
        raise ReferenceError("column", f"{column_chips} chips is not a column of the table ({ref.chips})")
    column = ref.chips.index(column_chips)
    families = [s for s in STRATEGIES if any(r.strategy == s for r in ref.rows)]
    return {FAMILY_FIELD[s]: fit_family(base, ref, s, column, seeds) for s in families}


def predict(
    base: FleetParams, ref: Reference, constants: dict[str, float], column_chips: int, seeds: Sequence[int]
) -> tuple[Cell, ...]:
    """Every cell of the table, simulated with the fitted constants."""
    fitted = with_constants(base, constants)
    return tuple(
        Cell(
            r.strategy,
            r.learners,
            n,
            r.goodput[i],
            mean_goodput(_fleet(fitted, r, n), r.strategy, seeds),
            n == column_chips,
        )
        for r in ref.rows
        for i, n in enumerate(ref.chips)
    )


def error_summary(cells: Sequence[Cell]) -> dict[str, float]:
    """Mean and max absolute error (points) over the predicted cells, those outside calibration."""
    errors = [abs(c.error_points) for c in cells if not c.calibration]
    if not errors:
        return {"cells": 0, "mean_abs_points": 0.0, "max_abs_points": 0.0}
    return {"cells": len(errors), "mean_abs_points": float(np.mean(errors)), "max_abs_points": float(max(errors))}
