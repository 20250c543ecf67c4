"""Carrying chaos out on a live run: kill, pause, slow, partition, corrupt, heal, with the quorum guard.

Every fault with a duration is registered in the run state *before* it is applied, with its
expiry time, so the supervisor undoes it on time even if this command is interrupted. A kill
puts a hold on the target (it stays down for `--down-for`, else its normal restart delay) and
is marked as chaos, so it does not count towards the crash-loop backoff. Every injection and
every undo is an event.
"""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from dldctl import shards
from dldctl.chaos import corruption
from dldctl.chaos.plan import ACTIONS
from dldctl.chaos.records import Injection
from dldctl.errors import ChaosError, DldError, UsageError
from dldctl.faults import linkcap, links, procs
from dldctl.hostopen import host_for
from dldctl.hostruntime import HostRuntime
from dldctl.hosts import Host, ProcRef
from dldctl.observe.snapshot import collect
from dldctl.rundir import RunDir
from dldctl.runstate import Fault, Proc, ProcStatus

Confirm = Callable[[str], bool]
DOWN_STATES = ("dead", "restarting", "stopped", "refused", "starting", "queued", "paused", "partitioned")


def quorum_left(snap: dict[str, Any], target: str) -> tuple[int, int]:
    """(live learners left once `target` is down, the minimum quorum) by a status snapshot."""
    live = [r["id"] for r in snap["learners"] if r["state"] not in DOWN_STATES]
    return len([lid for lid in live if lid != target]), int(snap["quorum"]["min"])


