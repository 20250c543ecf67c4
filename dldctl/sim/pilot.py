"""A fleet planned from its own pilot run: goodput under faults and the wire (pure).

`dldctl simulate goodput --from-run` and `simulate bandwidth --from-run` read a run
(dldctl/observe/pilotrun.py) into the records below and ask this module what a fleet of another
size, fault rate or link would do. No I/O; seeds or a numpy Generator go in.

**Goodput.** Goodput is the syncer's: merged learner compute time over provisioned learner time.
A learner that is up is busy `efficiency` of its time (evaluations, waits and the syncer's share
of the CPU take the rest); the pilot's own efficiency is fitted so that its faults reproduce its
measured goodput. A fault costs its victim `down_s` (no training: from a kill until the new
process trains, a pause's length) and `lost_s` (trained but never merged, in the victim's own
seconds). Faults arrive as the chaos monkey draws them: a Poisson process of mean gap `mtbf_s` for
the whole fleet, each with a uniformly drawn victim and kind. A fault lands unless its learner
has no process at all (killed, not yet restarted: the monkey cannot kill or pause it); one on a
learner still down from an earlier fault extends its down time. Each fault's
cost is drawn from what the pilot measured for its kind (a bootstrap), so the pilot's spread of
restart times carries over. With warm spares (one per host), a kill's own cost is what a ready
spare cost in the pilot; a kill that finds its host's spare still starting waits for it, and one
that finds none yet starts a fresh process (the next spare starts a second after a hand-over, but
no sooner than 30 s after the previous one's start, and takes a start-up to be ready):

    goodput = efficiency x (1 - sum over faults of (down + lost) / (learners x horizon))

**The wire.** A learner sends one fragment every H / fragments steps; links are full duplex. With
max_lag 0 (dldctl's default) it never waits for a reply, so a link costs it no compute: a link too
thin for its pushes only merges the unsent ones into the next. With max_lag > 0 it waits for a
reply max_lag steps after its push. The bytes per push and per reply, and a step's compute time,
are the run's own; the pilot's blocked share is a floor no link removes. The time to a loss
scales with the busy share (the global model's loss against merged tokens is the pilot's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dldctl.sim.errors import check
from dldctl.sim.montecarlo import Spread


@dataclass(frozen=True)
class FaultCost:
    """What one fault cost its victim in the pilot, in seconds of that learner."""

    kind: str  # kill, pause, slow, partition, ...
    down_s: float  # not training
    lost_s: float = 0.0  # trained, never merged
    spare_ready: bool = False  # a kill taken over by a warm spare that was ready for it
    gone_s: float = 0.0  # no process at all (a kill, until the restart): a fault then cannot land


KILLS = ("kill", "preempt")


@dataclass(frozen=True)
class Spares:
    """Warm spares, one per host (dldctl/supervise/spares.py): a killed learner's host hands its
    spare over; the next one starts `delay_s` after that restart but no sooner than `retry_s`
    after the previous spare's start, and is ready `cold_start_s` after its own start. A kill
    that finds the spare still starting waits for it; one that finds none yet starts a fresh
    process (as long)."""

    per_host: int
    cold_start_s: float
    delay_s: float = 1.0
    retry_s: float = 30.0


def next_spare(start: float, t: float, delay_s: float, retry_s: float) -> float:
    """When a host's next spare starts after a restart at `t`, its current spare having started
    (or being due to start) at `start`: the supervisor's rule."""
    return max(start + retry_s, t + delay_s) if t >= start else max(start, t + delay_s)


@dataclass(frozen=True)
class GoodputPilot:
    """A pilot run's goodput figures over its measured window."""

    learners: int
    window_s: float
    goodput: float
    faults: tuple[FaultCost, ...]
    spares: Spares | None = None

    def __post_init__(self) -> None:
        check(
            [
                (name, why)
                for name, ok, why in (
                    ("learners", self.learners >= 1, "must be >= 1"),
                    ("window_s", self.window_s > 0, "must be > 0"),
                    ("goodput", 0 <= self.goodput <= 1, "must be in [0, 1]"),
                )
                if not ok
            ]
        )

    @property
    def mtbf_s(self) -> float:
        """The pilot's mean time between faults (the fleet's): inf when none."""
        return self.window_s / len(self.faults) if self.faults else math.inf

    def kinds(self) -> dict[str, int]:
        """Faults per kind, in the order first seen."""
        out: dict[str, int] = {}
        for f in self.faults:
            out[f.kind] = out.get(f.kind, 0) + 1
        return out

    def cost_share(self) -> float:
        """Share of the provisioned learner time the pilot's faults took."""
        return sum(f.down_s + f.lost_s for f in self.faults) / (self.learners * self.window_s)

    def efficiency(self) -> float:
        """Busy share of an up learner that reproduces the measured goodput (at most 1)."""
        up = 1.0 - self.cost_share()
        return min(1.0, self.goodput / up) if up > 0 else 1.0


@dataclass(frozen=True)
class Hit:
    """One fault in a schedule: when, on which learner (an index), what it costs."""

    t: float
    victim: int
    down_s: float
    lost_s: float
    kind: str = ""
    gone_s: float = 0.0


