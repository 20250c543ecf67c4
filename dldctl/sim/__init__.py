"""The pure simulation core behind `dldctl simulate`: fleet goodput and wide-area bandwidth.

No I/O, no clock, no global random state: parameters and a numpy Generator (or seeds) go in,
frozen results come out. `dldctl/commands/simulate.py` is the thin shell that parses flags and prints.

    goodput.py     one job under data-parallel, elastic data-parallel, Decoupled DiLoCo
    montecarlo.py  spread over seeds, sweeps over chip and learner counts
    bandwidth.py   link needs of data-parallel vs Decoupled DiLoCo, utilization on a given link
    intervals.py   vectorized interval arithmetic the simulator is built on
    units.py       "30m", "1.2M", "12B" and friends
"""

from dldctl.sim.bandwidth import LinkParams, LinkReport, Transfer, link_report
from dldctl.sim.goodput import (
    DATA_PARALLEL,
    DILOCO,
    ELASTIC,
    STRATEGIES,
    YEAR_S,
    FleetParams,
    RunResult,
    failure_times,
    simulate,
)
from dldctl.sim.montecarlo import Spread, Summary, monte_carlo, sweep

__all__ = [
    "DATA_PARALLEL",
    "DILOCO",
    "ELASTIC",
    "STRATEGIES",
    "YEAR_S",
    "FleetParams",
    "LinkParams",
    "LinkReport",
    "RunResult",
    "Spread",
    "Summary",
    "Transfer",
    "failure_times",
    "link_report",
    "monte_carlo",
    "simulate",
    "sweep",
]
