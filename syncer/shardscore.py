"""The global model of a sharded syncer, scored on shard 0 from every shard's newest checkpoint.

No shard holds the whole model, so no shard can score a copy of its own state as an unsharded
syncer does (syncer/quality.py). Shard 0 scores what the shards have written instead: every
`global_eval_every` of its outer steps, its evaluator thread assembles the model from each
shard's newest valid checkpoint (syncer/shardmodel.py, the same assembly `dldctl down` does) and
scores it on the run's held-out batches. The score is as fresh as the checkpoints
(`checkpoint_every` / `checkpoint_s`), and a set of checkpoints already scored is not scored
again. Each score is a `global_eval` metrics record naming the checkpoint of every shard, and
`status` shows it as the global loss. The quality guard judges each score as it does unsharded
(a rise of more than `quality_guard` over the best recent score is flagged: `good` false, a
`quality_guard` event, an alert where one is set) but rolls nothing back: that would need every
shard to return to one consistent state, which nothing coordinates (docs/operations.md, "A
sharded syncer"); each shard's earlier checkpoints hold the state before. The final model `down`
assembles is scored the same way.

Shard 0 reads the other shards' checkpoints where they are: in this run directory. A shard on
another host (`[syncer] shard_hosts`) keeps its own, so such a run is not scored live (said once,
as an event); its final model still is, once `down` has gathered the checkpoints.
"""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from syncer import quality, shardmodel
from syncer.checkpoint import CheckpointError
from syncer.common import unscored
from syncer.config import SyncerConfig
from syncer.evaluator import GlobalEvaluator, Scoring
from syncer.globalmodel import Outbox
from syncer.guard import Snapshot, Verdict
from syncer.wire import fragments

if TYPE_CHECKING:
    from syncer.core import SyncerCore


class CheckpointEvaluator(GlobalEvaluator):
    """The evaluator thread, scoring the model assembled from the shards' checkpoints, straight
    into its own parameters one shard at a time (it holds one copy of the whole model, and one
    shard's checkpoint while reading it); or, for the final model, the tensors it is handed. A job
    with no checkpoint of every shard yet, or with the checkpoints of the last score, scores
    nothing (NaN, and nothing assembled)."""

    def __init__(
        self, settings: dict[str, Any], run_dir: Path, count: int, workload_args: dict[str, Any] | None = None
    ) -> None:
        super().__init__(settings, workload_args)
        self.run_dir, self.count = run_dir, count
        self.given: dict[int, dict[str, torch.Tensor]] = {}  # tag -> a model to score as it is
        self.assembled: queue.Queue[tuple[int, shardmodel.Assembled]] = queue.Queue()
        self._last: tuple[str, ...] | None = None  # the checkpoints of the last score

    def _load(self, params: dict[str, torch.Tensor], plan: fragments.FragmentPlan, snap: Snapshot) -> bool:
        given = self.given.pop(snap.tag, None)
        if given is not None:
            for name, value in given.items():
                params[name].copy_(value)
            return True
        names = shardmodel.newest(self.run_dir, self.count)
        if names is None or names == self._last:
            return False
        try:
            assembled = shardmodel.assemble(self.run_dir, self.count, into=params)
        except CheckpointError:
            return False  # one went away (a restarted shard prunes its old ones) or is damaged: next time
        self._last = names
        self.assembled.put((snap.tag, assembled))
        return True


