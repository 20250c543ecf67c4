"""`dldctl simulate goodput|bandwidth --from-run RUN`: plan from a pilot run's own measurements.

The run is read (dldctl/observe/pilotrun.py) into measured constants; the pure core
(dldctl/sim/pilot.py) predicts a fleet of another size, fault rate or link from them. Every
output says which constant came from the run and which from a default or a flag.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any

from rich.markup import escape
from rich.table import Table

from dldctl import rundir
from dldctl.chaos.plan import PlanError, monkey_schedule
from dldctl.commands import simulate_common as sc
from dldctl.errors import RunError, UsageError
from dldctl.faults.linkcap import LinkCapError, parse_rate
from dldctl.observe import pilotrun
from dldctl.sim.errors import ParamError
from dldctl.sim.pilot import KILLS, GoodputPilot, GoodputPrediction, Planned, predict_goodput, predict_wire
from dldctl.units import parse_duration

SCHEMA_GOODPUT = "dldctl.simulate.goodput-from-run/1"
SCHEMA_BANDWIDTH = "dldctl.simulate.bandwidth-from-run/1"


def load(run: str, target_loss: float | None = None) -> pilotrun.Pilot:
    """The run's measured constants; one UsageError line naming the run if it has none."""
    try:
        where = rundir.resolve(run, live_only=False)
        return pilotrun.measure(pilotrun.read(where), target_loss)
    except (RunError, ValueError) as exc:
        raise UsageError(f"--from-run {run}: {exc}", hint="pick a run that trained: `dldctl runs` lists them") from None


def _ms(x: float | None) -> str:
    """Seconds as people read them: 0.93 s, 20.6 s, 4.1 min, 2.5 h."""
    if x is None:
        return "-"
    if math.isinf(x):
        return "never"
    if x < 120:
        return f"{x:.3g} s"
    return f"{x / 60:.3g} min" if x < 7200 else f"{x / 3600:.3g} h"


