"""Slurm jobs as data: the sbatch command and batch script of a learner, and what squeue and
scontrol say back. Pure: no process, no file, no clock; `dldctl/hosts/slurm.py` is the shell.

A learner on a Slurm site is one batch job (learners are independent: no gang scheduling across
them). The job runs the learner under `srun`, so `scancel --signal=SIG JOB.0` reaches the learner
process itself (chaos kill, pause) and its death ends the job; a job that ends for any reason is
replaced by the supervisor, as a dead process is on an SSH host. `--no-requeue`: the supervisor,
not Slurm, decides about a replacement (Slurm would requeue after a node failure and both would).

Jobs are named `dldctl-<run dir name>-<learner>` and carry `dldctl run_dir=... target=...` as their
comment, so a run's jobs are found again from the cluster alone (`down` cancels by name, which also
catches a job whose id was never recorded because the supervisor died right after sbatch).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from syncer.common.typedcodec import checked, meta, to_mapping

# Where a PidRecord's start_ticks is this, its pid is a scheduler's job id (no process ever starts
# at -1 clock ticks after boot, so a pid-based liveness check of such a record never matches).
JOB_TICKS = -1
# Slurm job states in which the learner runs or may still (squeue's %T); any other state, or a job
# the scheduler no longer lists, means the job has ended.
ACTIVE_JOB_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "RESIZING", "REQUEUED", "SIGNALING"})


@dataclass(frozen=True)
class JobInfo:
    """One scheduler job as it was last listed (squeue). In the run state (`Proc.job`) it is
    `{"id", "state", "reason", "nodes"}`: the job's name is only squeue's, never stored."""

    job_id: int = field(metadata=meta(key="id"))
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, PREEMPTED, NODE_FAIL, ...
    reason: str = ""  # why it waits (Resources, Priority, ...) or ended; "" for none
    nodes: str = ""
    name: str = checked("", transient=True)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_JOB_STATES

    def describe(self) -> str:
        """`PENDING (Resources)`, `RUNNING on node7`, `FAILED (NonZeroExitCode)`."""
        if self.state == "RUNNING" and self.nodes:
            return f"RUNNING on {self.nodes}"
        return f"{self.state} ({self.reason})" if self.reason else self.state

    def to_json(self) -> dict[str, Any]:
        return to_mapping(self)


SQUEUE_FORMAT = "%i|%T|%r|%N|%j"
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_JOB_NAME_OK = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class SiteJob:
    """What the batch job of one learner asks Slurm for (from the site's inventory entry)."""

    partition: str = ""
    account: str = ""
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    time: str = ""  # Slurm's time syntax; "" = the partition's default
    extra: tuple[str, ...] = ()  # further sbatch options, verbatim (e.g. "--qos=high")


def job_name(run_dir: str, target: str) -> str:
    """The job name of a learner of the run whose directory (on the login node) is `run_dir`."""
    run = run_dir.rstrip("/").rsplit("/", 1)[-1]
    return _JOB_NAME_OK.sub("_", f"dldctl-{run}-{target}")


def target_of(log: str) -> str:
    """The learner a job is for, from its log path (`.../logs/learner-3.log`)."""
    base = log.rsplit("/", 1)[-1]
    return base[: -len(".log")] if base.endswith(".log") else base


def parse_time(text: str) -> int | None:
    """Seconds of a Slurm time limit (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`);
    None for no limit (`""`, `UNLIMITED`, `INFINITE`). ValueError for anything else."""
    text = text.strip()
    if text.upper() in ("", "UNLIMITED", "INFINITE", "NONE"):
        return None
    match = _TIME.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a Slurm time limit")
    days, a, b, c = (int(g) if g is not None else None for g in match.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        return days * 86400 + (a or 0) * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:  # HH:MM:SS
        return (a or 0) * 3600 + (b or 0) * 60 + c
    if b is not None:  # MM:SS
        return (a or 0) * 60 + b
    return (a or 0) * 60  # MM


def sbatch_argv(job: SiteJob, name: str, comment: str, log: str, cwd: str) -> list[str]:
    """`sbatch ...` for one learner's job; the batch script comes on stdin."""
    argv = [
        "sbatch",
        "--parsable",
        "--no-requeue",
        f"--job-name={name}",
        f"--comment={comment}",
        f"--output={log}",
        "--open-mode=append",
        f"--chdir={cwd}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={job.cpus_per_task}",
    ]
    argv += [f"--partition={job.partition}"] if job.partition else []
    argv += [f"--account={job.account}"] if job.account else []
    argv += [f"--time={job.time}"] if job.time else []
    argv += [f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []
    return argv + list(job.extra)


def island_argv(argv: list[str], nodes: int) -> str:
    """The learner's command line as the script runs it under srun. A torchrun island on several
    nodes rendezvouses on the job's first node instead of `--standalone` (one node)."""
    if nodes <= 1:
        return shlex.join(argv)
    if "--standalone" not in argv:  # one rank per node: still an island, under torchrun
        at = argv.index("-m")
        argv = [*argv[:at], "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *argv[at:]]
    i = argv.index("--standalone")
    before, after = shlex.join(argv[:i]), shlex.join(argv[i + 1 :])
    rdzv = f'--nnodes={nodes} --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d --rdzv-endpoint="$DLDCTL_HEAD:29511"'
    return f"{before} {rdzv} {after}"


def batch_script(argv: list[str], exports: str, nodes: int) -> str:
    """The job's script: the learner's environment, a line in its log, then the learner under srun
    (one task per node), replaced in place so a signal to step 0 reaches it."""
    head = 'DLDCTL_HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\nexport DLDCTL_HEAD\n'
    return (
        "#!/bin/sh\n"
        + exports
        + (head if nodes > 1 else "")
        + 'echo "dldctl: slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"\n'
        + f"exec srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 "
        + island_argv(argv, nodes)
        + "\n"
    )


def parse_job_id(stdout: str) -> int | None:
    """sbatch --parsable prints `ID` or `ID;CLUSTER`."""
    for line in stdout.splitlines():
        head = line.strip().split(";", 1)[0]
        if head.isdigit():
            return int(head)
    return None


def parse_squeue(text: str) -> dict[int, JobInfo]:
    """Jobs from `squeue -h -o SQUEUE_FORMAT` (other lines are ignored). A reason of `None` is ""."""
    jobs: dict[int, JobInfo] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 5 or not parts[0].isdigit():
            continue
        reason = "" if parts[2] in ("None", "(null)") else parts[2]
        nodes = "" if parts[3] in ("(null)", "") else parts[3]
        jobs[int(parts[0])] = JobInfo(int(parts[0]), parts[1], reason, nodes, "|".join(parts[4:]))
    return jobs


def parse_partition(text: str) -> dict[str, str]:
    """`scontrol show partition -o NAME`: one line of `Key=Value` pairs."""
    fields: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


def _listed(value: str) -> list[str]:
    return [v for v in value.split(",") if v and v.upper() not in ("ALL", "(NULL)")]


def partition_problems(job: SiteJob, part: dict[str, str]) -> list[str]:
    """What in the site's job the partition (`parse_partition`) would refuse or never run; each
    problem is one sentence that names the key to change."""
    name = part.get("PartitionName", job.partition or "default")
    problems: list[str] = []
    if part.get("State", "UP") != "UP":
        problems.append(f"partition {name} is {part.get('State')}: its jobs do not start (sites.partition)")
    allowed, denied = _listed(part.get("AllowAccounts", "ALL")), _listed(part.get("DenyAccounts", ""))
    if allowed and job.account not in allowed:
        who = f"account {job.account!r} may not" if job.account else "a job without an account cannot"
        problems.append(f"{who} use partition {name} (it allows {', '.join(allowed)}): set sites.account")
    if job.account and job.account in denied:
        problems.append(f"account {job.account!r} is denied partition {name}: set sites.account")
    problems += _time_problem(job, name, part.get("MaxTime", "UNLIMITED"))
    max_nodes = part.get("MaxNodes", "UNLIMITED")
    if max_nodes.isdigit() and job.nodes > int(max_nodes):
        problems.append(f"nodes = {job.nodes} is over partition {name}'s MaxNodes {max_nodes}: set sites.nodes")
    return problems


def _time_problem(job: SiteJob, name: str, max_time: str) -> list[str]:
    try:
        limit = parse_time(max_time)
        wanted = parse_time(job.time)
    except ValueError:
        return []  # the inventory's own time was checked when it was loaded; an odd MaxTime: let sbatch judge
    if limit is not None and wanted is not None and wanted > limit:
        return [f"time {job.time} is over partition {name}'s limit {max_time}: set sites.time <= {max_time}"]
    return []


def association_problems(job: SiteJob, user: str, text: str) -> list[str]:
    """From `sacctmgr -n -P show assoc where user=USER format=account,partition` (accounting on):
    whether the user may charge `job.account` on `job.partition`."""
    pairs = [tuple(line.strip().split("|")[:2]) for line in text.splitlines() if "|" in line]
    if not job.account or not pairs:
        return []
    mine = [part for acct, part in pairs if acct == job.account]
    if not mine:
        has = ", ".join(sorted({acct for acct, _ in pairs}))
        return [f"user {user} has no association with account {job.account!r} (has {has}): set sites.account"]
    if job.partition and all(part and part != job.partition for part in mine):
        return [f"account {job.account!r} may not be used on partition {job.partition} by {user}: set sites.partition"]
    return []
