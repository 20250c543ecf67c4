"""`SlurmHost`: a Slurm site as a host source: learners are batch jobs, not detached processes.

Everything but the processes goes through the site's login node, an ordinary `Host` (`LocalHost`
for `login = "local"`, sbatch on this machine; else `SSHHost`): files, the Python set-up and the
Slurm commands themselves (`sbatch`, `squeue`, `scancel`, `scontrol`, `sacctmgr`). The cluster's
shared filesystem carries the run's files from the login node to the compute nodes, as on any
Slurm cluster. The job itself is data (dldctl/hosts/slurmjobs.py).

How the `Host` calls map: `start` submits (`sbatch`, the job id becomes the `ProcRef`'s pid with
`JOB_TICKS`), `alive`/`describe` read `squeue` (pending counts as alive: the job holds its
place), `signal` sends the signal to the learner inside the job (`scancel --signal=SIG JOB.0`) or
cancels a job that has not started, `cancel` cancels it as a preemption would, and logs are the
job's output file (`--output`, the learner's log), read through the login node.
"""

from __future__ import annotations

import shlex
import signal as _signal
import time
from pathlib import Path
from typing import Any

from dldctl.errors import HostError
from dldctl.hosts.base import CommandResult, Host, ProcRef, env_exports, output_tail
from dldctl.hosts.slurmjobs import (
    JOB_TICKS,
    SQUEUE_FORMAT,
    JobInfo,
    SiteJob,
    association_problems,
    batch_script,
    job_name,
    parse_job_id,
    parse_partition,
    parse_squeue,
    partition_problems,
    sbatch_argv,
    target_of,
)

COMMANDS = ("sbatch", "squeue", "scancel", "scontrol")
# signals that end a learner: sent to a job that has not started yet, they cancel it instead
_ENDING = (_signal.SIGKILL, _signal.SIGTERM, _signal.SIGINT)


