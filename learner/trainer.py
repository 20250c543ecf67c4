"""The learner's inner loop: AdamW on its own shard, never waiting for the network (unless
`overlap = false`, or `max_lag` bounds how late a reply may be).

Reads straight through, nanoGPT style:
    join    build the workload, cut it into fragments, fetch the global state (or upload the
            initial one if this is the run's first learner), start from it
    step    forward, backward, clip, AdamW; count tokens and time per fragment; (throttle)
    sync    apply the global fragments that answer our pushes (rebase, overwrite or mix; max_lag:
            wait for one that late); push each fragment due; a non-finite loss, gradient or
            outer gradient reloads them all (learner/health.py)
    report  eval loss every eval_every steps; progress to the syncer with every heartbeat
Chaos hooks: `control.json` in the work dir can slow this learner, cut its link to the syncer, or
corrupt its weights or pushes (learner/health.py, learner/corrupt.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

import learner
from learner import files, health, initmodel, offload, recipe
from learner.config import LearnerConfig
from learner.datafeed import LearnerUnits, restore_loader, save_loader
from learner.logline import log, shown
from learner.outer import OuterState
from learner.progress import Progress
from learner.schedule import learning_rate
from learner.sends import PushItem
from learner.syncerlink import SyncerLink
from syncer.wire import fragments
from workload import Workload, WorkloadContext, build_workload

if TYPE_CHECKING:
    from learner.fsdp import ShardLayout  # imported where used: torch.distributed's FSDP is a slow import

WAIT_TICK_S = 0.1  # while waiting on the link: how often to read the chaos controls and publish


class Trainer:
    """One learner process (or rank 0 of an island)."""

    def __init__(self, cfg: LearnerConfig, incarnation: str, island: Any = None) -> None:
        self.cfg, self.s = cfg, cfg.settings
        self.incarnation = incarnation
        self.island = island
        self.stop = threading.Event()
        self.device = recipe.resolve_device(cfg.spec.device, island)
        self.step = self.tokens = 0
        self.resumed_at = 0  # the step this incarnation started at (resume)
        self.waited: set[int] = set()  # max_lag: fragments whose unanswered push was waited for
        self.controls, self.slowdown = files.Controls(cfg.workdir / "control.json"), files.Slowdown()
        self.wl: Workload | None = None
        self.phase = 0  # added to the step counter by the sync schedule (lockstep_phase)
        self.layout: ShardLayout | None = None  # island = "fsdp": this rank's shards of the fragments
        self._initial: list[torch.Tensor] | None = None
        self._joined: list[torch.Tensor] = []
        self.recipe = recipe.resolve(self.s.precision, self.s.compile, self.s.tf32, self.device)
        fsdp = island is not None and island.fsdp  # its gradient norm is sharded: read every step
        self.health = health.Health(self.recipe.fused and not fsdp, island is not None)
        self.reloaded = False  # this sync reloads the global model (non-finite values)
        self.losses = recipe.LossMeter.for_device(self.device)
        self.progress = Progress(recipe.Steady(self.recipe.warmup_steps, learner.STARTED))
        ledger = self.s.data_order == "ledger" and island is None  # an island's ranks train their shards
        self.units = LearnerUnits(cfg.workdir, cfg.spec.id, self.s.fragments, incarnation, ledger)  # its data units

    @property
    def workload(self) -> Workload:
        """The workload build() made (the loop, the optimizer and eval all run after it)."""
        assert self.wl is not None, "Trainer.build() has not run"
        return self.wl

    # -- join --------------------------------------------------------------------------------
    def build(self) -> None:
        torch.set_num_threads(max(1, self.cfg.spec.threads))
        recipe.setup(self.recipe)
        # the data order differs per island rank and per restart (a restart must not replay
        # the same batches); the model init depends only on the run's seed
        rank = self.island.rank if self.island else 0
        restarts = int(os.environ.get("DLDCTL_RESTARTS", "0") or 0)
        ctx = WorkloadContext(
            settings=self.s.to_dict(),
            learner_index=self.cfg.spec.shard,
            shards=self.cfg.spec.shards,
            batch_size=self.cfg.batch_size,
            device=self.device,
            seed=self.s.seed + 1_000_003 * rank + 7_919 * restarts,
            model_args=dict(self.cfg.model_args),
            model_dir=None if self.cfg.model_dir is None else str(self.cfg.model_dir),
            units=self.units.feed,
        )
        self.wl = build_workload(ctx)
        restore_loader(self.wl, self.cfg.workdir)
        if self.cfg.init_model is not None:  # before anything is uploaded or trained (learner/initmodel.py)
            said = initmodel.load(self.wl.model, self.cfg.init_model, self.s.init_from)
            if rank == 0:
                log(said)
        self.manifest = [  # the full shapes, before any sharding
            fragments.TensorSpec(n, tuple(t.shape), "embedding" if n in self.wl.embedding_names else "dense")
            for n, t in self.wl.model.named_parameters()
        ]
        self.plan = fragments.plan(self.manifest, self.s.fragments)
        fsdp = self.island is not None and self.island.fsdp
        self.params = {n: p.data for n, p in self.wl.model.named_parameters()}
        self._initial = self.initial_fragments() if fsdp and rank == 0 else None  # rank 0 may upload it
        self.wrapped = self.island.wrap(self.wl.model) if self.island else self.wl.model
        self.train_model = recipe.compiled(self.recipe, self.wrapped)
        if fsdp:  # the marks and outer gradients are this rank's shards'
            from learner.fsdp import ShardLayout

            self.layout = ShardLayout(self.plan, dict(self.wl.model.named_parameters()))
            self.params = self.layout.local_params()
        self.outer_plan = self.layout.local_plan if self.layout is not None else self.plan

    def to_local(self, p: int, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full global fragment (FSDP), or the fragment itself."""
        return self.layout.local_part(p, value) if self.layout is not None else value

    def outer_full(self, p: int, delta: torch.Tensor) -> torch.Tensor | None:
        """The full outer gradient of fragment p on rank 0 (FSDP: gathered from every rank's
        part, a collective every rank calls; None on the others), or this rank's own."""
        return self.layout.gather_full(p, delta) if self.layout is not None else delta

    def release(self) -> None:
        """Drop the model and everything that holds it (before the island's process group goes)."""
        self.wl = self.layout = self._initial = None
        self.params, self.train_model, self.wrapped = {}, torch.nn.Identity(), torch.nn.Identity()

    def join(self, client: SyncerLink) -> OuterState | None:
        """Wait (never forever unnoticed) for the global state; None if told to stop first."""
        client.set_stats(state="joining")
        last_note = time.monotonic()
        while not client.wait_ready(0.2):
            if self.stop.is_set() or client.fatal or not client.is_alive():
                return None
            if time.monotonic() - last_note > 10:
                last_note = time.monotonic()
                log(f"still joining: waiting for the syncer at {', '.join(client.not_ready())}")
        if not health.wait_quarantine(client, self.stop):
            return None
        full = [client.latest(p) for p in range(self.plan.count)]
        self._joined = [t for _, t in full]  # what an FSDP island's other ranks start from too
        values = [(v, self.to_local(p, t).to(self.device)) for p, (v, t) in enumerate(full)]
        client.take_updates()
        return OuterState.start(
            self.outer_plan, self.s.H, self.s.alpha, values, self.params, client.epochs(), self.s.rebase
        )

    def schedule_phase(self, outer: OuterState) -> int:
        """Steps added to a (re)joining learner's counter for its push schedule. Where learners
        wait for merges (`overlap = false`, or `max_lag`) its pushes must follow the fleet's
        fragment order, or it waits for one fragment while the others wait for its push of
        another: a deadlock (lock-step), or (max_lag) a stall broken only by each wait's
        liveness_s limit until the counters drift into line (about 20 s at quorum 4 on 2 cores).
        Otherwise nothing waits on the order, and the counter starts at 0.

        The phase is counted from where this incarnation's counter starts (`resume`): a
        restarted learner continues its own step, so a phase for a counter at 0 put its first
        push on another fragment than the fleet's, and the synchronous fleet stalled until
        the run ended (goodput 0.10 instead of 0.62 after one kill, in 2 of 3 runs)."""
        if self.s.lockstep:
            return (outer.lockstep_phase() - self.step) % outer.H
        return 0  # the syncer calls the rounds, or nothing waits on the order

    def optimizer(self) -> torch.optim.Optimizer:
        return recipe.optimizer(self.recipe, self.workload.model.parameters(), self.s.lr, self.s.weight_decay)

    def initial_fragments(self) -> list[torch.Tensor]:
        """The model's initial full fragments (FSDP: taken before sharding), on the CPU."""
        if self._initial is not None:
            return self._initial
        return [self.plan.gather(p, self.params).detach().to("cpu") for p in range(self.plan.count)]

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Train until the step/duration budget or SIGTERM; returns the exit code."""
        self.build()
        client = SyncerLink(
            self.cfg,
            fragments.manifest_to_json(self.manifest),
            self.plan.sizes(),
            self.initial_fragments,
            self.incarnation,
        )
        client.set_stats(data=self.units.meta())  # the hello says what data this learner reads
        client.start()
        world = f", island of world {self.island.world}" if self.island else ""
        log(
            f"{sum(t.numel() for t in self.params.values())} parameters on {self.device} "
            f"({self.recipe.describe()}), {self.plan.count} fragments{world}, joining {', '.join(client.addresses)}"
        )
        outer = self.join(client)
        if outer is None:
            return self._finish(client, None)
        log(f"joined at versions {client.versions()}")
        self.resume(client.resume_step)
        if self.island is not None and self.layout is not None:
            self.island.share_fragments(self._joined.__getitem__, self.plan.sizes(), self.to_local)
            self.island.share_step(self.step)
        elif self.island is not None:
            self.island.share_start(list(outer.mark), self.step)
        self._joined = []
        self.phase = self.schedule_phase(outer)
        opt = self.optimizer()
        started = self.progress.train_started = time.monotonic()
        stop = False
        while not stop:
            self._train_step(opt, outer)
            t0 = time.perf_counter()
            stop = self._budget_spent(started) or client.fatal is not None or client.restart is not None
            if not stop:
                self._bound_lag(client, outer)
            applies = self._collect(client, opt)
            due = self._due(client, outer) if not stop else []
            if self.island is not None:  # every rank applies, and moves its marks for, the same fragments
                stop, applies, due = self.island.share(stop, applies, self.plan.sizes(), due)
            reload = self.reloaded and self.island is None  # an island's ranks all apply alike (rebase)
            for p, version, value in applies:
                outer.apply(p, version, self.to_local(p, value), self.params, client.epoch(p), overwrite=reload)
                self.waited.discard(p)
            if not stop and not reload:  # after a reload no fragment has work to push
                self._push(client, outer, due)
            self.progress.blocked_s += time.perf_counter() - t0
            self._report(client)
        recipe.synchronize(self.device)
        self.progress.train_ended = time.monotonic()
        return self._finish(client, outer)

    def _budget_spent(self, started: float) -> bool:
        if self.stop.is_set():
            return True
        if self.s.steps and self.step >= self.s.steps:
            return True
        return bool(self.s.duration) and time.monotonic() - started >= self.s.duration

    def resume(self, step: int) -> None:
        """Start the step counter where the syncer says: a restarted learner continues its own
        place on the lr schedule (and in its `steps` budget), a late joiner takes up the fleet's.
        Restarting at 0 put a learner killed late in a cosine run back at the peak rate while the
        others were near the floor, and its deltas cost the global model (ALGORITHM.md)."""
        self.step = self.resumed_at = max(0, step)
        if step:
            log(f"resuming at step {step} of the lr schedule")

    def _lr(self) -> float:
        return learning_rate(self.step, self.s.lr, self.s.warmup, self.s.lr_schedule, self.s.steps, self.resumed_at)

    def _train_step(self, opt: torch.optim.Optimizer, outer: OuterState) -> None:
        t0 = time.perf_counter()
        wl = self.workload
        for group in opt.param_groups:
            group["lr"] = self._lr()
        self.health.before_step(self.outer_plan, self.params, self.step)  # chaos: corrupt --mode nan
        batch = wl.next_batch()
        opt.zero_grad(set_to_none=True)
        loss = self._forward_backward(batch)
        if self.health.step_ok(wl.model.parameters(), self.s.grad_clip, opt):  # clipped; finite
            opt.step()
        self.losses.add(loss)
        compute = time.perf_counter() - t0
        if (wait := self.slowdown.wait_s(compute, self.cfg.spec.throttle * self.controls.slow_factor())) > 0:
            self.stop.wait(wait)  # an artificially slower host
        dt = self.progress.counted(time.perf_counter() - t0)  # a stall (a pause) is not compute
        ntok = wl.tokens(batch) * (self.island.world if self.island else 1)
        self.step += 1
        self.units.stepped(self.step)
        self.tokens += ntok
        outer.count_step(ntok, dt)
        if self.step - self.resumed_at == self.progress.steady.warmup_steps:
            recipe.synchronize(self.device)  # the warm-up's end is when the device is done with it
        self.progress.stepped(ntok, dt, self.step - self.resumed_at, self.tokens)
        if self.losses.due():
            self._read_losses()

    def _forward_backward(self, batch: Any) -> torch.Tensor:
        """The loss of `batch` under the recipe's autocast, and its backward. A model torch.compile
        cannot take fails on its first call: said once, and the learner trains it uncompiled."""
        try:
            with recipe.autocast(self.recipe):
                loss = self.workload.loss(self.train_model, batch)
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        except Exception as exc:  # any compiler failure; eager below re-raises a real error
            if not self.recipe.compile or self.step > self.resumed_at:
                raise
            said = f"{type(exc).__name__}: {str(exc)[:200]}"
            log(f"torch.compile failed ({said}); training uncompiled (set compile = false)")
            self.train_model = self.wrapped
            self.recipe = dataclasses.replace(self.recipe, compile=False)
            for p in self.workload.model.parameters():
                p.grad = None
            with recipe.autocast(self.recipe):
                loss = self.workload.loss(self.train_model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
        return loss

    def _read_losses(self) -> None:
        """Fold the losses read since the last time into the EMA; a non-finite one (or gradient
        norm kept on the device) marks divergence."""
        self.health.read_norms()
        if not self.progress.losses(self.losses.read()):
            self.health.mark("loss")

    # -- sync --------------------------------------------------------------------------------
    def _collect(self, client: SyncerLink, opt: torch.optim.Optimizer) -> list[tuple[int, int, torch.Tensor]]:
        """Global fragments to apply now: replies to our pushes (rounds that merged them), forced
        resyncs, or all of them after a non-finite value (`reloaded`: local progress is thrown
        away, the optimizer state reset)."""
        replies, forced = client.take_updates()
        wanted = replies | forced
        self.units.receive(*client.take_units())
        self.reloaded = self.health.diverged
        if self.reloaded:
            if line := self.health.reload_line(self.step):
                log(line)
            self.stop.wait(self.health.wait_s())  # reloads in a row: not spinning on a bad device
            wanted = set(range(self.plan.count))
            opt.state.clear()
            self.losses.read()  # the losses of the weights thrown away: not the reloaded model's
            self.progress.loss_ema = None
        out = []
        for p in sorted(wanted):
            version, value = client.latest(p)
            out.append((p, version, offload.to_device(value, self.device)))
        return out

    def _due(self, client: SyncerLink, outer: OuterState) -> list[int]:
        """The fragments to push after this step, with work to send: those whose round the syncer
        called (round_clock = syncer), or those at their point of this learner's own schedule."""
        due = sorted(client.take_calls()) if self.s.syncer_clock else outer.due(self.step + self.phase)
        return [p for p in due if outer.counters[p].steps > 0]

    def _push(self, client: SyncerLink, outer: OuterState, due: list[int]) -> None:
        """Hand the due fragments' outer gradients to the sender (synchronous mode: and wait)."""
        for p in due:
            pushed_at = client.versions()[p]
            if self._send_outer(client, outer, p) and not self.s.overlap:
                self._wait_for_merge(client, p, pushed_at)

    def _send_outer(self, client: SyncerLink, outer: OuterState, p: int, last: bool = False) -> bool:
        """Take fragment p's outer gradient and queue it (encoded on a GPU there: learner/offload.py);
        `last`: the partial window of a learner stopped by a signal. False: it was non-finite,
        and is not pushed (the next sync reloads the global model)."""
        self.health.before_take(self.outer_plan, p, self.params, self.step)  # chaos: corrupt --mode scale
        local, c = outer.take_outer_gradient(p, self.params)
        full = self.outer_full(p, local)
        assert full is not None, "rank 0 holds the gathered outer gradient"
        delta = self.health.outgoing(p, full, self.step)  # chaos: corrupt's push modes
        if delta is None:
            return False
        sent = offload.take(delta, self.s.compression, self.s.block)
        item = PushItem(p, sent, outer.base_version[p], c.steps, c.tokens, c.time, self.progress.step_time or 0.0)
        client.push(dataclasses.replace(item, base_epoch=outer.base_epoch[p], last=last, units=self.units.for_push(p)))
        if p == 0:
            save_loader(self.workload, self.cfg.workdir)
        return True

    def _bound_lag(self, client: SyncerLink, outer: OuterState) -> None:
        """max_lag > 0 (bounded staleness): wait for a reply that is max_lag steps late (steps
        counted since the push, by the fragment's counters), so no learner trains on far ahead of
        a merge it belongs to. Each wait ends after liveness_s, and none starts or lasts while the
        syncer is unreachable: a learner never waits on a syncer that is gone. Once per reply."""
        if not self.s.max_lag or not self.s.overlap:
            return
        late = [
            p
            for p in range(outer.plan.count)
            if outer.awaiting[p] and p not in self.waited and outer.counters[p].steps >= self.s.max_lag
        ]
        for p in late:
            self._wait_for_reply(client, p)
            self.waited.add(p)  # not again until its reply is applied

    def _wait_for_reply(self, client: SyncerLink, p: int) -> None:
        """At most liveness_s, woken by the reply itself; a partition (read from the chaos
        controls every WAIT_TICK_S) or a refusal ends it."""

        deadline = time.monotonic() + self.s.liveness_s
        while client.linked(p) and not self.stop.is_set() and (left := deadline - time.monotonic()) > 0:
            if client.wait_for_reply(p, min(WAIT_TICK_S, left)):
                return
            self._read_control(client)
            self._publish(client)

    def _wait_for_merge(self, client: SyncerLink, p: int, pushed_at: int) -> None:
        """Synchronous DiLoCo (overlap = false): block until the merge of p has come back;
        the next step's _collect applies it (on every rank of an island alike). Woken by the
        update itself; every WAIT_TICK_S it reads the chaos controls and publishes progress."""
        while not self.stop.is_set() and client.fatal is None:
            if client.wait_for_version(p, pushed_at, WAIT_TICK_S):
                return
            self._read_control(client)
            self._publish(client)

    # -- reporting ---------------------------------------------------------------------------
    def _report(self, client: SyncerLink) -> None:
        self._read_control(client)
        if self.step % self.s.eval_every == 0 and self.step > 0:
            self._read_losses()
            if self.island is not None and self.layout is None:  # FSDP ranks hold different shards
                same = self.island.identical(self.params)
                log(
                    f"island of {self.island.world} ranks "
                    + ("identical" if same else "DIVERGED: ranks hold different parameters")
                )
            progress = self.progress
            progress.eval_loss = self.evaluate()
            log(
                f"step {self.step} loss {shown(progress.loss_ema)} eval {shown(progress.eval_loss)} "
                f"{progress.tokens_per_s:.0f} tok/s versions {client.versions()}"
            )
        self._publish(client)

    def _publish(self, client: SyncerLink) -> None:
        """Progress for the next heartbeat (cheap: called while waiting, too). A corrupting learner
        says `running`: a fault that simulates silent corruption does not announce itself."""
        client.set_stats(
            step=self.step,
            tokens=self.tokens,
            state="slow" if self.controls.slow_factor() > 1.0 else "running",
            **self.progress.stats(),
            data=self.units.published(self.progress.tokens_per_s, client.queued_units),
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed held-out batches (the same on every learner)."""
        wl = self.workload
        model = wl.model
        was_training = model.training
        model.eval()
        losses = [float(wl.loss(model, b)) for b in wl.eval_batches]
        model.train(was_training)
        return sum(losses) / max(1, len(losses))

    def _read_control(self, client: SyncerLink) -> None:
        """Chaos hooks from `control.json`: a partition cuts the link; a corruption (learner/health.py)."""
        self.controls.read()
        client.set_partitioned(self.controls.partitioned())
        self.health.control(self.controls.corruption())

    def _write_finished(self) -> None:
        """The marker that says the budget is spent (the supervisor does not restart it), with what
        the loop did: steps, tokens, wall seconds of the loop, and its compute and blocked parts."""
        record = {
            "steps": self.step,
            "tokens": self.tokens,
            "device": str(self.device),
            "precision": self.recipe.precision,
            "compiled": self.recipe.compile,
            "peak_memory_bytes": recipe.peak_memory(self.device),
            **self.progress.finished(self.tokens),
        }
        files.write_marker(self.cfg.workdir / "finished", json.dumps(record) + "\n")

    def _finish(self, client: SyncerLink, outer: OuterState | None) -> int:
        """Send the due fragments, say bye, stop the sender."""
        if outer is not None and client.restart is None and (client.fatal is None or self.layout is not None):
            for p in range(self.plan.count):  # stopped by a signal: at `down` the syncer keeps these out
                if outer.counters[p].steps:
                    self._send_outer(client, outer, p, last=self.stop.is_set())
        healthy = client.fatal is None and client.restart is None
        client.stop(flush_s=3.0, finished=healthy and not self.stop.is_set())
        if outer is not None:
            files.save_replica(client.replica_snapshot(), self.cfg.workdir / "replica.pt")
        if client.restart:  # its state is wrong: nothing more is pushed, the supervisor restarts it
            log(f"{client.restart}; exiting to restart from the global state")
            return 3
        if outer is not None and healthy and not self.stop.is_set():
            self._write_finished()  # budget spent: do not restart
        if client.fatal:
            log(f"the syncer refused this learner: {client.fatal}")
            files.write_marker(self.cfg.workdir / "refused", client.fatal + "\n")  # restarting cannot help
            return 2
        if outer is not None and not client.goodbye_confirmed:
            log(
                "the syncer did not confirm the goodbye; it will see this learner "
                "as unreachable, not as gone, and may have missed the last pushes"
            )
        log(f"stopped after {self.step} steps, {self.tokens} tokens")
        return 0


def install_signal_handlers(trainer: Trainer) -> None:
    """SIGTERM/SIGINT: finish the step, send due fragments, exit cleanly."""

    def handler(signum: int, _frame: Any) -> None:
        trainer.stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