class Chaos:
    """Fault injection against one live run."""

    def __init__(self, run: RunDir) -> None:
        if not run.live():
            raise UsageError(f"run {run.name} is not live", hint="chaos needs a running fleet: `dldctl up`")
        self.run = run
        self.inv = run.read_inventory()
        config = run.read_config()
        self.settings = config.run
        self.shards = config.syncer.shards  # syncer processes: `syncer`, `syncer-1`, ... (dldctl/shards.py)
        self._hosts: dict[str, Host] = {}
        self.started: set[str] = set()  # ids of the faults this instance injected
        self.held: set[str] = set()  # targets this instance killed with a hold

    def close(self) -> None:
        for host in self._hosts.values():
            host.close()

    def _host(self, name: str) -> Host:
        if name not in self._hosts:
            self._hosts[name] = host_for(self.inv, name)
        return self._hosts[name]

    def canonical(self, target: str) -> str:
        """The process a target names: `syncer-0` is `syncer`; UsageError naming the valid syncer
        targets for a shard the run does not have; any other name as it is."""
        return shards.syncer_target(target, self.shards) or target

    def _target(self, target: str, action: str) -> tuple[Proc, Host, HostRuntime]:
        state = self.run.read_state()
        procs = state.procs
        syncer = shards.syncer_target(target, self.shards)  # UsageError for a shard the run lacks
        if (syncer or target) not in procs or (syncer and action != "kill"):
            known = ", ".join(sorted(n for n, p in procs.items() if p.learner))
            raise UsageError(
                f"cannot {action} {target!r}",
                hint=f"learners: {known}" + ("; a syncer shard can only be killed" if syncer else ""),
            )
        entry = procs[syncer or target]
        return entry, self._host(entry.host), state.runtime_of(entry.host)

    # -- the guard ---------------------------------------------------------------------------
    def guard(self, action: str, target: str, force: bool, confirm: Confirm | None) -> None:
        """Refuse (unless forced or confirmed) a fault that drops the live fleet below quorum."""
        if action in ("slow", "corrupt") or shards.shard_of(target) is not None or force:
            return  # slow, corrupt: it keeps training; a syncer shard is not a learner
        after, quorum = quorum_left(collect(self.run), target)
        if after >= quorum:
            return
        question = (
            f"{action} {target} leaves {after} live learners, below the minimum quorum {quorum}: "
            "the global model stops progressing until it is back. Go ahead?"
        )
        if confirm is None or not confirm(question):
            raise ChaosError(
                f"refused: {action} {target} would leave {after} live learners, below the minimum quorum {quorum}",
                hint="pass --force to do it anyway",
            )

    # -- faults ------------------------------------------------------------------------------
    def kill(self, target: str, sig: str = "KILL", down_for: float | None = None, by: str | None = None) -> Injection:
        """Signal the target's process group (a learner's, or a syncer shard's: `syncer`, `syncer-N`)
        with a hold on its restart; what was done. `by`: who asked, when not `dldctl chaos` (the
        live view): its death is attributed to it."""
        target = self.canonical(target)
        entry, host, _ = self._target(target, "kill")
        ref = entry.proc
        if entry.status is not ProcStatus.RUNNING or not ref:
            raise ChaosError(f"{target} is not running (status {entry.status}); nothing to kill")
        hold = down_for if down_for is not None else self.settings.restart_delay_s
        now = time.time()
        self.held.add(target)
        with self.run.update() as edit:
            e = replace(edit.state.procs[target], hold_until=now + hold, chaos_kill=True, killed_by=by)
            edit.state = edit.state.with_proc(target, e)
        signum = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}[sig.upper()]
        if not host.signal(ProcRef(ref.pid, ref.start_ticks), signum, group=True):
            raise ChaosError(f"{target} ({'job' if host.scheduler else 'pid'} {ref.pid}) was already gone")
        what = f"the learner in {host.scheduler} job {ref.pid}" if host.scheduler else f"pid {ref.pid}"
        detail = f"kill -{sig.upper()} {what} on {entry.host}; back in >= {hold:g} s{f' (by {by})' if by else ''}"
        self.run.event("fault_inject", target, detail, action="kill", duration_s=hold)
        return Injection("kill", target, entry.host, ref.pid, now, hold, now + hold, detail, signal=sig.upper())

    def preempt(self, target: str, down_for: float | None = None) -> Injection:
        """Cancel a learner's scheduler job as a preemption would; the supervisor submits a new one."""
        entry, host, _ = self._target(target, "preempt")
        ref = entry.proc
        if not host.scheduler:
            raise UsageError(
                f"{target} runs on host {entry.host}, not as a scheduler's job: there is nothing to preempt",
                hint=f"`dldctl chaos kill {target}` ends its process",
            )
        if entry.status is not ProcStatus.RUNNING or not ref:
            raise ChaosError(f"{target} has no job queued or running (status {entry.status}); nothing to preempt")
        hold = down_for if down_for is not None else self.settings.restart_delay_s
        now = time.time()
        self.held.add(target)
        with self.run.update() as edit:
            edit.state = edit.state.with_proc(
                target, replace(edit.state.procs[target], hold_until=now + hold, chaos_kill=True)
            )
        if not host.cancel(ProcRef(ref.pid, ref.start_ticks)):
            raise ChaosError(f"{target}'s job {ref.pid} had already ended")
        detail = (
            f"cancelled {host.scheduler} job {ref.pid} on {entry.host} as a preemption; resubmitted in >= {hold:g} s"
        )
        self.run.event("fault_inject", target, detail, action="preempt", duration_s=hold)
        return Injection("preempt", target, entry.host, ref.pid, now, hold, now + hold, detail)

    def fault(self, action: str, target: str, duration: float, factor: float = 3.0, mode: str = "") -> Injection:
        """pause / slow / partition / corrupt (its `mode`) for `duration` seconds (undone by the
        supervisor at expiry)."""
        if action not in ACTIONS or action in ("kill", "link"):
            raise UsageError(f"unknown fault {action!r}")
        if duration <= 0:
            raise UsageError("--duration must be > 0")
        if action == "slow" and factor <= 1.0:
            raise UsageError("--factor must be > 1 (how many times slower)")
        if action == "corrupt":  # a factor of a mode that takes none (a plan's default) is no factor
            factor = self.corruption(target, mode, factor if mode in corruption.DEFAULT_FACTOR else None)
        entry, host, runtime = self._target(target, action)
        ref = entry.proc
        if entry.status is not ProcStatus.RUNNING or not ref:
            raise ChaosError(f"{target} is not running (status {entry.status})")
        now = time.time()
        record = Fault(secrets.token_hex(4), action, target, now + duration, now, factor)
        self.started.add(record.id)  # ours before it is in state.json: no moment when heal(own) misses it
        with self.run.update() as edit:  # registered first: the undo survives our death
            edit.state = edit.state.with_fault(record)
        try:
            ref_now = ProcRef(ref.pid, ref.start_ticks)
            ok = procs.apply(action, host, runtime, target, ref_now, duration, factor, mode=mode)
        except DldError as exc:
            self._forget(record.id)
            raise ChaosError(f"could not {action} {target}: {exc.line()}") from exc
        if not ok:
            self._forget(record.id)
            what = (
                f"its {host.scheduler} job {ref.pid} is not running (queued or ended)"
                if host.scheduler
                else f"pid {ref.pid} was already gone"
            )
            raise ChaosError(f"{target}: {what}")
        detail = _detail(action, duration, factor, mode)
        self.run.event("fault_inject", target, detail, action=action, duration_s=duration, factor=factor)
        shown = factor if action == "slow" or mode in corruption.DEFAULT_FACTOR else None
        hit = (entry.host, ref.pid, now, duration, record.until, detail)
        return Injection(action, target, *hit, factor=shown, fault_id=record.id, mode=mode or None)

    def corruption(self, target: str, mode: str, factor: float | None) -> float:
        """The factor a corruption of `target` runs with; UsageError (one line) for a bad mode or
        factor, or a weight mode on an island (only its rank 0 reads control.json)."""
        used = corruption.checked(mode, factor)
        entry = next((e for e in self.run.read_config().learners if e.id == target), None)
        if entry is not None and entry.nproc > 1 and mode in corruption.WEIGHT_MODES:
            raise UsageError(
                f"--mode {mode}: {target} is an island of {entry.nproc} ranks, whose weights must stay the same",
                hint="corrupt an island's pushes: --mode signflip, noise or bitflip",
            )
        return used

    # -- link caps (dldctl/faults/links.py) --------------------------------------------------------
    def link_ends(self, target: str) -> links.Ends:
        """The learner's link, refused where a cap would also cap other learners."""
        state = self.run.read_state()
        entry = state.procs.get(target)
        if entry is None or not entry.learner:
            known = ", ".join(sorted(n for n, p in state.procs.items() if p.learner))
            raise UsageError(f"cannot cap the link of {target!r}", hint=f"learners: {known}")
        addresses = {h.name: h.address for h in self.inv.hosts}
        others = links.sharing(state, addresses, target)
        if others:
            raise ChaosError(
                f"{target} reaches the syncer from the same machine as {', '.join(others)} "
                f"(host {entry.host}): a cap on its link would cap theirs too",
                hint="cap a learner that has a machine of its own",
            )
        return links.ends_of(state, self.run.read_config(), target, self._host)

    def link_ends_any(self, target: str) -> links.Ends:
        """The learner's link as it is (to undo a cap: no refusal)."""
        return links.ends_of(self.run.read_state(), self.run.read_config(), target, self._host)

    def link_plan(self, target: str, rate: str) -> list[str]:
        """What `chaos link --dry-run` prints: the tc commands per host, or LinkCapError/ChaosError."""
        bits = linkcap.parse_rate(rate)
        return [
            f"{host.name}: {command}"
            for host, commands in links.plan(self.link_ends(target), bits)
            for command in commands
        ]

    def link(self, target: str, rate: str, duration: float) -> Injection:
        """Cap the learner's link to and from the syncer at `rate` for `duration` seconds."""
        if duration <= 0:
            raise UsageError("--duration must be > 0")
        try:
            bits = linkcap.parse_rate(rate)
            ends = self.link_ends(target)
            links.plan(ends, bits)  # refused here, before anything is registered or changed
        except (linkcap.LinkCapError, ChaosError) as exc:
            raise ChaosError(f"cannot cap the link of {target}: {exc}") from None
        entry = self.run.read_state().procs[target]
        now = time.time()
        record = Fault(secrets.token_hex(4), "link", target, now + duration, now, rate=rate)
        self.started.add(record.id)  # ours before it is in state.json: no moment when heal(own) misses it
        with self.run.update() as edit:  # registered first: the undo survives our death
            edit.state = edit.state.with_fault(record)
        try:
            where = links.cap(ends, bits)
        except (DldError, linkcap.LinkCapError) as exc:
            self._forget(record.id)
            raise ChaosError(f"could not cap the link of {target}: {exc}") from exc
        detail = f"link capped at {rate} for {duration:g} s ({where})"
        self.run.event("fault_inject", target, detail, action="link", duration_s=duration, rate=rate)
        pid = entry.proc.pid if entry.proc else 0
        return Injection(
            "link", target, entry.host, pid, now, duration, record.until, detail, fault_id=record.id, rate=rate
        )

    def _forget(self, fault_id: str) -> None:
        with self.run.update() as edit:
            edit.state = edit.state.without_fault(fault_id)

    def heal(self, target: str | None = None, own: bool = False) -> list[str]:
        """Undo every active fault (of one target, or all; `own`: only those this instance
        started) and lift kill holds; idempotent."""
        state = self.run.read_state()
        done = []
        for fault in state.faults:
            mine = not own or fault.id in self.started
            if mine and (target is None or fault.target == target):
                if fault.kind == "link":
                    links.uncap(self.link_ends_any(fault.target))
                else:
                    entry, host, runtime = self._target(fault.target, fault.kind)
                    ref = entry.proc
                    procs.undo(
                        fault.kind, host, runtime, fault.target, ProcRef(ref.pid, ref.start_ticks) if ref else None
                    )
                self._forget(fault.id)
                self.run.event("fault_undo", fault.target, f"{fault.kind} healed")
                done.append(f"{fault.kind} {fault.target}")
        with self.run.update() as edit:
            for name, entry in edit.state.procs.items():
                mine = not own or name in self.held
                if mine and (target is None or name == target) and entry.hold_until:
                    lifted = replace(entry, hold_until=None)
                    if entry.status is ProcStatus.DEAD:
                        lifted = replace(lifted, next_start=time.time())
                    edit.state = edit.state.with_proc(name, lifted)
                    self.run.event("fault_undo", name, "kill hold lifted: restarting now")
                    done.append(f"hold {name}")
        return done


def _detail(action: str, duration: float, factor: float, mode: str) -> str:
    """A pause's, slow's, partition's or corruption's `fault_inject` detail (and the command's line)."""
    return {
        "pause": f"SIGSTOP for {duration:g} s",
        "slow": f"x{factor:g} slower for {duration:g} s",
        "partition": f"cut off from the syncer for {duration:g} s",
        "corrupt": f"{corruption.describe(mode, factor)} for {duration:g} s" if mode else "",
    }[action]
