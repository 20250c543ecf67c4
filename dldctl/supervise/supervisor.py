"""The supervisor: keeps a run's fleet at its declared size, with no terminal attached.

`python -m dldctl.supervise.supervisor --run DIR` is started detached by `dldctl up`. Every half second:
observe every process (one round trip per host), let `reconcile.decide` say what to do (under
the state lock), then do it without holding the lock: start or restart processes, undo faults
whose time is up. Every action is an event in events.jsonl. `dldctl down` sets the run's status
to "stopping"; the supervisor then exits and leaves the stopping to `down`.

Nobody supervises alone (dldctl/supervise/watchdog.py): every loop touches the heartbeat file the watchdog
reads and restarts the watchdog if it died; the watchdog restarts this process if it dies or
hangs. A restarted supervisor first adopts (or starts again) what its predecessor was starting.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from dldctl import shards
from dldctl.errors import DldError, HostError
from dldctl.faults import links, procs
from dldctl.hostopen import host_for
from dldctl.hostruntime import HostRuntime
from dldctl.hosts import Host, ProcRef
from dldctl.hosts.slurmjobs import JobInfo
from dldctl.rundir import RunDir
from dldctl.runstate import Fault, PidRecord, ProcStatus, RunState
from dldctl.supervise import decisionlog, launch, mirror, reconcile, sinks, spares, watchdog
from dldctl.supervise.feeds import Feeds
from syncer.common.resolved import LearnerEntry, ResolvedConfig

POLL_S = 0.5
MIRROR_S = 2.0
HOST_RETRY_S = 5.0
SCHEDULER_POLL_S = 3.0  # a scheduler's controller is shared: squeue at most this often per site


def proc_ref(data: PidRecord | None) -> ProcRef | None:
    return ProcRef(data.pid, data.start_ticks) if data else None


class Supervisor:
    """The reconcile loop of one run."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.stop = threading.Event()
        self.inv = self.run.read_inventory()
        self.hosts: dict[str, Host] = {}
        self._host_retry: dict[str, float] = {}
        self._ooms: dict[str, int | None] = {}  # host -> its OOM-kill count at the last look
        self._spare_after: dict[str, float] = {}  # host -> monotonic time before which no new spare
        self._born = time.monotonic()  # the first spares wait until the fleet has started
        self._mirrored = 0.0
        self._dog_backoff = watchdog.Backoff(base=2.0)

    # -- hosts -------------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        if name not in self.hosts:
            if all(h.name != name for h in self.inv.hosts):  # added to the live run (learner add, up) since we started
                self.inv = self.run.read_inventory()
            self.hosts[name] = host_for(self.inv, name)
        return self.hosts[name]

    def config(self) -> ResolvedConfig:
        return self.run.read_config()

    # -- observe -----------------------------------------------------------------------------
    def observe(self, state: RunState) -> dict[str, reconcile.Observation]:
        """Alive/dead/unknown for every process we started, one round trip per host."""
        by_host: dict[str, list[tuple[str, ProcRef]]] = {}
        for name, entry in state.procs.items():
            ref = proc_ref(entry.proc)
            if ref is not None and entry.status in (ProcStatus.RUNNING, ProcStatus.UNREACHABLE):
                by_host.setdefault(entry.host, []).append((name, ref))
        for host_name, record in state.spares.items():
            spare = proc_ref(record)
            if spare is not None:  # always: a spare is recorded only once started (_start_spare)
                by_host.setdefault(host_name, []).append((f"spare-{host_name}", spare))
        seen: dict[str, reconcile.Observation] = {}
        for host_name, items in by_host.items():
            if time.monotonic() < self._host_retry.get(host_name, 0.0):
                seen.update({n: reconcile.Observation(None) for n, _ in items})
                continue
            try:
                alive, jobs = self._look(self.host(host_name), [r for _, r in items])
            except DldError:
                self._host_retry[host_name] = time.monotonic() + HOST_RETRY_S
                seen.update({n: reconcile.Observation(None) for n, _ in items})
                continue
            ooms = self._new_ooms(host_name, any(not alive[r.pid] and n in state.procs for n, r in items))
            for name, ref in items:
                dead = not alive[ref.pid] and name in state.procs
                finished = self._finished(state, name) if dead else None
                last = self._last_words(state, name) if dead and not finished else ""
                job, asked = (jobs.get(ref.pid), ref.pid) if jobs is not None else (None, None)
                seen[name] = reconcile.Observation(alive[ref.pid], finished, last, job, asked, ooms if dead else 0)
        return seen

    def _new_ooms(self, host_name: str, death: bool) -> int:
        """OOM kills on the host since the last look, read when one of its processes died (and
        once at the first look, as the baseline); 0 where the count is unknown."""
        if host_name in self._ooms and not death:
            return 0
        before, now = self._ooms.get(host_name), self.host(host_name).oom_kills()
        self._ooms[host_name] = now
        return now - before if now is not None and before is not None and now > before else 0

    @staticmethod
    def _look(host: Host, refs: list[ProcRef]) -> tuple[dict[int, bool], dict[int, JobInfo] | None]:
        """pid -> alive, and on a scheduler site job id -> what the scheduler says (one squeue; a
        job it no longer lists is absent, so the record says it ended); None on a machine."""
        if not host.scheduler:
            return host.alive(refs), None
        jobs = host.describe(refs, max_age=SCHEDULER_POLL_S)
        return {r.pid: r.pid in jobs and jobs[r.pid].active for r in refs}, jobs

    def _last_words(self, state: RunState, name: str) -> str:
        """The last line of a dead process's log (a crash's error), at most 300 characters."""
        entry = state.procs[name]
        try:
            text = self.host(entry.host).tail(state.runtime_of(entry.host).log_path(name), 5)
        except (DldError, OSError):
            return ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1][:300] if lines else ""

    def _finished(self, state: RunState, name: str) -> str | None:
        """'finished' (budget spent) or 'refused: why' (the syncer refused a learner; a syncer
        refused to start: its run's history was lost), from the marker file the learner leaves in
        its work dir or the syncer in the run dir; None for an ordinary death."""
        entry = state.procs[name]
        runtime = state.runtime_of(entry.host)
        syncer = entry.kind == "syncer"
        if syncer:  # each shard's marker is in its own directory (dldctl/shards.py)
            workdir = shards.remote_dir(runtime.run_dir, shards.shard_of(name) or 0)
        else:
            workdir = runtime.learner_workdir(name)
        refused = f"{workdir}/{'syncer.refused' if syncer else 'refused'}"  # syncer: syncer/checkpoint.py REFUSED
        host = self.host(entry.host)
        try:
            if not syncer and host.exists(f"{workdir}/finished"):
                return "finished"
            if host.exists(refused):
                return (
                    "refused: " + host.read_bytes(refused, 0, 2000 if syncer else 500).decode(errors="replace").strip()
                )
        except DldError:
            return None
        return None

    # -- the loop ----------------------------------------------------------------------------
    def loop(self) -> None:
        self.run.event("supervisor_start", "supervisor", f"pid {os.getpid()}")
        self.resume()
        feeds = self.feeds()
        while not self.stop.is_set():
            watchdog.beat(self.run)
            state = self.run.read_state()
            if state.status not in ("starting", "up") or self._replaced(state):
                break
            self.keep_watchdog(state)
            seen = self.observe(state)
            s = self.config().run
            with self.run.update() as edit:
                edit.state, actions, events = reconcile.decide(
                    edit.state, seen, time.time(), s.restart_delay_s, s.restart_backoff_max_s
                )
            for kind, target, detail in events:
                self.run.event(kind, target, detail)
            for action in actions:
                self.act(action)
            self.keep_spares(seen)
            self.mirror_syncer()
            feeds.poll(time.time())
            self.stop.wait(POLL_S)
        feeds.close()
        self.run.event("supervisor_stop", "supervisor", f"pid {os.getpid()}")
        for host in self.hosts.values():
            host.close()

    def feeds(self) -> Feeds:
        """The run's sinks and alerts, fed from its records (dldctl/supervise/feeds.py)."""
        created = self.run.read_state().created or time.time()

        def report(kind: str, detail: str) -> None:
            self.run.event(kind, "supervisor", detail)

        outs = sinks.build_sinks(self.inv, self.run.path, created, report)
        return Feeds(self.run.path, outs, report=lambda line: report("metrics_export_failed", line))

    def resume(self) -> None:
        """Processes a dead predecessor left `starting`: adopted if procs.jsonl has them, else started again."""
        records = self.run.started_procs()
        with self.run.update() as edit:
            edit.state, events = reconcile.resume(edit.state, records, time.time())
        for kind, target, detail in events:
            self.run.event(kind, target, detail)

    @staticmethod
    def _replaced(state: RunState) -> bool:
        """Whether another live supervisor is the recorded one (then this one leaves)."""
        record = state.supervisor
        return record is not None and record.pid != os.getpid() and watchdog.alive(record)

    def keep_watchdog(self, state: RunState) -> None:
        """Restart the watchdog if it died: it restarts us if we die."""
        if watchdog.alive(state.watchdog) or not self._dog_backoff.ready(time.monotonic()):
            return
        try:
            started = watchdog.respawn(self.run, "watchdog")
        except DldError as exc:
            delay = self._dog_backoff.restarted(0.0, time.monotonic())
            self.run.event("watchdog_restart_failed", "watchdog", f"{exc.line()}; next try in {delay:.0f} s")
            return
        if started is None:
            return
        ref, before = started
        lived = time.time() - float(before.started or 0) if before else None
        self._dog_backoff.restarted(lived, time.monotonic())
        why = f"pid {before.pid} is dead; " if before else ""
        self.run.event("watchdog_restarted" if before else "watchdog_started", "watchdog", f"{why}new pid {ref.pid}")

    def mirror_syncer(self) -> None:
        """Copy a remote syncer's new events and metrics home (every MIRROR_S)."""
        now = time.monotonic()
        if now - self._mirrored < MIRROR_S:
            return
        self._mirrored = now
        state = self.run.read_state()
        offsets = dict(state.mirror)
        for host, runtime, which in mirror.remote_shards(state, self.run):
            try:
                offsets = mirror.mirror(self.host(host), runtime, self.run, offsets, which)
            except DldError:
                continue  # the host is marked unreachable by observe(); try again next time
        if offsets != state.mirror:
            with self.run.update() as edit:
                edit.state = replace(edit.state, mirror=offsets)

    def act(self, action: reconcile.Action) -> None:
        if action.kind == "start":
            self.start(action.target)
        elif action.kind == "undo" and action.fault is not None:  # decide() gives every undo its fault
            self.undo(action.fault)

    def start(self, name: str) -> None:
        """Start (or restart) one process, then record its ProcRef under the lock."""
        state = self.run.read_state()
        entry = state.procs[name]
        runtime = state.runtime_of(entry.host)
        host = self.host(entry.host)
        how = ""
        try:
            if entry.kind == "syncer":
                ref = launch.start_syncer(host, runtime, name)
            else:
                learner = self.config().learner(name)
                wd = runtime.learner_workdir(name)
                host.run("rm -f " + shlex.quote(f"{wd}/finished") + " " + shlex.quote(f"{wd}/refused"), check=False)
                restarts = entry.restarts + (entry.started_at is not None)
                spare = self._from_spare(entry.host, runtime, learner, restarts)
                how = " (warm spare)" if spare is not None else ""
                ref = spare or launch.start_learner(host, runtime, learner, restarts)
        except (DldError, ValueError) as exc:
            s = self.config().run
            with self.run.update() as edit:
                failed, delay = reconcile.start_failed(
                    edit.state.procs[name], time.time(), s.restart_delay_s, s.restart_backoff_max_s
                )
                edit.state = edit.state.with_proc(name, failed)
            self.run.event("start_failed", name, f"{exc}; next try in {delay:.1f} s")
            return
        record = PidRecord(ref.pid, ref.start_ticks)
        self.run.record_proc(name, entry.host, record.to_json())
        job = JobInfo(ref.pid, "PENDING") if host.scheduler else None  # submitted: queued until squeue says more
        with self.run.update() as edit:
            now_running, kind = reconcile.started(edit.state.procs[name], record, time.time(), job)
            edit.state = edit.state.with_proc(name, now_running)
        again = f" (restart {now_running.restarts})" if kind == "restart" else ""
        what = f"{host.scheduler} job {ref.pid}" if host.scheduler else f"pid {ref.pid}"
        fields = {"spare": bool(how)} if entry.kind != "syncer" else {}  # a learner's: from a warm spare?
        self.run.event(kind, name, f"{what} on {entry.host}{again}{how}", **fields)  # how last: "(warm spare)"

    # -- warm spares (dldctl/supervise/spares.py) ---------------------------------------------------------
    def _from_spare(self, host_name: str, runtime: HostRuntime, learner: LearnerEntry, restarts: int) -> ProcRef | None:
        """The host's live spare, now told to become `learner`; None to start a fresh process."""
        if learner.nproc != 1:
            return None
        with self.run.update() as edit:
            ref = proc_ref(edit.state.spares.get(host_name))
            edit.state = edit.state.with_spare(host_name, None)
        self._spare_after[host_name] = max(self._next_spare(host_name), time.monotonic() + spares.SPARE_DELAY_S)
        if ref is None:
            return None
        host = self.host(host_name)
        try:
            if host.alive([ref]).get(ref.pid):
                spares.hand_over(host, runtime, host_name, learner, restarts)
                return ref
        except DldError as exc:
            self.run.event("spare_failed", f"spare-{host_name}", f"hand-over: {exc.line()}; starting afresh")
        self._signal_quietly(host, ref)
        return None

    def keep_spares(self, seen: dict[str, reconcile.Observation]) -> None:
        """One live spare on every host that may need a learner (re)started, none elsewhere."""
        state, config = self.run.read_state(), self.config()
        have = dict(state.spares)
        for host_name in list(have):
            if seen.get(f"spare-{host_name}", reconcile.Observation(True)).alive is False:
                self._drop_spare(host_name, retry_s=10.0)  # it died: try again later
                have.pop(host_name)
        wanted = spares.hosts_wanting_spares(state, config.learners) if config.run.warm_spares else set()
        wanted -= {h.name for h in self.inv.hosts if h.site}  # a site's replacement is a new job, not a spare
        for host_name in set(have) - wanted:
            self._signal_quietly(self.host(host_name), proc_ref(have[host_name]))
            self._drop_spare(host_name, retry_s=0.0)
        for host_name in sorted(wanted - set(have)):
            if time.monotonic() >= self._next_spare(host_name):
                self._start_spare(state, config, host_name)

    def _next_spare(self, host_name: str) -> float:
        """When the host's next spare may start (the first ones wait for the fleet's own start)."""
        return self._spare_after.get(host_name, self._born + spares.FIRST_SPARE_S)

    def _start_spare(self, state: RunState, config: ResolvedConfig, host_name: str) -> None:
        entry = next(e for e in config.learners_on(host_name) if e.nproc == 1)
        self._spare_after[host_name] = time.monotonic() + spares.SPARE_RETRY_S  # if it fails, not again at once
        try:
            ref = spares.start_spare(self.host(host_name), state.runtime_of(host_name), host_name, entry)
        except DldError as exc:
            self.run.event("spare_failed", f"spare-{host_name}", f"{exc.line()}; next try in 30 s")
            return
        record = PidRecord(ref.pid, ref.start_ticks)
        self.run.record_proc(f"spare-{host_name}", host_name, record.to_json())
        with self.run.update() as edit:
            edit.state = edit.state.with_spare(host_name, record)

    def _drop_spare(self, host_name: str, retry_s: float) -> None:
        with self.run.update() as edit:
            edit.state = edit.state.with_spare(host_name, None)
        self._spare_after[host_name] = time.monotonic() + retry_s

    @staticmethod
    def _signal_quietly(host: Host, ref: ProcRef | None) -> None:
        try:
            if ref is not None:
                host.signal(ref, signal.SIGTERM, group=True)
        except DldError:
            pass

    def undo(self, fault: Fault) -> None:
        """Undo an expired fault and drop it from the state."""
        state = self.run.read_state()
        entry = state.procs.get(fault.target)
        ok = False
        if entry is not None and fault.kind == "link":
            try:
                links.uncap(links.ends_of(state, self.config(), fault.target, self.host))
                ok = True
            except (DldError, ValueError) as exc:
                self.run.event("fault_undo_failed", fault.target, f"link: {exc}")
                return
        elif entry is not None:
            try:
                ok = procs.undo(
                    fault.kind,
                    self.host(entry.host),
                    state.runtime_of(entry.host),
                    fault.target,
                    proc_ref(entry.proc),
                )
            except HostError as exc:
                self.run.event("fault_undo_failed", fault.target, f"{fault.kind}: {exc}")
                return
        with self.run.update() as edit:
            edit.state = edit.state.without_fault(fault.id)
        self.run.event("fault_undo", fault.target, f"{fault.kind} undone{'' if ok else ' (process already gone)'}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the detached supervisor process."""
    parser = argparse.ArgumentParser(prog="python -m dldctl.supervise.supervisor")
    parser.add_argument("--run", required=True, type=Path)
    args = parser.parse_args(argv)
    sup = Supervisor(decisionlog.LoggingRunDir(args.run))  # its events are lines in supervisor.log too
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sup.stop.set())
    try:
        sup.loop()
    except DldError as exc:
        print(f"supervisor: error: {exc.line()}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