class ShardScoring:
    """The loop's side on shard 0 (the interface of evaluator.Scoring): hands a scoring job over
    when one is due, turns finished scores into `global_eval` records. Never holds a checkpoint."""

    gates_checkpoints = False

    def __init__(self, evaluator: CheckpointEvaluator, every: int, elsewhere: int) -> None:
        self.ev: CheckpointEvaluator | None = evaluator
        self.every = every
        self.elsewhere = elsewhere  # how many shards keep their checkpoints on another host
        self._said = False
        self._tag = 0
        self._due_at: int | None = None  # the outer step of the next score (None: at once)
        self._submitted: dict[int, float] = {}  # the job in the evaluator: tag -> when it was handed over

    def overdue(self, now: float) -> bool:
        return False

    @property
    def off(self) -> str | None:
        """Why the sharded global model is not scored live (None while it is, or while the
        evaluator is still building the model)."""
        if self.ev is not None and self.ev.problem is not None:
            return self.ev.problem
        return unscored.elsewhere(self.elsewhere) if self.elsewhere else None

    def tick(self, core: SyncerCore, now: float, out: Outbox, checkpoint: bool = False) -> None:
        """Record finished scores; hand over the next job when `every` outer steps have passed."""
        ev = self.ev
        core.guard.off = self.off
        if ev is None or self._off(now, out):
            return None
        for tag, loss, _seconds in ev.results():
            self._record(tag, loss, now, core, out)
        if ev.busy or (self._due_at is not None and core.outer_steps < self._due_at):
            return None
        self._due_at = core.outer_steps + self.every
        self._tag += 1
        self._submitted = {self._tag: now}
        ev.submit(Snapshot(self._tag, core.outer_steps, [], [], now))
        return None

    def _off(self, now: float, out: Outbox) -> bool:
        """Whether this shard cannot score (said once, as an event)."""
        why = self.off
        if why is not None and not self._said:
            self._said = True
            tail = f"; {unscored.fix(why)}" if unscored.fix(why) else ""
            out.event(now, unscored.EVENT, "syncer", f"cannot score the sharded global model live: {why}{tail}")
        return why is not None

    def _record(self, tag: int, loss: float, now: float, core: SyncerCore, out: Outbox) -> None:
        assert self.ev is not None
        model = None
        while not self.ev.assembled.empty():
            got, assembled = self.ev.assembled.get_nowait()
            model = assembled if got == tag else model
        if model is None:
            return  # nothing was scored: no checkpoint of every shard yet, or none new
        verdict = self._judge(core, loss, model, now, out)
        record = {"t": now, "kind": "global_eval", "loss": loss, "outer_step": model.outer_steps}
        record |= {"taken_at": now, "tokens_merged": model.merged_tokens, "good": verdict.good}
        record |= {"reference": verdict.reference}
        # each source as wire.shards.checkpoint_label names it (`dldctl export` looks the score up by them)
        record |= {"versions": model.versions, "sources": [f"shard {s.shard}: {s.checkpoint}" for s in model.sources]}
        out.metrics.append(record)
        age = now - self._submitted.pop(tag, now)  # the checkpoints are at least as old
        core.guard.last = {"t": now, "loss": loss, "outer_step": model.outer_steps, "good": verdict.good}
        core.guard.last |= {"reference": verdict.reference, "age_s": age, "trips": core.guard.trips}

    def _judge(self, core: SyncerCore, loss: float, model: shardmodel.Assembled, now: float, out: Outbox) -> Verdict:
        """The quality guard's verdict on a score (syncer/guard.py), said as a `quality_guard`
        event when it flags one; nothing is rolled back: no shard can return the others to a state."""
        verdict = core.guard.judge(loss)
        if verdict.good:
            core.guard.history.append(loss)
            return verdict
        core.guard.trips += 1
        where = ", ".join(f"shard {s.shard}: {s.checkpoint}" for s in model.sources)
        head = quality.flag_line(verdict, f"of the shards' checkpoints ({where})", core.s.quality_guard)
        out.event(
            now,
            "quality_guard",
            "syncer",
            f"{head}; a sharded syncer does not roll back: each shard's earlier checkpoints hold the state "
            'before (docs/operations.md, "A sharded syncer")',
        )
        return verdict

    def score(self, tensors: dict[str, torch.Tensor], timeout: float = 60.0) -> float | None:
        """The held-out loss of `tensors` (the final model), or None if it cannot be scored."""
        ev = self.ev
        if ev is None or ev.problem is not None:
            return None
        deadline = time.monotonic() + timeout
        while ev.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        self._tag += 1
        ev.given[self._tag] = tensors
        snap = Snapshot(self._tag, 0, [], [], time.time())
        return ev.score_now(snap, max(0.0, deadline - time.monotonic()))

    def final(self, core: SyncerCore, now: float, out: Outbox) -> None:
        """Nothing before the final checkpoint: the final model is scored as it is assembled."""


def scoring_for(cfg: SyncerConfig) -> Scoring | ShardScoring:
    """How this syncer scores the global model: its own state (unsharded), the shards'
    checkpoints (shard 0 of several), or not at all (`global_eval_every = 0`, the other shards)."""
    every = cfg.settings.global_eval_every
    if cfg.shards == 1:
        return Scoring(GlobalEvaluator(cfg.settings.to_dict(), cfg.workload_args()) if every > 0 else None)
    if cfg.shard != 0 or every <= 0:
        return Scoring(None, unscored.SHARD0 if every > 0 else unscored.EVERY_OFF)
    evaluator = CheckpointEvaluator(cfg.settings.to_dict(), cfg.run_dir, cfg.shards, cfg.workload_args())
    return ShardScoring(evaluator, every, elsewhere=cfg.shards - cfg.neighbours)
