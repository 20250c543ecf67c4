"""The syncer's evaluator: scores snapshots of the global model on the run's held-out batches.

A thin shell beside the ZeroMQ loop (syncer/server.py): one daemon thread builds the run's
workload on the CPU once (the same factory and the same fixed `eval_batches` every learner
scores its local model on, workload/), then scores each snapshot it is handed. The loop never
waits for it: `submit` hands over at most one snapshot at a time and `results` takes what is
done. If the workload cannot be built here (a user's factory not importable on the syncer's
host), it says so once and scores nothing; `global_eval_every = 0` turns it off. For a model too
large to score on the syncer's CPU, turn it off and rely on the learners' own eval losses.
Whenever nothing is scored (so the quality guard judges nothing), `Scoring.off` says why, in the
words of syncer/common/unscored.py, and `tick` puts it in `core.guard.off` for the status snapshot
and the export.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from syncer import checkpoint as ckpt
from syncer import quality
from syncer.common import unscored
from syncer.globalmodel import Outbox
from syncer.guard import Snapshot
from syncer.wire import fragments
from workload import build_workload, scoring_context

if TYPE_CHECKING:
    from syncer.core import SyncerCore


HOLD_LIMIT_S = 60.0  # a checkpoint waits at most this long for its score


class GlobalEvaluator(threading.Thread):
    """Scores global-model snapshots off the loop thread."""

    def __init__(self, settings: dict[str, Any], workload_args: dict[str, Any] | None = None) -> None:
        super().__init__(name="global-eval", daemon=True)
        self.settings = settings
        self.workload_args = dict(workload_args or {})  # model_args, model_dir (WorkloadContext)
        self.problem: str | None = None  # why it cannot score (set once, then it stops)
        self._todo: queue.Queue[Snapshot] = queue.Queue(maxsize=1)
        self._done: queue.Queue[tuple[int, float, float]] = queue.Queue()  # (tag, loss, seconds)
        self._halt = threading.Event()
        self.busy = False

    def submit(self, snap: Snapshot) -> bool:
        """Hand over a snapshot; False if one is still being scored (the caller skips this one)."""
        if self.problem is not None or self.busy:
            return False
        self.busy = True
        self._todo.put(snap)
        return True

    def results(self) -> list[tuple[int, float, float]]:
        """(tag, loss, seconds) of the snapshots scored since the last call."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def score_now(self, snap: Snapshot, timeout: float = 60.0) -> float | None:
        """Score one snapshot and wait for it (the final export); None if it cannot."""
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.submit(snap):
            return None
        while time.monotonic() < deadline and self.problem is None:
            for tag, loss, _ in self.results():
                if tag == snap.tag:
                    return loss
            time.sleep(0.01)
        return None

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        try:
            model, plan, batches, loss_fn = self._build()
        except Exception as exc:
            self.problem = unscored.build_failed(exc)
            return
        while not self._halt.is_set():
            try:
                snap = self._todo.get(timeout=0.2)
            except queue.Empty:
                continue
            t0 = time.perf_counter()
            try:
                loss = self._score(model, plan, batches, loss_fn, snap)
            except Exception as exc:
                self.problem = unscored.scoring_failed(exc)
                return
            self._done.put((snap.tag, loss, time.perf_counter() - t0))
            self.busy = False

    def _build(self) -> tuple[torch.nn.Module, fragments.FragmentPlan, list[Any], Any]:
        s = self.settings
        ctx = scoring_context(s, **self.workload_args)
        wl = build_workload(ctx)
        wl.model.eval()
        params = dict(wl.model.named_parameters())
        manifest = [
            fragments.TensorSpec(n, tuple(t.shape), "embedding" if n in wl.embedding_names else "dense")
            for n, t in params.items()
        ]
        return wl.model, fragments.plan(manifest, int(s["fragments"])), wl.eval_batches, wl.loss

    @torch.no_grad()
    def _score(
        self, model: torch.nn.Module, plan: fragments.FragmentPlan, batches: list[Any], loss_fn: Any, snap: Snapshot
    ) -> float:
        params = {n: p.data for n, p in model.named_parameters()}
        if not self._load(params, plan, snap):
            return math.nan  # nothing to score (a sharded syncer's: no new checkpoints)
        losses = [float(loss_fn(model, b)) for b in batches]
        return sum(losses) / max(1, len(losses))

    def _load(self, params: dict[str, torch.Tensor], plan: fragments.FragmentPlan, snap: Snapshot) -> bool:
        """Put the snapshot's model into the evaluator's parameters (a sharded syncer's scorer
        reads it from the shards' checkpoints instead: syncer/shardscore.py); False: nothing to score."""
        for p, theta in enumerate(snap.theta):
            plan.scatter(p, theta, params)
        return True