def _spare_wait(h: Hit, spares: Spares | None, hosts: dict[int, float]) -> float:
    """A kill's down time with warm spares: its own (a ready spare's), the rest of the host's
    spare's start-up, or a fresh process's start when no spare has started yet. `hosts`: each
    host's current spare's start (absent: one that has long been ready)."""
    if spares is None or h.kind not in KILLS:
        return h.down_s
    host = h.victim // spares.per_host
    start = hosts.get(host, -math.inf)
    ready = start + spares.cold_start_s
    if h.t >= ready:
        down = h.down_s
    elif h.t >= start:
        down = max(h.down_s, ready - h.t)
    else:
        down = h.down_s + spares.cold_start_s
    hosts[host] = next_spare(start, h.t + h.gone_s, spares.delay_s, spares.retry_s)
    return down


def account(
    efficiency: float, learners: int, horizon_s: float, hits: Sequence[Hit], spares: Spares | None = None
) -> tuple[float, int]:
    """Goodput of a fleet under `hits` (sorted by time) and how many faults landed: all but those
    that came while their learner had no process (killed, not yet restarted); a fault on a learner
    already down extends its down time. Costs past the horizon are cut at it."""
    down_until = [-math.inf] * learners
    gone_until = [-math.inf] * learners
    spare_start: dict[int, float] = {}
    cost, landed = 0.0, 0
    for h in hits:
        v = h.victim
        if h.t >= horizon_s or h.t < gone_until[v]:
            continue
        landed += 1
        down = _spare_wait(h, spares, spare_start)
        if h.kind in KILLS:
            gone_until[v] = h.t + h.gone_s
        start, end = max(h.t, down_until[v]), max(down_until[v], h.t + down)
        cost += max(0.0, min(end, horizon_s) - start) + h.lost_s
        down_until[v] = end
    return efficiency * max(0.0, 1.0 - cost / (learners * horizon_s)), landed


@dataclass(frozen=True)
class Planned:
    """A fault of a schedule: when, on which learner (an index), of which kind."""

    t: float
    victim: int
    kind: str


def costs_by_kind(pilot: GoodputPilot) -> dict[str, list[FaultCost]]:
    """The pilot's faults by kind, in the order first seen; with warm spares a kill's own cost is
    what a kill that found its spare ready cost (the waits for a spare are simulated)."""
    by_kind: dict[str, list[FaultCost]] = {}
    for f in pilot.faults:
        by_kind.setdefault(f.kind, []).append(f)
    if pilot.spares is not None:
        for kind in KILLS:
            ready = [f for f in by_kind.get(kind, []) if f.spare_ready]
            if ready:
                by_kind[kind] = ready
    return by_kind


def draw_schedule(
    pilot: GoodputPilot, learners: int, mtbf_s: float, horizon_s: float, rng: np.random.Generator
) -> list[Planned]:
    """A monkey's schedule: Poisson arrivals, uniform victims and kinds (those the pilot saw)."""
    kinds = list(costs_by_kind(pilot))
    if math.isinf(mtbf_s) or not kinds:
        return []
    n = rng.poisson(horizon_s / mtbf_s)
    times = np.sort(rng.uniform(0.0, horizon_s, size=n))
    victims = rng.integers(0, learners, size=n)
    picks = rng.integers(0, len(kinds), size=n)
    return [Planned(float(t), int(v), kinds[int(k)]) for t, v, k in zip(times, victims, picks, strict=True)]


def cost_hits(pilot: GoodputPilot, schedule: Sequence[Planned], rng: np.random.Generator) -> list[Hit]:
    """Each planned fault with a cost drawn from the pilot's faults of its kind (ParamError for
    a kind the pilot never saw: its cost is unknown)."""
    by_kind = costs_by_kind(pilot)
    unknown = sorted({p.kind for p in schedule} - set(by_kind))
    check([("schedule", f"the run saw no {unknown[0]} fault: its cost is unknown")] if unknown else [])
    hits = []
    for p in schedule:
        seen = by_kind[p.kind]
        cost = seen[int(rng.integers(0, len(seen)))]
        hits.append(Hit(p.t, p.victim, cost.down_s, cost.lost_s, p.kind, cost.gone_s))
    return hits


def draw_hits(
    pilot: GoodputPilot, learners: int, mtbf_s: float, horizon_s: float, rng: np.random.Generator
) -> list[Hit]:
    """A monkey's schedule with each fault's cost drawn from the pilot's."""
    return cost_hits(pilot, draw_schedule(pilot, learners, mtbf_s, horizon_s, rng), rng)


@dataclass(frozen=True)
class GoodputPrediction:
    """Goodput and faults landed, over seeds."""

    learners: int
    mtbf_s: float
    horizon_s: float
    efficiency: float
    goodput: Spread
    faults: Spread

    def to_dict(self) -> dict[str, object]:
        return {
            "learners": self.learners,
            "mtbf_s": None if math.isinf(self.mtbf_s) else self.mtbf_s,
            "horizon_s": self.horizon_s,
            "efficiency": self.efficiency,
            "goodput": self.goodput.to_dict(),
            "faults": self.faults.to_dict(),
        }


