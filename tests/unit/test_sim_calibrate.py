"""Calibration of the simulator's time constants: the table reader, and fits that recover known constants."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dldctl.sim import calibrate as cal
from dldctl.sim.goodput import DATA_PARALLEL, DILOCO, ELASTIC, YEAR_S, FleetParams
from dldctl.sim.paper import PAPER_COLUMN, PAPER_TABLE1_CSV

pytestmark = pytest.mark.timeout(120)

# A small, fast fleet: chips fail every ~105 s at 30k chips with a 0.1-year MTBI.
BASE = FleetParams(chips=60_000, learners=4, mtbi_s=0.1 * YEAR_S, horizon_s=24 * 3600.0)
SEEDS = [0, 1, 2]
TRUE = {"restart_s": 40.0, "reconfig_s": 15.0, "learner_reconfig_s": 30.0}


def synthetic_table() -> str:
    """A table the simulator itself produced with the TRUE constants, at 30k and 60k chips."""
    ref = cal.parse_reference(
        "strategy,learners,30000,60000\ndata_parallel,,50,50\nelastic_data_parallel,,50,50\n"
        "decoupled_diloco,2,50,50\ndecoupled_diloco,4,50,50\n"
    )
    cells = cal.predict(BASE, ref, TRUE, 30_000, SEEDS)
    lines = ["strategy,learners,30000,60000"]
    for row in ref.rows:
        values = [100 * c.predicted for c in cells if c.strategy == row.strategy and c.learners == row.learners]
        lines.append(f"{row.strategy},{row.learners or ''},{values[0]:.4f},{values[1]:.4f}")
    return "\n".join(lines) + "\n"


def test_the_paper_table_reads() -> None:
    ref = cal.parse_reference(PAPER_TABLE1_CSV)
    assert ref.chips == (150_000, 300_000, 600_000, 1_200_000) and ref.chips[0] == PAPER_COLUMN
    rows = {(r.strategy, r.learners): r.goodput for r in ref.rows}
    assert rows[(DATA_PARALLEL, None)] == (0.72, 0.57, 0.38, 0.27)
    assert rows[(DILOCO, 8)][-1] == pytest.approx(0.88) and len(rows) == 5


@pytest.mark.parametrize(
    ("text", "where", "why"),
    [
        ("", "table", "empty"),
        ("chips,150000\n", "line 1", "header"),
        ("strategy,learners,150000\n", "table", "no rows"),
        ("strategy,learners,150000,150000\nelastic_data_parallel,,88,80\n", "line 1", "distinct"),
        ("strategy,learners,150000\nmagic,,88\n", "line 2", "not one of"),
        ("# comment\nstrategy,learners,150000\n\nelastic_data_parallel,,88,80\n", "line 4", "2 values for 1"),
        ("strategy,learners,150000\ndecoupled_diloco,,88\n", "line 2", "learners"),
        ("strategy,learners,150000\nelastic_data_parallel,4,88\n", "line 2", "learners"),
        ("strategy,learners,150000\nelastic_data_parallel,,188\n", "line 2", "between 0 and 100"),
        ("strategy,learners,150000\nelastic_data_parallel,,lots\n", "line 2", "not a number"),
    ],
)
def test_a_bad_table_names_its_line(text: str, where: str, why: str) -> None:
    with pytest.raises(cal.ReferenceError) as err:
        cal.parse_reference(text)
    assert err.value.where == where and why in err.value.why


def test_calibration_recovers_the_constants_that_made_the_table() -> None:
    ref = cal.parse_reference(synthetic_table())
    fitted = cal.calibrate(BASE, ref, 30_000, SEEDS)
    assert set(fitted) == set(TRUE)
    for field, value in TRUE.items():
        assert fitted[field] == pytest.approx(value, rel=0.1), field
    cells = cal.predict(BASE, ref, fitted, 30_000, SEEDS)
    summary = cal.error_summary(cells)
    assert summary["cells"] == 4  # the 60k column: DP, elastic, M = 2 and 4
    assert summary["max_abs_points"] < 1.0


def test_families_are_fitted_apart() -> None:
    # Only the elastic row is given: only its constant is fitted, the others keep their defaults.
    ref = cal.parse_reference("strategy,learners,30000\nelastic_data_parallel,,80\n")
    fitted = cal.calibrate(BASE, ref, 30_000, SEEDS)
    assert list(fitted) == ["reconfig_s"]
    fleet = cal.with_constants(BASE, fitted)
    assert cal.mean_goodput(replace(fleet, chips=30_000, learners=1, quorum=1), ELASTIC, SEEDS) == pytest.approx(
        0.80, abs=0.01
    )
    with pytest.raises(cal.ReferenceError, match="not a column"):
        cal.calibrate(BASE, ref, 12_345, SEEDS)
