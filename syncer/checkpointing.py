"""When the syncer checkpoints, what it starts from, and what it says about both.

Out of the socket loop (syncer/server.py). `CheckpointSchedule` is pure: a checkpoint is due
every `checkpoint_every` outer steps (the core counts them) or, idle, every `checkpoint_s`
seconds with something new; a failed write is retried 10 s later; a state the quality guard
scored good waits for the writer. `Checkpoints` carries it out on the writer's thread
(syncer/ckptwriter.py), accounts for a finished write, and at start resumes from the newest
valid checkpoint or decides what a run that lost its history does (syncer/checkpoint.py).
Every event about a checkpoint carries `outer_step`, `epoch` and `checkpoint` (the file name)
beside its message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from syncer import checkpoint, ckptwriter
from syncer.common import ckptname
from syncer.common.atomic import atomic_write
from syncer.config import SyncerConfig
from syncer.core import SyncerCore
from syncer.oplog import fresh, resumed
from syncer.records import Records

RETRY_S = 10.0  # a failed checkpoint write is tried again this much later
CHECKPOINT_EVENT_EVERY_S = 30.0  # routine checkpoints: at most one event per this (the header shows the latest)


class CheckpointSchedule:
    """Whether a checkpoint is due now, and the scored state waiting for the writer. Pure."""

    def __init__(self, every_s: float, now: float) -> None:
        self.every_s = every_s  # idle checkpoints (0: none)
        self.last = now  # when the newest checkpoint was written
        self.retry_at = 0.0  # no checkpoint before this (a write failed)
        self.scored: dict[str, Any] | None = None  # a state the quality guard scored good, not written yet

    def due(self, steps_due: bool, since: int, busy: bool, now: float) -> bool:
        """Due by outer steps (`steps_due`) or idle with `since` outer steps unsaved, unless a
        write is under way or a failed one waits for its retry."""
        idle_due = 0 < self.every_s < now - self.last and since > 0
        return (steps_due or idle_due) and now >= self.retry_at and not busy

    def offer(self, scored: dict[str, Any] | None) -> None:
        """The newest good state waits for the writer (None: nothing new)."""
        self.scored = scored if scored is not None else self.scored

    def take_scored(self, busy: bool) -> dict[str, Any] | None:
        """The scored state to write now (None while the writer is busy, or none waits)."""
        if busy or self.scored is None:
            return None
        state, self.scored = self.scored, None
        return state

    def failed(self, now: float) -> None:
        self.retry_at = now + RETRY_S

    def written(self, now: float) -> None:
        self.last = now


def fields(state: dict[str, Any], name: str) -> dict[str, Any]:
    """The structured fields of an event about the checkpoint of `state` in file `name`."""
    return {"outer_step": int(state["outer_steps"]), "epoch": int(state["epoch"]), "checkpoint": name}


def name_fields(path: Path) -> dict[str, Any]:
    """The structured fields of an event about a checkpoint file by its name (readable or not)."""
    parsed = ckptname.parse(path.name)
    epoch, step = (parsed.epoch, parsed.outer_step) if parsed else (0, 0)
    return {"outer_step": step, "epoch": epoch, "checkpoint": path.name}


class Checkpoints:
    """The syncer's checkpoints: resumed at start, scheduled, written off the loop, accounted."""

    def __init__(self, core: SyncerCore, cfg: SyncerConfig, records: Records) -> None:
        self.core, self.cfg, self.records = core, cfg, records
        self.writer = ckptwriter.CheckpointWriter(cfg.checkpoint_dir, cfg.settings.keep_checkpoints)
        self.schedule = CheckpointSchedule(cfg.settings.checkpoint_s, records.wall())
        self.closed = False  # the operator stopped the run: its time down is nobody's lost work

    # -- start -------------------------------------------------------------------------------
    def resume(self) -> None:
        """The newest checkpoint that fits; else a brand-new run, or a run that lost its history
        (refused, or continued with a new global model, as on_no_checkpoint says). Raises
        checkpoint.HistoryLostError when the run had merged, no checkpoint is valid and
        on_no_checkpoint = "refuse"."""
        core, directory, now = self.core, self.cfg.checkpoint_dir, self.records.wall()
        restored, problems = checkpoint.resume(core, directory, now)
        files = checkpoint.list_checkpoints(directory)  # a problem per file skipped, newest first
        for problem, path in zip(problems, files):
            self.records.event("checkpoint_corrupt", "syncer", f"skipped {problem}", **name_fields(path))
        if restored:
            path = (files[len(problems) :] or [directory])[0]  # never an IndexError
            detail = f"from outer step {core.outer_steps}, versions {core.versions()}"
            self.records.event("syncer_resume", "syncer", detail, **name_fields(path))
            self.records.say([resumed(path, core.outer_steps, core.versions(), core.epoch, now)])
            return
        lost = checkpoint.lost_history(directory, problems)
        decision = checkpoint.start_decision(lost, self.cfg.settings.on_no_checkpoint)
        if lost is None or decision == "fresh":  # a new run: the first learner to join initializes the model
            self.records.say([fresh(directory, now)])
            return
        if decision == "refuse":
            self._refuse(lost)
        self._without_history(lost, now)

    def _refuse(self, lost: checkpoint.LostHistory) -> None:
        """Leave the marker the supervisor reads (so it does not restart us in a loop), say why, stop."""
        line = lost.refusal()
        try:
            atomic_write(self.cfg.run_dir / checkpoint.REFUSED, line + "\n")
        except OSError:
            pass  # an unwritable run dir: the line still goes to stderr and the event log
        self.records.event("syncer_refused", "syncer", line)
        raise checkpoint.HistoryLostError(line)

    def _without_history(self, lost: checkpoint.LostHistory, now: float) -> None:
        """on_no_checkpoint = "from-learner": the counters continue, a loud event, a lasting warning."""
        missing = checkpoint.continue_counters(self.core, lost, now)
        self.core.since_checkpoint = self.cfg.settings.checkpoint_every  # checkpoint the new model at once
        versions = (lost.history or {}).get("versions")
        detail = (
            f"{lost.warning()}. Lost: {lost.what()}"
            + (f", fragment versions {versions} (the new model's start at 0)" if versions else "")
            + f". Checkpoints: {lost.why()}"
            + (f". Not carried on: {', '.join(missing)}" if missing else "")
        )
        self.records.event("history_lost", "syncer", detail)

    # -- the loop ----------------------------------------------------------------------------
    def due(self, now: float) -> bool:
        """Whether a checkpoint of the current state is due (the scoring may gate it)."""
        core = self.core
        return self.schedule.due(core.checkpoint_due(), core.since_checkpoint, self.writer.busy, now)

    def tick(self, scored: dict[str, Any] | None, due: bool, gated: bool) -> None:
        """Begin the write the loop owes: a scored good state first, else a due one (unless the
        scoring gates it: `gated`)."""
        self.schedule.offer(scored)
        state = self.schedule.take_scored(self.writer.busy)
        if state is not None:
            self.save(state=state, wait=False)
        elif due and not gated:
            self.save(wait=False)

    def poll(self) -> None:
        """Account for a write the writer finished since the last poll."""
        self._written(self.writer.result())

    def save(self, final: bool = False, state: dict[str, Any] | None = None, wait: bool = True) -> Path | None:
        """Checkpoint the current state (or `state`, one the quality guard scored good): with
        `wait`, written before this returns (its path); else begun on the writer's thread, the
        loop going on (accounted when `poll` sees it done). A write under way is finished first.
        A failure is an event and a retry later, never a crash."""
        if self.core.model is None:
            return None
        self._written(self.writer.wait())
        state = state if state is not None else checkpoint.state_dict(self.core, self.records.wall(), copy=True)
        if final and self.closed:
            state = {**state, "closed": True}
        if not wait:
            self.writer.start(state, final)
            return None
        return self._written(self.writer.write(state, final))

    def _written(self, done: ckptwriter.Written | None) -> Path | None:
        """Account for a finished checkpoint write (None: nothing finished); its path if it worked."""
        if done is None:
            return None
        now, state, final, path = self.records.wall(), done.state, done.final, done.path
        if path is None:
            self.schedule.failed(now)
            detail = f"{done.error}; training goes on, retrying in {RETRY_S:g} s"
            self.records.event("checkpoint_failed", "syncer", detail, **fields(state, ""))
            return None
        step = int(state["outer_steps"])
        self.core.receipts.written(state.get("pushes"))  # the acks tell the learners what it holds
        self.core.acct.checkpoint_written(step)
        self.schedule.written(now)
        detail = f"outer step {step}{' (final)' if final else ''}: {path.name}"
        self.records.say(self.records.oplog.checkpoint(step, path.name, done.size, done.took_s, now, final))
        if final:
            self.records.event("checkpoint", "syncer", detail, **fields(state, path.name))
        else:  # a small model checkpoints many times a second: keep the event log for what matters
            every = CHECKPOINT_EVENT_EVERY_S
            self.records.quiet_event("checkpoint", "checkpoint", "syncer", detail, every, **fields(state, path.name))
        return path
