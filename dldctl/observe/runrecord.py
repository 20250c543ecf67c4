"""A run's records as the report reads them: samples, rounds and events, sorted by time (the data
`report` loads and `report_plots` draws; its own module so neither imports the other)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunRecord:
    """What the run directory holds, split by kind and sorted by time."""

    name: str
    samples: list[dict]
    rounds: list[dict]
    events: list[dict]
    unscored: str | None = None  # why the global model has no score (None: it has)

    @property
    def t0(self) -> float:
        """The first time stamp of any record (the run's start as far as the files know)."""
        return min(r["t"] for r in self.samples + self.rounds + self.events)

    @property
    def t1(self) -> float:
        """The last time stamp of any record."""
        return max(r["t"] for r in self.samples + self.rounds + self.events)