class Scoring:
    """The loop's side: hand a snapshot over when a score is due, fold finished scores into the
    core (which may roll back, syncer/quality.py)."""

    def __init__(self, evaluator: GlobalEvaluator | None, off: str = unscored.EVERY_OFF) -> None:
        self.ev = evaluator
        self._off = off  # why nothing is scored without an evaluator
        self._said = False
        self._held: dict[int, dict[str, Any]] = {}  # snapshot tag -> the checkpoint state taken with it

    @property
    def off(self) -> str | None:
        """Why the global model is not scored (so not guarded); None while it is, or while the
        evaluator is still building the model."""
        return self._off if self.ev is None else self.ev.problem

    @property
    def gates_checkpoints(self) -> bool:
        """Whether routine checkpoints wait for a good score of the very state they hold."""
        return self.ev is not None and self.ev.problem is None

    def overdue(self, now: float, limit_s: float = HOLD_LIMIT_S) -> bool:
        """A held checkpoint state not scored within `limit_s` (the evaluator is stuck or far too
        slow for this model): dropped, so the caller checkpoints without waiting."""
        stale = [tag for tag, state in self._held.items() if now - float(state["saved_at"]) > limit_s]
        for tag in stale:
            del self._held[tag]
        return bool(stale)

    def tick(self, core: SyncerCore, now: float, out: Outbox, checkpoint: bool = False) -> dict[str, Any] | None:
        """Fold in finished scores and hand over the next snapshot. With `checkpoint` (one is due),
        the snapshot is taken now with a copy of the checkpoint state; that state is returned, to be
        written, once its score comes back good (a flagged one is rolled back instead)."""
        core.guard.off = self.off
        if self.ev is None:
            return None
        if self.ev.problem is not None:
            if not self._said:
                self._said = True
                out.event(now, unscored.EVENT, "syncer", unscored.event_detail(self.ev.problem))
            return None
        ready = None
        for tag, loss, _seconds in self.ev.results():
            verdict = quality.apply_score(core, tag, loss, now, out)
            held = self._held.pop(tag, None)
            if held is not None and verdict is not None and verdict.good:
                ready = held
        # a state just came back good: it is the checkpoint due (holding another now would hold the
        # same outer step again when nothing merged in between, and write it twice)
        hold = checkpoint and not self._held and ready is None
        if not self.ev.busy:
            if hold and core.model is not None:
                core.scored_at = None  # score now, the state a checkpoint will hold
            snap = quality.take_snapshot(core, now)
            if snap is not None:
                if hold:
                    self._held[snap.tag] = ckpt.state_dict(core, now, copy=True)
                self.ev.submit(snap)
        return ready

    def score(self, tensors: dict[str, torch.Tensor]) -> float | None:
        """None: an unsharded syncer's export takes the guard's score of its own final state
        (`final`); a sharded one's scores the assembled model (syncer/shardscore.py)."""
        return None

    def final(self, core: SyncerCore, now: float, out: Outbox) -> None:
        """Score the state about to be exported, so an export is never of a state the guard flags
        (a flagged one is rolled back first)."""
        if self.ev is None or self.ev.problem is not None or core.model is None:
            return
        for tag, loss, _seconds in self.ev.results():
            quality.apply_score(core, tag, loss, now, out)
        core.guard.pending, core.scored_at = None, None
        snap = quality.take_snapshot(core, now)
        final = self.ev.score_now(snap) if snap is not None else None
        if snap is not None and final is not None:
            quality.apply_score(core, snap.tag, final, now, out)
