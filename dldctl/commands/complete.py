"""Shell completion of what the commands take: run names, and a run's learner ids and targets.

The shell calls these on every <TAB> (typer's `autocompletion=`), so they read only the runs
directory and one state file: no host, no network, no lock. A completion never fails: a missing,
half-written or broken run directory completes to nothing rather than printing a traceback into
the user's prompt.
"""

from __future__ import annotations

import re
from typing import Any

from dldctl import rundir
from dldctl.errors import DldError
from dldctl.runstate import RunState

LOCAL_TARGETS = ("supervisor", "watchdog")  # logs kept in the run directory on this machine
_STAMP = re.compile(r"-\d{8}-\d{6}(-\d+)?$")  # rundir.create's suffix: <name>-<YYYYmmdd-HHMMSS>[-n]


def run_names(incomplete: str) -> list[str]:
    """Run names (`default`) then run directories (`default-20260101-120000`), newest first, that
    start with `incomplete`: what `--run`, `export RUN` and `up --resume` accept."""
    try:
        dirs = [r.name for r in rundir.all_runs()]
    except OSError:  # the runs directory went away or cannot be read: nothing to offer
        return []
    names = [_STAMP.sub("", d) for d in dirs]
    unique = list(dict.fromkeys([*names, *dirs]))
    return [n for n in unique if n.startswith(incomplete)]


def learner_ids(ctx: Any, incomplete: str) -> list[str]:
    """The learner ids of the run named on the command line so far (`--run`), or the latest run."""
    state = _state(ctx)
    return [] if state is None else [n for n in state.learners() if n.startswith(incomplete)]


def proc_targets(ctx: Any, incomplete: str) -> list[str]:
    """Every process of that run a fault can hit: its learners and syncer shards."""
    state = _state(ctx)
    return [] if state is None else [n for n in state.procs if n.startswith(incomplete)]


def log_targets(ctx: Any, incomplete: str) -> list[str]:
    """Every target `dldctl logs` reads: the run's processes, the supervisor and the watchdog."""
    state = _state(ctx)
    names = [] if state is None else list(state.procs)
    return [n for n in [*names, *LOCAL_TARGETS] if n.startswith(incomplete)]


def _state(ctx: Any) -> RunState | None:
    """The state of the run `--run` names (or the newest run); None where there is none to read."""
    params = getattr(ctx, "params", None) or {}
    run = params.get("run")
    try:
        return rundir.resolve(run if isinstance(run, str) else None, live_only=False).read_state()
    except (DldError, OSError, ValueError):  # no run, a broken one, a state half written
        return None
