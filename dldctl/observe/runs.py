"""`dldctl runs`: every run directory as one row (name, state, age, hosts, progress, loss).

The state word is the run's truth, not only what state.json last said:
    up        its supervisor runs (starting: the fleet is still coming up)
    crashed   meant to be up but its supervisor is gone (`dldctl up --resume RUN` restarts it)
    stopping  `down` began and did not finish (`dldctl down --run RUN` again)
    down      stopped by `down` (`dldctl up --resume RUN` continues it from its checkpoint)
    unreadable  state.json cannot be read (`dldctl down --run RUN` still stops what it finds)
Progress (outer steps, tokens, the last eval loss) is the newest "sample" record of the run's
metrics log, so a run that is down still shows where it ended. A run whose global model is not
scored says why (`global_off`, syncer/common/unscored.py; `unscored_reason` reads it from a run
directory).
"""

from __future__ import annotations

import time
from typing import Any

from dldctl.errors import RunError
from dldctl.observe.snapshot_model import Figures
from dldctl.observe.view_data import fmt_float
from dldctl.rundir import RunDir, all_runs
from dldctl.runstate import DOWN_REASON, RunState
from syncer.common import jsonlread, unscored

SCHEMA = "dldctl.runs/1"


def state_word(status: str, live: bool) -> str:
    """The row's state from the state file's status and whether the supervisor runs (pure)."""
    if status in ("starting", "up"):
        return status if live else "crashed"
    return status


def learner_count(state: RunState) -> int:
    """The learners the run has: those not stopped, or for a run that is down those `down` stopped."""
    live = state.learners(live=True)
    if live or state.status != "down":
        return len(live)
    return sum(1 for name in state.learners() if state.procs[name].reason == DOWN_REASON)


def last_sample(run: RunDir) -> dict[str, Any] | None:
    """The newest "sample" record of the run's metrics log (reads only its last MiB). Samples come
    every 2 s and a round record with every merge: a small model's fleet writes hundreds of rounds
    between two samples, so the tail is read by bytes, not by a handful of records."""
    records = jsonlread.tail(run.metrics, 1 << 20, max_bytes=1 << 20)
    return next((r for r in reversed(records) if r.get("kind") == "sample"), None)


def row(run: RunDir, now: float) -> dict[str, Any]:
    """One run's row (JSON-ready)."""
    out: dict[str, Any] = {"name": run.name, "dir": str(run.path), "state": "unreadable"}
    try:
        state = run.read_state()
    except RunError as exc:
        return {**out, "problem": exc.line(), "age_s": None, "hosts": [], "learners": 0}
    out["state"] = state_word(state.status, run.live())
    out["run"] = state.run
    out["age_s"] = now - state.created if state.created is not None else None
    out["stopped_at"] = state.stopped_at
    out["hosts"] = sorted({p.host for p in state.procs.values()})
    out["learners"] = learner_count(state)
    sample = last_sample(run)
    out.update(progress(Figures.from_sample(sample) if sample else None))
    out["global_off"] = unscored_reason(run, sample or {})  # why the global model is not scored (None: it is)
    out["final_model"] = str(run.final_model) if run.final_model.exists() else None
    return out


def progress(figures: Figures | None) -> dict[str, Any]:
    """A row's progress from where the run is (or ended): the figures of its newest sample, which
    `down`'s summary reads too; all None without one."""
    return {
        "outer_steps": figures.outer_steps if figures else None,
        "tokens_merged": figures.tokens_merged if figures else None,
        "tokens_trained": figures.tokens_trained if figures else None,
        "goodput": figures.goodput if figures else None,
        "loss_eval": figures.scored_loss if figures else None,  # the global model's score where it has one
        "loss_global": figures.loss.global_ if figures else None,
    }


def unscored_reason(run: RunDir, sample: dict[str, Any] | None = None) -> str | None:
    """Why the run's global model has no score, from what its directory holds (None: it is scored,
    or nothing says otherwise): the newest sample's `global_off` (`sample`, read if not given),
    else its last `global_eval_off` event, else its settings' global_eval_every = 0."""
    newest = last_sample(run) if sample is None else sample
    samples = [newest] if newest else []
    if newest and "global_off" in newest:
        return unscored.from_records(samples, [])
    events = [e for e in jsonlread.tail(run.events, 500) if e.get("kind") == unscored.EVENT]
    return unscored.from_records(samples, events, eval_every(run))


def eval_every(run: RunDir) -> int | None:
    """The run's `global_eval_every` (None: its config.json cannot be read)."""
    try:
        return run.read_config().run.global_eval_every
    except RunError:
        return None


def loss_cell(row: dict[str, Any]) -> str:
    """The `eval loss` cell of `dldctl runs` (rich markup): the loss, and why the global model is
    not scored where it is not."""
    loss, off = row.get("loss_eval"), row.get("global_off")
    if not off:
        return fmt_float(loss)
    said = unscored.words(str(off))[0].replace("[", "\\[")
    return (f"{fmt_float(loss)} " if loss is not None else "") + f"[yellow]global off: {said}[/]"


def collect(now: float | None = None) -> dict[str, Any]:
    """Every run, newest first, as the JSON `dldctl runs --json` prints."""
    when = time.time() if now is None else now
    return {"schema": SCHEMA, "runs": [row(r, when) for r in all_runs()]}
