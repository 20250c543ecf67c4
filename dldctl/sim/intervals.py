"""Interval arithmetic on numpy arrays for the fleet simulator (pure, vectorized, no I/O).

The simulator never walks time step by step: it turns failure events into intervals (pauses,
stretches with no capacity) and integrates piecewise-constant functions over them. These helpers
do that with sorts and cumulative sums, so a day with tens of thousands of failures costs
milliseconds.
"""

from __future__ import annotations

import numpy as np


def union(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint, sorted intervals covering the union of [starts[i], ends[i]), clipped to [lo, hi]."""
    s = np.clip(np.asarray(starts, dtype=float), lo, hi)
    e = np.clip(np.asarray(ends, dtype=float), lo, hi)
    keep = e > s
    s, e = s[keep], e[keep]
    if s.size == 0:
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    # A new group begins where an interval starts after everything before it has ended.
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, s.size - 1)
    return s[first], reach[last]


def total_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Summed length of disjoint intervals."""
    return float(np.sum(ends - starts)) if starts.size else 0.0


class StepFunction:
    """A right-continuous piecewise-constant function on [0, hi] and its running integral.

    Built from `value0` at time 0 and a change `deltas[i]` at `times[i]`; `floor` clips the value
    from below after summing (a fleet cannot run on fewer than zero chips).
    """

    def __init__(
        self, value0: float, times: np.ndarray, deltas: np.ndarray, hi: float, floor: float | None = None
    ) -> None:
        times = np.asarray(times, dtype=float)
        deltas = np.asarray(deltas, dtype=float)
        inside = (times >= 0.0) & (times < hi)
        times, deltas = times[inside], deltas[inside]
        order = np.argsort(times, kind="stable")
        self.breaks = np.concatenate(([0.0], times[order]))
        values = value0 + np.concatenate(([0.0], np.cumsum(deltas[order])))
        self.values = values if floor is None else np.maximum(values, floor)
        widths = np.diff(np.append(self.breaks, hi))
        self.cumulative = np.concatenate(([0.0], np.cumsum(self.values * widths)))
        self.hi = hi

    def integral_to(self, x: np.ndarray | float) -> np.ndarray:
        """Integral of the function from 0 to each x (x clipped to [0, hi])."""
        x = np.clip(np.asarray(x, dtype=float), 0.0, self.hi)
        j = np.searchsorted(self.breaks, x, side="right") - 1
        return self.cumulative[j] + self.values[j] * (x - self.breaks[j])

    def integral_over(self, starts: np.ndarray, ends: np.ndarray) -> float:
        """Summed integral over intervals [starts[i], ends[i])."""
        if np.size(starts) == 0:
            return 0.0
        return float(np.sum(self.integral_to(ends) - self.integral_to(starts)))

    def total(self) -> float:
        """Integral over the whole of [0, hi]."""
        return float(self.cumulative[-1])

    def where_at_most(self, level: float) -> tuple[np.ndarray, np.ndarray]:
        """Intervals (sorted, possibly adjacent) on which the value is <= level."""
        ends = np.append(self.breaks[1:], self.hi)
        mask = (self.values <= level) & (ends > self.breaks)
        return self.breaks[mask], ends[mask]


def time_with_at_least(
    k: int, total: int, down_starts: list[np.ndarray], down_ends: list[np.ndarray], hi: float
) -> float:
    """Time in [0, hi] during which at least `k` of `total` units are up.

    Unit i is down on its own disjoint intervals (down_starts[i], down_ends[i]). A sweep over all
    interval edges counts how many units are down between consecutive edges.
    """
    if not down_starts or all(s.size == 0 for s in down_starts):
        return hi if total >= k else 0.0
    starts = np.concatenate(down_starts)
    ends = np.concatenate(down_ends)
    times = np.concatenate((starts, ends))
    deltas = np.concatenate((np.ones(starts.size), -np.ones(ends.size)))
    down = StepFunction(0.0, times, deltas, hi)
    lo_down, hi_down = down.where_at_most(total - k)
    return total_length(lo_down, hi_down)


def absorbing_pauses(t: np.ndarray, lost: np.ndarray, pause_s: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Pauses of a unit whose reconfiguration absorbs the failures that happen during it.

    The failure at t[i] (sorted) that finds the unit running starts a pause at t[i] - lost[i]
    (the step in flight is wasted, never before the previous pause ended) that ends at
    t[i] + pause_s; every failure before that end joins the same pause. The failure that starts
    the next pause is found for every i at once (a sorted search); only the walk along that
    chain is a Python loop, over plain integers. Returns disjoint sorted intervals in [0, hi].
    """
    n = int(t.size)
    if n == 0:
        return union(np.empty(0), np.empty(0), 0.0, hi)
    following = np.maximum(np.searchsorted(t, t + pause_s, side="left"), np.arange(1, n + 1)).tolist()
    chain: list[int] = []
    i = 0
    while i < n:
        chain.append(i)
        i = following[i]
    first = np.asarray(chain)
    ends = t[first] + pause_s
    previous_end = np.concatenate(([0.0], ends[:-1]))
    starts = np.maximum(t[first] - lost[first], previous_end)
    return union(starts, ends, 0.0, hi)
