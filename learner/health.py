"""A learner's own non-finite values, and the damage `dldctl chaos corrupt` tells it to do.

Three checks, each marking the learner diverged with what was non-finite:

    gradients       after backward, the total gradient norm (clip_grad_norm_'s when grad_clip > 0,
                    else torch.nn.utils.get_total_norm: one more pass over the gradients, the same
                    one clipping makes): non-finite, the optimizer step is skipped
    loss            each training loss the trainer reads (recipe.LossMeter)
    outer gradient  of fragment p, at push time: a non-finite one is never pushed

A diverged learner reloads every fragment from the global model at its next sync and clears
its optimizer state (Trainer._collect), every time, and trains on. On the CPU the gradient
check reads the norm every step (a read is free there). With fused AdamW (CUDA) it costs no
host-device sync: the optimizer skips a non-finite step on the device (its `found_inf`, as
torch's GradScaler uses it) and the norms are read with the losses, every READ_EVERY steps.
An FSDP island reads the norm every step: its norm is a sharded tensor, gathered first.

The chaos corruption (learner/corrupt.py) is applied where its mode says: `nan` to the weights
before every step, `scale` to a fragment's weights before its outer gradient is taken, the push
modes to the outer gradient after the finiteness check (so a corrupted push is pushed). An
island skips the weight modes: only rank 0 reads control.json, and its ranks must hold the
same weights (dldctl refuses them for an island).

A learner the syncer quarantined (its contributions kept failing the syncer's judge) exits and is
restarted from the global state; the new process waits the rest of the quarantine out before it
trains (`wait_quarantine`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from learner import corrupt
from learner.logline import log
from syncer.wire.fragments import FragmentPlan

if TYPE_CHECKING:
    from learner.syncerlink import SyncerLink

QUIET_S = 1.0  # reloads closer together than this are counted, and said with the next line
IN_A_ROW = 3  # reloads with at most ROW_STEPS steps between them before the learner waits between reloads
ROW_STEPS = 2
WAIT_MAX_S = 10.0  # the longest wait (0.5 s, doubling with each reload in a row)
CAUSES = ("loss", "gradients")  # said in this order: a NaN loss makes NaN gradients, not the reverse


class Health:
    """Why the next sync reloads, the gradient norms not yet read, and the corruption in force."""

    def __init__(self, device_skip: bool, island: bool) -> None:
        self.device_skip = device_skip  # fused AdamW: skip a non-finite step on the device
        self.island = island
        self.reasons: list[str] = []  # what was non-finite, in the order seen
        self.norms: list[torch.Tensor] = []  # device_skip: read with the losses
        self.corruption: tuple[str, float, float] | None = None  # (mode, factor, until)
        self._said_at = 0.0
        self._unsaid = 0  # reloads not logged (closer than QUIET_S)
        self._row = 0  # reloads in a row (a bad device or model: non-finite again right after each)
        self._last_step = -(10**9)

    # -- non-finite values -------------------------------------------------------------------
    def mark(self, what: str) -> None:
        if what not in self.reasons:
            self.reasons.append(what)

    @property
    def diverged(self) -> bool:
        return bool(self.reasons)

    def step_ok(self, params: Iterable[torch.nn.Parameter], grad_clip: float, opt: torch.optim.Optimizer) -> bool:
        """Clip the gradients (grad_clip > 0) and check their total norm; False: skip the step."""
        params = [p for p in params if p.grad is not None]
        if grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        full = getattr(norm, "full_tensor", None)  # FSDP: a DTensor, gathered (every rank calls this)
        if full is not None:
            norm = full()
        elif self.device_skip:
            opt.found_inf = (~torch.isfinite(norm)).float()  # type: ignore[attr-defined]  # read by fused AdamW
            self.norms.append(norm.detach())
            return True
        if math.isfinite(float(norm)):
            return True
        self.mark("gradients")
        return False

    def read_norms(self) -> None:
        """The norms kept on the device since the last read (one sync): a non-finite one marks."""
        if self.norms and not bool(torch.isfinite(torch.stack(self.norms)).all()):
            self.mark("gradients")
        self.norms.clear()

    def reload_line(self, step: int) -> str | None:
        """The log line of the reload these reasons cause (taken); None while reloads come faster
        than one per QUIET_S (counted, and said with the next line)."""
        what = " and ".join(sorted(self.reasons, key=_first_cause))
        self.reasons = []
        self.norms.clear()  # of the weights thrown away
        self._row = self._row + 1 if step - self._last_step <= ROW_STEPS else 1
        self._last_step = step
        now = time.monotonic()
        if now - self._said_at < QUIET_S:
            self._unsaid += 1
            return None
        more = f" ({self._unsaid} more since the last line)" if self._unsaid else ""
        if wait := self.wait_s():
            more += (
                f"; {self._row} in a row: waiting {wait:g} s before training on, its host's resources left to others"
            )
        self._said_at, self._unsaid = now, 0
        return f"non-finite {what} at step {step}; reloading the global model{more}"

    def wait_s(self) -> float:
        """Seconds to wait after this reload: 0 until IN_A_ROW reloads came a step or two apart
        (the device or the model keeps producing them: spinning would only burn what the other
        learners on the host could use), then 0.5 s doubling to WAIT_MAX_S."""
        if self._row < IN_A_ROW:
            return 0.0
        return min(WAIT_MAX_S, 0.5 * 2.0 ** (self._row - IN_A_ROW))

    # -- chaos: dldctl chaos corrupt -----------------------------------------------------------
    def control(self, corruption: tuple[str, float, float] | None) -> None:
        """The corruption control.json asks for now (files.Controls.corruption); says when it
        starts, changes and ends."""
        was, self.corruption = self.corruption, corruption
        if corruption is None:
            if was is not None:
                log(f"chaos: corruption ({was[0]}) over")
            return
        if was is not None and was[:2] == corruption[:2]:
            return
        mode, factor, until = corruption
        what = "pushes" if mode in corrupt.PUSH_MODES else "weights"
        detail = {"scale": f"scale x{factor:g}", "bitflip": f"bitflip of {int(factor)} values"}.get(mode, mode)
        ignored = " (ignored: the ranks of an island must hold the same weights)" if self._weights_off(mode) else ""
        log(f"chaos: corrupting {what} ({detail}) until {time.strftime('%H:%M:%S', time.localtime(until))}{ignored}")

    def _mode(self) -> str | None:
        if self.corruption is None or time.time() >= self.corruption[2]:
            return None
        return self.corruption[0]

    def _weights_off(self, mode: str) -> bool:
        return self.island and mode in corrupt.WEIGHT_MODES

    def before_step(self, plan: FragmentPlan, params: Mapping[str, torch.Tensor], step: int) -> None:
        """`nan`: one element of one fragment's weights (step % fragments) set to NaN."""
        if self._mode() == "nan" and not self.island:
            p = step % plan.count
            self._damage(plan, p, params, step)

    def before_take(self, plan: FragmentPlan, p: int, params: Mapping[str, torch.Tensor], step: int) -> None:
        """`scale`: fragment p's weights x factor, just before its outer gradient is taken."""
        if self._mode() == "scale" and not self.island:
            self._damage(plan, p, params, step)

    @torch.no_grad()
    def _damage(self, plan: FragmentPlan, p: int, params: Mapping[str, torch.Tensor], step: int) -> None:
        assert self.corruption is not None
        mode, factor, _ = self.corruption
        plan.scatter(p, corrupt.corrupt(plan.gather(p, params), mode, factor, corrupt.seed_of(step, p)), params)

    def outgoing(self, p: int, delta: torch.Tensor, step: int) -> torch.Tensor | None:
        """What to push of fragment p's outer gradient: None when it is non-finite (marked: the
        learner reloads), corrupted by a push mode in force, else `delta` itself."""
        if delta.numel() and not bool(torch.isfinite(delta.amax()) and torch.isfinite(delta.amin())):
            self.mark(f"outer gradient of fragment {p}")
            return None
        mode = self._mode()
        if mode in corrupt.PUSH_MODES and self.corruption is not None:
            return corrupt.corrupt(delta, mode, self.corruption[1], corrupt.seed_of(step, p))
        return delta


def _first_cause(reason: str) -> int:
    return CAUSES.index(reason) if reason in CAUSES else len(CAUSES)


def wait_quarantine(client: SyncerLink, stop: threading.Event) -> bool:
    """Wait out the rest of a quarantine (the syncer's welcome says how long; docs/algorithm.md,
    "Judging contributions") before training; False if told to stop first."""
    if (held := client.held_s(time.monotonic())) <= 0:
        return True
    log(f"quarantined by the syncer: waiting {held:.0f} s before training from the global state")
    client.set_stats(state="quarantined")
    while client.held_s(time.monotonic()) > 0:
        if stop.wait(0.2) or client.fatal:
            return False
    client.set_stats(state="joining")
    return True
