"""The fleet's round clock (`round_clock = "syncer"`): when each fragment's round is called, and
how long a called round waits. Pure: times and step times are passed in.

ALGORITHM.md, "Rounds gather the fleet": round r of fragment p is the fleet's r-th sync of p.
Learners whose pushes follow their own step counters are out of phase (each restart starts at
step 0), so with a minimum quorum below the fleet almost every push became a round of its own.
Here the syncer keeps one clock for the fleet instead. Its phase counts fleet inner steps:

    phase += dt / t_step          t_step = median seconds per step of the live, training learners

and fragment p's round is called each time the phase passes k*H + (p+1)*H/P (one fragment every
H/P fleet steps, each every H, as the learners' own schedule had it). A call goes to every
connected learner; each answers at its next step boundary with the work it did on p since its
previous push. With nobody training the clock stands still.

A learner's seconds per step are measured from the step counters its heartbeats report (over
at least 2 s), so evaluations, syncs and waits between steps are counted: the calls then come
every H steps the learners really take, not every H steps of pure compute.

A called round closes once it holds `quorum` contributors and either every live learner has
answered the call (work that waited in it from before the call is no answer) or its window has
passed (one still below quorum at the fragment's next turn is called again:
syncer/core.py):

    window = (1 + gamma) * tau * t_step + LINK_S

A learner answers at its next step boundary, so the window waits for every learner up to `tau`
times slower than the fleet's median, with `gamma` as margin for a loaded host, and never
longer. Waiting costs the learners nothing (they train on; with `rebase` the steps trained
meanwhile are kept); it only makes the reply a few steps later. A slower learner's push arrives
after the close and waits, at full token weight, for the next call of the fragment (a push that
arrives before a call never closes a round on its own).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

LINK_S = 0.05  # both sides poll their sockets every 20 ms, and the push is encoded before it leaves


@dataclass
class RoundClock:
    """The fleet's phase in inner steps, and which fragments' rounds it has called."""

    H: int
    fragments: int
    phase: float = 0.0
    last: float | None = None
    t_step: float | None = None

    def offset(self, p: int) -> float:
        """Phase (mod H) at which fragment p is called: (p + 1) * H / P."""
        return (p + 1) * self.H / self.fragments

    def advance(self, now: float, step_times: Sequence[float]) -> list[int]:
        """Move the phase to `now`; the fragments whose call point it passed (each at most once)."""
        times = [t for t in step_times if t > 0 and math.isfinite(t)]
        if not times:
            self.last = now  # nobody training: the clock stands still
            return []
        self.t_step = statistics.median(times)
        before = self.phase
        if self.last is not None:
            self.phase += max(0.0, now - self.last) / self.t_step
        self.last = now
        return [p for p in range(self.fragments) if _crossings(before, self.phase, self.offset(p), self.H) > 0]

    def window(self, tau: int, gamma: float) -> float:
        """Seconds a called round waits for the live learners (see the module docstring)."""
        if self.t_step is None:
            return LINK_S
        return (1.0 + gamma) * max(1, tau) * self.t_step + LINK_S

    def steps_per_period(self, step_time: float) -> float:
        """Inner steps a learner with this step time trains in one sync period of the fleet."""
        if self.t_step is None or step_time <= 0 or not math.isfinite(step_time):
            return float(self.H)
        return self.H * self.t_step / step_time


def _crossings(before: float, after: float, offset: float, period: float) -> int:
    """How many times the points offset + k * period lie in (before, after]."""
    return math.floor((after - offset) / period) - math.floor((before - offset) / period)