class SlurmHost(Host):
    """One Slurm site, reached through its login node."""

    scheduler = "slurm"

    def __init__(self, name: str, login: Host, job: SiteJob, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.login = login
        self.job = job
        self.env = dict(env or {})  # the site's env: for the Slurm commands and the job (SLURM_CONF, ...)
        self._seen: tuple[float, frozenset[int], dict[int, JobInfo]] = (0.0, frozenset(), {})  # last squeue

    # -- the login node does everything that is not a process ------------------------------------
    def run(
        self,
        command: str,
        *,
        timeout: float = 60.0,
        input: bytes | None = None,
        check: bool = True,
        env: dict[str, str] | None = None,
    ) -> CommandResult:
        return self.login.run(command, timeout=timeout, input=input, check=check, env={**self.env, **(env or {})})

    def put_file(self, local: Path, remote: str, mode: int = 0o644) -> None:
        self.login.put_file(local, remote, mode)

    def put_bytes(self, data: bytes, remote: str, mode: int = 0o600) -> None:
        self.login.put_bytes(data, remote, mode)

    def get_file(self, remote: str, local: Path) -> None:
        self.login.get_file(remote, local)

    def read_bytes(self, remote: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        return self.login.read_bytes(remote, offset, limit)

    def size(self, remote: str) -> int | None:
        return self.login.size(remote)

    def exists(self, remote: str) -> bool:
        return self.login.exists(remote)

    def mkdir(self, remote: str, mode: int = 0o755) -> None:
        self.login.mkdir(remote, mode)

    def home(self) -> str:
        return self.login.home()

    def close(self) -> None:
        self.login.close()

    def __getattr__(self, item: str) -> Any:
        """What else the login node offers (an SSH login's `local_address`, for the advertise address)."""
        if item == "login":
            raise AttributeError(item)
        return getattr(self.login, item)

    # -- Slurm ------------------------------------------------------------------------------------
    def slurm(self, argv: list[str], *, input: bytes | None = None, timeout: float = 30.0) -> CommandResult:
        """A Slurm command on the login node (never raises on its exit status)."""
        return self.run(shlex.join(argv), input=input, check=False, timeout=timeout)

    def start(self, argv: list[str], *, cwd: str, log: str, env: dict[str, str] | None = None) -> ProcRef:
        """Submit the learner's batch job; its id is the ProcRef's pid."""
        self.mkdir(log.rsplit("/", 1)[0])
        target = target_of(log)
        name = job_name(cwd, target)
        script = batch_script(argv, env_exports(env or {}), self.job.nodes)
        command = sbatch_argv(self.job, name, f"dldctl run_dir={cwd} target={target}", log, cwd)
        result = self.slurm(command, input=script.encode())
        job_id = parse_job_id(result.stdout) if result.status == 0 else None
        if job_id is None:
            why = " ".join(output_tail(result, 3).split()) or f"exit status {result.status}"
            raise HostError(self.name, f"sbatch refused the job of {target}: {why}")
        return ProcRef(job_id, JOB_TICKS)

    def describe(self, refs: list[ProcRef], max_age: float = 0.0) -> dict[int, JobInfo]:
        """job id -> what squeue says of it; a job squeue no longer lists is absent (it ended).
        With `max_age`, the last answer is reused while it is that young and asked of the same
        jobs: the supervisor polls twice a second, and a cluster's controller is shared."""
        if not refs:
            return {}
        wanted = frozenset(r.pid for r in refs)
        at, asked, jobs = self._seen
        if max_age > 0 and wanted <= asked and time.monotonic() - at < max_age:
            return {i: j for i, j in jobs.items() if i in wanted}
        fresh = self._squeue(refs)
        self._seen = (time.monotonic(), wanted, fresh)
        return fresh

    def _squeue(self, refs: list[ProcRef]) -> dict[int, JobInfo]:
        ids = ",".join(str(r.pid) for r in refs)
        result = self.slurm(["squeue", "-h", "-t", "all", "-j", ids, "-o", SQUEUE_FORMAT])
        if result.status != 0:
            if "Invalid job id" in result.stderr:
                return {}  # none of them is known any more: all ended long ago
            raise HostError(self.name, f"squeue failed: {' '.join(output_tail(result, 2).split())}")
        return parse_squeue(result.stdout)

    def alive(self, refs: list[ProcRef]) -> dict[int, bool]:
        jobs = self.describe(refs)
        return {r.pid: r.pid in jobs and jobs[r.pid].active for r in refs}

    def proc_state(self, ref: ProcRef) -> str | None:
        job = self.describe([ref]).get(ref.pid)
        if job is None or not job.active:
            return None
        return {"RUNNING": "R", "SUSPENDED": "T"}.get(job.state, "S")

    def signal(self, ref: ProcRef, sig: int, *, group: bool = True) -> bool:
        """The signal to the learner in the job (step 0); a job still waiting is cancelled by an
        ending signal and cannot be paused. False if the job has ended."""
        job = self.describe([ref]).get(ref.pid)
        if job is None or not job.active:
            return False
        name = _signal.Signals(sig).name.removeprefix("SIG")
        if job.state == "RUNNING" and self.slurm(["scancel", f"--signal={name}", f"{ref.pid}.0"]).status == 0:
            return True
        if sig in _ENDING:  # waiting, or its step is not up yet: nothing runs to signal
            return self.cancel(ref)
        return False

    def cancel(self, ref: ProcRef) -> bool:
        """Cancel the job (as a preemption would); False if it had already ended."""
        job = self.describe([ref]).get(ref.pid)
        if job is None or not job.active:
            return False
        result = self.slurm(["scancel", str(ref.pid)])
        if result.status != 0:
            raise HostError(self.name, f"scancel {ref.pid} failed: {' '.join(output_tail(result, 2).split())}")
        return True

    def cancel_named(self, run_dir: str, targets: list[str]) -> list[int]:
        """Cancel every active job of these learners of the run, found by name (the ids recorded
        or not); returns the job ids cancelled."""
        if not targets:
            return []
        names = ",".join(job_name(run_dir, t) for t in targets)
        listed = self.slurm(["squeue", "-h", "--name", names, "-o", SQUEUE_FORMAT])
        ids = [j.job_id for j in parse_squeue(listed.stdout).values() if j.active]
        if ids:
            self.slurm(["scancel", *map(str, ids)])
        return ids

    # -- the site's own checks (dldctl check, before dldctl up submits) ------------------------------
    def problems(self) -> list[str]:
        """What would stop this site's jobs, each one sentence: missing commands, an unknown
        partition, an account that may not use it, a time limit over its maximum."""
        missing = self.run(
            " ; ".join(f"command -v {c} >/dev/null || echo {c}" for c in COMMANDS), check=False
        ).stdout.split()
        if missing:
            return [f"{', '.join(missing)} not found on the login node (is Slurm's client installed? PATH?)"]
        argv = ["scontrol", "show", "partition", "-o"] + ([self.job.partition] if self.job.partition else [])
        result = self.slurm(argv)
        lines = [line for line in result.stdout.splitlines() if "PartitionName=" in line]
        if result.status != 0 or not lines:
            return [self._no_partition(result)]
        part = next((p for p in map(parse_partition, lines) if self.job.partition or p.get("Default") == "YES"), None)
        if part is None:
            return ["the cluster has no default partition: set sites.partition"]
        return partition_problems(self.job, part) + self._associations()

    def _no_partition(self, result: CommandResult) -> str:
        if not self.job.partition:
            return f"scontrol show partition failed: {' '.join(output_tail(result, 2).split())}"
        known = ", ".join(self.slurm(["sinfo", "-h", "-o", "%R"]).stdout.split()) or "none"
        return f"partition {self.job.partition!r} does not exist (the cluster has {known}): set sites.partition"

    def _associations(self) -> list[str]:
        """With Slurm accounting on, whether the user may charge the account (skipped where it is off)."""
        if not self.job.account:
            return []
        user = self.run("id -un", check=False).stdout.strip()
        argv = ["sacctmgr", "-n", "-P", "show", "assoc", "where", f"user={user}", "format=account,partition"]
        result = self.slurm(argv)
        return association_problems(self.job, user, result.stdout) if result.status == 0 else []