def predict_goodput(
    pilot: GoodputPilot,
    learners: int,
    mtbf_s: float,
    horizon_s: float,
    seeds: Sequence[int],
    schedule: Sequence[Planned] | None = None,
) -> GoodputPrediction:
    """The fleet's goodput over `horizon_s`, one monkey schedule per seed; or, given `schedule`
    (the faults a seeded `dldctl chaos monkey` will inject), only the costs drawn per seed."""
    check(
        [
            (name, why)
            for name, ok, why in (
                ("learners", learners >= 1, "must be >= 1"),
                ("mtbf_s", mtbf_s > 0, "must be > 0"),
                ("horizon_s", 0 < horizon_s < math.inf, "must be > 0 and finite"),
                ("seeds", len(seeds) >= 1, "must hold at least one seed"),
            )
            if not ok
        ]
    )
    eff = pilot.efficiency()
    runs = [
        account(
            eff,
            learners,
            horizon_s,
            _hits(pilot, learners, mtbf_s, horizon_s, schedule, np.random.default_rng(s)),
            pilot.spares,
        )
        for s in seeds
    ]
    return GoodputPrediction(
        learners,
        mtbf_s,
        horizon_s,
        eff,
        Spread.of(g for g, _ in runs),
        Spread.of(float(n) for _, n in runs),
    )


def _hits(
    pilot: GoodputPilot,
    learners: int,
    mtbf_s: float,
    horizon_s: float,
    schedule: Sequence[Planned] | None,
    rng: np.random.Generator,
) -> list[Hit]:
    if schedule is None:
        return draw_hits(pilot, learners, mtbf_s, horizon_s, rng)
    return cost_hits(pilot, [p for p in schedule if p.victim < learners], rng)


# --------------------------------------------------------------------------- the wire


@dataclass(frozen=True)
class WirePilot:
    """A pilot run's wire figures: per learner (one per site), per fragment."""

    sites: int
    step_s: float  # compute time of one inner step (blocked time taken out)
    H: int
    fragments: int
    max_lag: int  # 0: a learner never waits for a reply (dldctl's default); else it waits this many steps
    up_bytes: float  # one push on the wire
    down_bytes: float  # one merged reply to one learner
    blocked: float  # the pilot's blocked share
    time_to_target_s: float | None  # training time to the target loss (None: not reached)

    @property
    def period_s(self) -> float:
        """Compute time between two pushes (one fragment every H / fragments steps)."""
        return self.H / self.fragments * self.step_s

    def link_times(self, link_bps: float, syncer_bps: float | None) -> tuple[float, float]:
        """Seconds a push takes up a site's link, and a reply down it (the syncer's egress, when
        capped at `syncer_bps`, is shared by every site's reply)."""
        down = self.down_bytes * 8 * (self.sites / syncer_bps if syncer_bps else 1.0 / link_bps)
        return self.up_bytes * 8 / link_bps, down


@dataclass(frozen=True)
class WirePrediction:
    """What a link rate does to the pilot's fleet."""

    link_bps: float
    syncer_bps: float | None
    link_busy: float  # the busier direction's share of time carrying the pushes or the replies
    busy: float  # the learners' share of time computing
    blocked: float
    time_to_target_s: float | None

    @property
    def coalesced(self) -> bool:
        """Pushes come faster than the link carries them: unsent ones are merged into the next."""
        return self.link_busy > 1.0

    def to_dict(self) -> dict[str, object]:
        return {**self.__dict__, "coalesced": self.coalesced}


def predict_wire(pilot: WirePilot, link_bps: float, syncer_bps: float | None = None) -> WirePrediction:
    """Busy and blocked shares on `link_bps` per site, and the time to the pilot's target loss.

    Links are full duplex: pushes share the way up, replies the way down. With max_lag 0 a learner
    never waits for a reply: it computes as fast as in the pilot whatever the link, and a link that
    cannot carry its pushes makes the learner merge the unsent ones into the next (fewer, staler
    merges: their cost in loss per token is not modelled). With max_lag > 0 it waits for a reply
    max_lag steps after its push: what the round trip does not fit there stalls it, and it can
    push no faster than the link carries. The pilot's own blocked share is a floor no link removes
    (fit on a run whose link was not the bottleneck). The time to the loss is the pilot's, scaled
    by its busy share over the predicted one."""
    check([("link_bps", "must be > 0")] if link_bps <= 0 else [])
    up, down = pilot.link_times(link_bps, syncer_bps)
    period = pilot.period_s
    link_busy = max(up, down) / period
    floor = 1.0 - pilot.blocked
    busy = floor
    if pilot.max_lag > 0:
        hidden = min(pilot.max_lag, pilot.H / pilot.fragments) * pilot.step_s
        stall = max(0.0, up + down - hidden, max(up, down) - period)
        busy = floor * period / (period + stall)
    reach = pilot.time_to_target_s
    scaled = None if reach is None else reach * floor / busy
    return WirePrediction(link_bps, syncer_bps, link_busy, busy, 1.0 - busy, scaled)
