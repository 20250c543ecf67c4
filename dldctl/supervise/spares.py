"""Warm spares, the supervisor's side: one spare learner process per host, kept ready.

A restarted learner spends most of its restart importing torch and torch._dynamo (see
learner/spare.py). With `[run] warm_spares = true` the supervisor keeps one process per host
that has done that already; when a learner of that host is to be (re)started, the supervisor
writes the assignment and the spare becomes that learner, and a new spare is started a
second later (so it does not compete for the CPU with the learner that is joining).

Islands (`nproc > 1`) run under torchrun and are always started fresh. A spare's record in
`state.spares[host]` is its PidRecord; it is also in procs.jsonl (target `spare-<host>`), so
`dldctl down` stops it like every other process of the run.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable

from dldctl.hostruntime import HostRuntime
from dldctl.hosts import Host, ProcRef
from dldctl.runstate import ProcStatus, RunState
from dldctl.supervise import launch
from syncer.common.resolved import LearnerEntry

SPARE_DELAY_S = 1.0  # after a handover (or a spare's death): the new learner joins from a spare in ~0.2 s
FIRST_SPARE_S = 5.0  # after the supervisor starts: the fleet itself imports torch first
SPARE_RETRY_S = 30.0  # after a spare's start, the next may start no sooner (should this one fail or die soon)


def assignment_path(runtime: HostRuntime, host_name: str) -> str:
    return f"{runtime.run_dir}/spares/{host_name}.json"


def hosts_wanting_spares(state: RunState, learners: Iterable[LearnerEntry]) -> set[str]:
    """Hosts with at least one single-process learner (of the config's `learners`) that may
    still need a (re)start."""
    nproc = {e.id: e.nproc for e in learners}
    return {
        e.host
        for name, e in state.procs.items()
        if e.learner and e.status not in (ProcStatus.STOPPED, ProcStatus.FINISHED) and nproc.get(name, 1) == 1
    }


def start_spare(host: Host, runtime: HostRuntime, host_name: str, entry: LearnerEntry) -> ProcRef:
    """Start a spare with the environment of that host's learners (`entry`: one of them)."""
    host.mkdir(f"{runtime.run_dir}/spares")
    host.run("rm -f " + shlex.quote(assignment_path(runtime, host_name)), check=False)
    env = launch.learner_env(runtime, entry, restarts=0)
    argv = [runtime.python, "-m", "learner", "--config", runtime.config, "--spare", assignment_path(runtime, host_name)]
    return host.start(argv, cwd=runtime.run_dir, log=runtime.log_path(f"spare-{host_name}"), env=env)


def hand_over(host: Host, runtime: HostRuntime, host_name: str, entry: LearnerEntry, restarts: int) -> None:
    """Tell the host's spare to become learner `entry.id` (put_bytes renames it into place whole)."""
    lid = entry.id
    workdir = runtime.learner_workdir(lid)
    host.mkdir(workdir)
    payload = {"id": lid, "workdir": workdir, "log": runtime.log_path(lid), "restarts": restarts}
    host.put_bytes(json.dumps(payload).encode(), assignment_path(runtime, host_name), 0o600)