def constants(p: pilotrun.Pilot) -> list[tuple[str, str, str]]:
    """(constant, value, where it came from) for the goodput plan."""
    g = p.goodput
    kinds = ", ".join(f"{n} {k}" for k, n in g.kinds().items()) or "none"
    kills = [f for f in p.faults if f.kind in ("kill", "preempt")]

    def median(values: list[float | None]) -> str:
        seen = sorted(v for v in values if v is not None)
        return _ms(seen[len(seen) // 2]) if seen else "- (no kill)"

    steps = ", ".join(
        f"{lid} {m * 1000:.0f} ms ({lo * 1000:.0f}-{hi * 1000:.0f})" for lid, (lo, m, hi) in p.step_s.items()
    )
    return [
        ("window", f"{_ms(g.window_s)}, {g.learners} learners", "run"),
        ("goodput measured", f"{g.goodput:.3f}", "run (the syncer's)"),
        ("faults", f"{len(g.faults)} ({kinds}), one every {_ms(g.mtbf_s)}", "run"),
        ("kill -> restart", median([f.restart_s for f in kills]), "run (median)"),
        ("kill -> rejoin", median([f.rejoin_s for f in kills]), "run (median; the kill's down time)"),
        ("kill -> contributing again", median([f.contributing_s for f in kills]), "run (median)"),
        (
            "work lost per kill",
            f"{p.lost_tokens / len(kills):,.0f} tokens" if kills else "-",
            "run (trained, never merged)",
        ),
        ("warm spares", _spares(p), f"run (start-up: {p.spares_from})"),
        ("fault cost", f"{g.cost_share():.1%} of learner time", "run"),
        ("efficiency of an up learner", f"{g.efficiency():.3f}", "fitted: reproduces the measured goodput"),
        ("step time (p10-p90)", steps or "-", "run"),
        ("checkpoints in the window", str(p.checkpoints), "run (their cost is inside the efficiency)"),
        (
            "bytes per token up / down",
            f"{p.bytes_per_token[0]:.3g} / {p.bytes_per_token[1]:.3g}",
            f"run ({p.compression})",
        ),
    ]


def _spares(p: pilotrun.Pilot) -> str:
    sp = p.goodput.spares
    if sp is None:
        return "none (every kill restarts a fresh process, as in the run)"
    kills = [f for f in p.goodput.faults if f.kind in KILLS]
    ready = sum(1 for f in kills if f.spare_ready)
    return (
        f"one per host of {sp.per_host}; a spare's start-up {_ms(sp.cold_start_s)}; "
        f"{ready} of {len(kills)} kills found theirs ready"
    )


@dataclass(frozen=True)
class Ask:
    """What `simulate goodput --from-run` was asked, as typed (parsed here, errors naming flags)."""

    learners: str | None = None
    mtbf: str | None = None
    duration: str | None = None
    per_host: int | None = None
    monkey_seed: int | None = None  # the faults of `dldctl chaos monkey --seed` with this seed
    actions: str | None = None  # the monkey's --actions (default: the kinds the run saw)


def _pilot(run: str, ask: Ask) -> tuple[pilotrun.Pilot, GoodputPilot]:
    p = load(run)
    g = p.goodput
    if ask.per_host is not None:
        if ask.per_host < 1:
            raise UsageError(f"--per-host must be >= 1 (got {ask.per_host})")
        if g.spares is not None:
            g = replace(g, spares=replace(g.spares, per_host=ask.per_host))
    if ask.mtbf is not None and not g.faults:
        raise UsageError(
            f"--from-run {run}: the run saw no fault in its window, so what one costs is unknown",
            hint="run a pilot under `dldctl chaos monkey` (kills, pauses) and plan from that",
        )
    return p, g


def monkey_faults(ask: Ask, g: GoodputPilot, learners: int, mtbf_s: float, horizon: float) -> list[Planned] | None:
    """The faults `dldctl chaos monkey --mtbf --duration --seed --actions` would inject (its own
    schedule, drawn as the monkey draws it), or None without --monkey-seed."""
    if ask.monkey_seed is None:
        return None
    if math.isinf(mtbf_s):
        raise UsageError("--monkey-seed needs a fault rate: give --mtbf, as to the monkey")
    actions = [a.strip() for a in ask.actions.split(",")] if ask.actions else list(g.kinds())
    names = sorted(f"learner-{i}" for i in range(learners))  # the monkey's targets: the live learners, sorted
    try:
        plan = monkey_schedule(
            random.Random(ask.monkey_seed), mtbf_s=mtbf_s, duration_s=horizon, targets=names, actions=actions
        )
    except PlanError as exc:
        raise UsageError(f"--actions: {exc}") from None
    return [Planned(f.at, int(f.target.rsplit("-", 1)[1]), f.action) for f in plan]


def goodput(run: str, ask: Ask, seeds: list[int], as_json: bool) -> None:
    """Predict the run's fleet at another size / fault rate over `duration`, one monkey per seed."""
    p, g = _pilot(run, ask)
    m = sc.parse("--learners", ask.learners, int) if ask.learners else g.learners
    mtbf_s = sc.parse("--mtbf", ask.mtbf, parse_duration) if ask.mtbf else g.mtbf_s
    horizon = sc.parse("--duration", ask.duration, parse_duration) if ask.duration else g.window_s
    try:
        pred = predict_goodput(g, m, mtbf_s, horizon, seeds, monkey_faults(ask, g, m, mtbf_s, horizon))
    except ParamError as exc:
        flags = {"learners": "--learners", "mtbf_s": "--mtbf", "horizon_s": "--duration", "schedule": "--actions"}
        raise UsageError(f"{flags.get(exc.field, exc.field)}: {exc.why}") from None
    if as_json:
        sc.emit_json(goodput_doc(p, pred))
        return
    out = sc.stdout()
    table = Table(title=f"measured in {escape(p.name)}", title_justify="left")
    for col in ("constant", "value", "from"):
        table.add_column(col)
    for row in constants(p):
        table.add_row(*(escape(c) for c in row))
    out.print(table)
    for note in p.notes:
        out.print(f"note: {escape(note)}")
    s = pred.goodput
    what = "no faults" if math.isinf(mtbf_s) else f"a fault every {_ms(mtbf_s)}"
    hosts = "" if g.spares is None else f" ({g.spares.per_host} per host)"
    out.print(
        f"{m} learners{hosts}, {what}, {_ms(horizon)} ({len(seeds)} seeds): goodput {s.mean:.3f} "
        f"(p10-p90 {s.p10:.3f}-{s.p90:.3f}); {pred.faults.mean:.1f} faults landed per run"
    )


def goodput_doc(p: pilotrun.Pilot, pred: GoodputPrediction) -> dict[str, Any]:
    """`goodput --from-run --json` (docs/simulate.md)."""
    g = p.goodput
    return {
        "schema": SCHEMA_GOODPUT,
        "run": p.name,
        "measured": {"goodput": g.goodput, "learners": g.learners, "window_s": g.window_s, "mtbf_s": _finite(g.mtbf_s)},
        "constants": [{"name": n, "value": v, "source": s} for n, v, s in constants(p)],
        "faults": [_fault(f) for f in p.faults],
        "notes": p.notes,
        "prediction": pred.to_dict(),
    }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _fault(f: pilotrun.FaultSeen) -> dict[str, Any]:
    cost = f.cost
    return {
        "kind": f.kind,
        "target": f.target,
        "t": f.t,
        "restart_s": f.restart_s,
        "rejoin_s": f.rejoin_s,
        "contributing_s": f.contributing_s,
        "undone_s": f.undone_s,
        "down_s": None if cost is None else cost.down_s,
        "lost_s": None if cost is None else cost.lost_s,
    }


def _rate(flag: str, text: str) -> int:
    try:
        return parse_rate(text)
    except LinkCapError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _syncer(text: str | None, rate: int) -> int | None:
    """The syncer's egress cap: none, the sites' own rate (`same`: one cap all replies share), or a rate."""
    if text in (None, "", "none"):
        return None
    return rate if text == "same" else _rate("--syncer-link", str(text))


def bandwidth(run: str, links: str | None, syncer_link: str | None, target_loss: float | None, as_json: bool) -> None:
    """Blocked share and time to `target_loss` of the run's fleet on each link rate."""
    if not links:
        raise UsageError("--from-run needs --link: the rate per site to predict, e.g. --link 10mbit,1mbit")
    rates = [_rate("--link", r.strip()) for r in links.split(",") if r.strip()]
    p = load(run, target_loss)
    w = p.wire
    preds = [predict_wire(w, r, _syncer(syncer_link, r)) for r in rates]
    if as_json:
        sc.emit_json(
            {
                "schema": SCHEMA_BANDWIDTH,
                "run": p.name,
                "measured": {**w.__dict__, "target_loss": target_loss},
                "predictions": [x.to_dict() for x in preds],
            }
        )
        return
    out = sc.stdout()
    waits = "never waits for a reply (max_lag 0)" if w.max_lag == 0 else f"waits for a reply {w.max_lag} steps on"
    out.print(
        f"measured in {escape(p.name)}: {w.sites} learners, a step {w.step_s * 1000:.0f} ms of compute, "
        f"H {w.H}, {w.fragments} fragments, a learner {waits}; a push {w.up_bytes / 1e3:,.1f} kB, a reply "
        f"{w.down_bytes / 1e3:,.1f} kB; blocked {w.blocked:.1%}"
        + ("" if target_loss is None else f"; loss {target_loss:g} after {_ms(w.time_to_target_s)} of training")
    )
    table = Table()
    for col in ("link per site", "link busy", "learners busy", "blocked", "time to the loss"):
        table.add_column(col, justify="right")
    for x in preds:
        link = f"{x.link_busy:.0%}" + (" (pushes merged)" if x.coalesced else "")
        cells = (f"{x.link_bps / 1e6:g} Mbit/s", link, f"{x.busy:.1%}", f"{x.blocked:.1%}", _ms(x.time_to_target_s))
        table.add_row(*cells)
    out.print(table)
    egress = {None: "uncapped", "none": "uncapped", "same": "capped at each site's rate, shared by every reply"}
    out.print(
        f"from the run: every number above the table; from flags: the link rates, the syncer's egress "
        f"({egress.get(syncer_link, f'capped at {syncer_link}')}, --syncer-link)"
        + ("" if target_loss is None else ", the target loss")
        + ". A link busier than 100% merges unsent pushes into the next: staler merges, whose cost in"
        " loss per token is not modelled."
    )
