"""What `dldctl simulate goodput` and `simulate calibrate` share: flag names, parsing, output.

Flags are parsed into the core's units here (durations like "30m", counts like "1.2M"); a core
ParamError becomes one UsageError line naming the flag. `assumptions` words the model a goodput
number rests on, with the constants it used, for the table footer and the JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import typer
from rich.console import Console

from dldctl.commands.options import output_console
from dldctl.docpath import doc
from dldctl.errors import UsageError
from dldctl.sim import goodput as gp
from dldctl.sim.errors import ParamError
from dldctl.units import format_count, format_duration, parse_duration
from syncer.common import strictjson

SIM_DOC = doc("simulate.md")  # the model, its defaults and the JSON schemas (docs/simulate.md)
LABELS = {gp.DATA_PARALLEL: "data-parallel", gp.ELASTIC: "elastic data-parallel", gp.DILOCO: "Decoupled DiLoCo"}

# Core field -> the flag that sets it, so a ParamError from the core names what to change.
FLEET_FLAGS = {
    "chips": "--chips",
    "learners": "--learners",
    "mtbi_s": "--mtbi-years",
    "step_time_s": "--step-time",
    "step_jitter": "--step-jitter",
    "recovery_s": "--recovery",
    "reconfig_s": "--reconfig",
    "learner_reconfig_s": "--learner-reconfig",
    "restart_s": "--restart",
    "checkpoint_every_s": "--checkpoint-every",
    "checkpoint_cost_s": "--checkpoint-cost",
    "failure_domain": "--failure-domain",
    "quorum": "--quorum",
    "horizon_s": "--hours",
    "rate_cv": "--rate-cv",
    "rate_period_s": "--rate-period",
}
CALIBRATED = {
    "restart_s": gp.CALIBRATED_RESTART_S,
    "reconfig_s": gp.CALIBRATED_RECONFIG_S,
    "learner_reconfig_s": gp.CALIBRATED_LEARNER_RECONFIG_S,
}

T = TypeVar("T")


def parse(flag: str, text: str, parser: Callable[[str], T]) -> T:
    """Run one parser; its ValueError becomes a usage error that names the flag."""
    try:
        return parser(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def parse_interval(flag: str, text: str) -> float | None:
    """A duration, or None for "auto" (the core then picks the interval)."""
    return None if text.strip().lower() == "auto" else parse(flag, text, parse_duration)


# Core fields kept in other units than their flags: show the value as the user typed it.
_AS_TYPED = {"mtbi_s": lambda s: s / gp.YEAR_S, "horizon_s": lambda s: s / 3600.0}


def build(factory: Callable[..., T], flags: dict[str, str], **values: object) -> T:
    """Construct a core parameter set; its ParamError becomes a usage error naming the flag."""
    try:
        return factory(**values)
    except ParamError as exc:
        flag = flags.get(exc.field, exc.field)
        shown = values.get(exc.field)
        if exc.field in _AS_TYPED and isinstance(shown, float):
            shown = _AS_TYPED[exc.field](shown)
        raise UsageError(
            f"{flag} {exc.why} (got {shown:g})"
            if isinstance(shown, (int, float))
            else f"{flag} {exc.why} (got {shown!r})"
        ) from None


def stdout() -> Console:
    """The console for results; wide when piped so tables are not squeezed to 80 columns."""
    return output_console()


def emit_json(payload: dict[str, object]) -> None:
    """One JSON document on stdout, nothing else."""
    typer.echo(strictjson.dumps(payload, indent=2))


def about(seconds: float) -> str:
    """A rough human duration: 13.1s, 26.3m, 3.1h, 2.5d."""
    for div, unit in ((86400.0, "d"), (3600.0, "h"), (60.0, "m")):
        if seconds >= div:
            return f"{seconds / div:.1f}{unit}"
    return f"{seconds:.1f}s"


def _seconds(x: float) -> str:
    return format_duration(round(x, 1))


def _checkpoints(fleets: list[gp.FleetParams]) -> str:
    base = fleets[0]
    if base.checkpoint_every_s is not None:
        return f"every {_seconds(base.checkpoint_every_s)} of work (--checkpoint-every)"
    cells = ", ".join(f"{_seconds(f.checkpoint_interval_s())} at {format_count(f.chips)}" for f in fleets)
    return f"at the Young/Daly interval for a {_seconds(base.checkpoint_cost_s)} checkpoint: {cells}"


def _constants_source(fleet: gp.FleetParams) -> str:
    used = {"restart_s": fleet.restart_s, "reconfig_s": fleet.reconfig_s, "learner_reconfig_s": fleet.learner_pause_s()}
    if used == CALIBRATED:
        return "the three time constants are the ones fitted on the paper's table at 150k chips (simulate calibrate)"
    defaults = ", ".join(f"{FLEET_FLAGS[k]} {_seconds(v)}" for k, v in CALIBRATED.items())
    return f"time constants set by flags (the calibrated defaults: {defaults})"


def assumptions(fleets: list[gp.FleetParams]) -> list[str]:
    """One line per modelled rule, with the values used: what a goodput number rests on."""
    f = fleets[0]
    rate = "constant" if f.rate_cv == 0 else f"varying per {_seconds(f.rate_period_s)} period (CV {f.rate_cv:g})"
    return [
        f"failures: Poisson, mean rate chips / MTBI ({f.mtbi_s / gp.YEAR_S:g} y per chip), {rate}",
        f"data-parallel: restart {_seconds(f.restart_s)}, started over by a failure during it; "
        f"checkpoints {_checkpoints(fleets)}",
        f"elastic data-parallel: one {_seconds(f.reconfig_s)} pause per failure (failures during it join it) "
        f"and the step in flight; the failed replica ({f.failure_domain} chips) is out for "
        f"{_seconds(f.recovery_s)} and rejoins without a pause",
        f"Decoupled DiLoCo: each learner an elastic job with a {_seconds(f.learner_pause_s())} pause; "
        f"progress needs {f.quorum} learner(s) up",
        _constants_source(f),
    ]
