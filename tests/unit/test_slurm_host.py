"""`SlurmHost` over a scripted login node: which Slurm command each Host call becomes, how often
the supervisor's polling reaches squeue, and the one-line errors. The login node itself is a real
`LocalHost` or `SSHHost` in tests/e2e/test_slurm.py, against a real slurmctld."""

from __future__ import annotations

import shlex
import signal
from pathlib import Path

import pytest

from dldctl.errors import HostError
from dldctl.hosts import CommandResult, LocalHost, ProcRef
from dldctl.hosts.slurm import SlurmHost
from dldctl.hosts.slurmjobs import JOB_TICKS, SiteJob


class Login(LocalHost):
    """A login node whose Slurm commands answer from a script; everything else is this machine."""

    def __init__(self, answers: dict[str, CommandResult]) -> None:
        super().__init__("login")
        self.answers = answers
        self.commands: list[str] = []

    def run(self, command: str, **kwargs: object) -> CommandResult:  # type: ignore[override]
        self.commands.append(command)
        for prefix, result in self.answers.items():
            if command.startswith(prefix):
                return result
        return CommandResult(0, "", "")


def ok(out: str = "") -> CommandResult:
    return CommandResult(0, out, "")


def site(answers: dict[str, CommandResult], job: SiteJob | None = None) -> tuple[SlurmHost, Login]:
    login = Login(answers)
    return SlurmHost("cluster-a", login, job or SiteJob(partition="gpu"), {"SLURM_CONF": "/x"}), login


def test_start_submits_and_returns_the_job_id(tmp_path: Path) -> None:
    host, login = site({"sbatch": ok("4242\n")})
    ref = host.start(
        ["python3", "-m", "learner"], cwd=str(tmp_path / "r1"), log=str(tmp_path / "r1/logs/learner-2.log")
    )
    assert ref == ProcRef(4242, JOB_TICKS)
    argv = shlex.split(login.commands[-1])
    assert argv[0] == "sbatch" and "--job-name=dldctl-r1-learner-2" in argv and "--partition=gpu" in argv
    assert (tmp_path / "r1/logs").is_dir()  # Slurm does not create the output file's directory


def test_a_refused_submission_is_one_line_naming_the_site(tmp_path: Path) -> None:
    refused = CommandResult(1, "", "sbatch: error: Batch job submission failed:\nInvalid account\n")
    host, _ = site({"sbatch": refused})
    with pytest.raises(HostError) as info:
        host.start(["python3"], cwd=str(tmp_path), log=str(tmp_path / "logs/learner-0.log"))
    line = info.value.line()
    assert "\n" not in line and "cluster-a" in line and "learner-0" in line and "Invalid account" in line


def test_polling_is_rate_limited_but_a_new_job_is_asked_at_once() -> None:
    host, login = site({"squeue": ok("7|RUNNING|None|n1|x\n8|PENDING|Priority|(null)|y\n")})
    a, b = ProcRef(7, JOB_TICKS), ProcRef(8, JOB_TICKS)
    assert host.alive([a, b]) == {7: True, 8: True}
    host.describe([a, b], max_age=60.0)
    host.describe([a], max_age=60.0)
    assert sum(c.startswith("squeue") for c in login.commands) == 1  # the answer alive() got, reused
    host.describe([a, ProcRef(9, JOB_TICKS)], max_age=60.0)  # job 9 was never asked: squeue again
    host.alive([a])  # alive() (chaos, down) never reuses an answer
    assert sum(c.startswith("squeue") for c in login.commands) == 3


def test_forgotten_jobs_and_an_unreachable_controller() -> None:
    host, _ = site({"squeue": CommandResult(1, "", "slurm_load_jobs error: Invalid job id specified")})
    assert host.alive([ProcRef(7, JOB_TICKS)]) == {7: False}
    down, _ = site({"squeue": CommandResult(1, "", "slurm_load_jobs error: Unable to contact slurm controller")})
    with pytest.raises(HostError, match="squeue failed: slurm_load_jobs error: Unable to contact"):
        down.alive([ProcRef(7, JOB_TICKS)])


def test_signals_reach_the_learner_or_cancel_a_waiting_job() -> None:
    running, login = site({"squeue": ok("7|RUNNING|None|n1|x\n")})
    assert running.signal(ProcRef(7, JOB_TICKS), signal.SIGSTOP)
    assert login.commands[-1] == "scancel --signal=STOP 7.0"
    waiting, login = site({"squeue": ok("7|PENDING|Resources|(null)|x\n")})
    assert not waiting.signal(ProcRef(7, JOB_TICKS), signal.SIGSTOP)  # nothing runs to pause
    assert waiting.signal(ProcRef(7, JOB_TICKS), signal.SIGTERM) and login.commands[-1] == "scancel 7"
    ended, _ = site({"squeue": ok("7|FAILED|NonZeroExitCode||x\n")})
    assert not ended.signal(ProcRef(7, JOB_TICKS), signal.SIGKILL) and not ended.cancel(ProcRef(7, JOB_TICKS))


def test_site_problems_from_the_cluster() -> None:
    missing, _ = site({"command -v": ok("sbatch\nsqueue\n")})
    assert missing.problems() == ["sbatch, squeue not found on the login node (is Slurm's client installed? PATH?)"]
    partition = ok("PartitionName=gpu AllowAccounts=proj42 MaxTime=00:30:00 State=UP\n")
    fine, _ = site({"scontrol show partition": partition, "sacctmgr": CommandResult(1, "", "no slurmdbd")})
    assert fine.problems() == [
        "a job without an account cannot use partition gpu (it allows proj42): set sites.account"
    ]
    unknown = CommandResult(1, "", "Partition nope not found")
    nope, _ = site({"scontrol show partition": unknown, "sinfo": ok("debug\ngpu\n")}, SiteJob(partition="nope"))
    assert nope.problems() == ["partition 'nope' does not exist (the cluster has debug, gpu): set sites.partition"]


def test_the_supervisor_tells_a_forgotten_job_from_a_machine() -> None:
    from dldctl.supervise.supervisor import Supervisor

    forgot, _ = site({"squeue": CommandResult(1, "", "slurm_load_jobs error: Invalid job id specified")})
    assert Supervisor._look(forgot, [ProcRef(7, JOB_TICKS)]) == ({7: False}, {})  # {}: ended, recorded as such
    assert Supervisor._look(LocalHost("here"), [])[1] is None  # a machine has no jobs to record
