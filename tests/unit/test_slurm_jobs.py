"""Slurm sites as data (dldctl/hosts/slurmjobs.py, [[sites]] in the inventory, the supervisor's
record of a job): time limits, the sbatch command and script, squeue and scontrol output, the
partition rules `check` and `up` apply before anything is submitted."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from dldctl import inventory
from dldctl.errors import ConfigError
from dldctl.hosts import slurmjobs
from dldctl.hosts.slurmjobs import JOB_TICKS, JobInfo, SiteJob
from dldctl.observe.snapshot import learner_state
from dldctl.runstate import PidRecord, Proc, ProcStatus
from dldctl.supervise import reconcile

SITE = """
[run]
model = "gpt-tiny"
seq_len = 32
[[hosts]]
name = "a"
address = "local"
[[sites]]
name = "cluster-a"
scheduler = "slurm"
login = "alice@login.example.org"
partition = "gpu"
account = "proj42"
learners = 4
gpus_per_node = 8
time = "12:00:00"
"""


def test_time_limits_in_every_slurm_form() -> None:
    assert slurmjobs.parse_time("30") == 30 * 60
    assert slurmjobs.parse_time("30:15") == 30 * 60 + 15
    assert slurmjobs.parse_time("12:00:00") == 12 * 3600
    assert slurmjobs.parse_time("2-00") == 2 * 86400
    assert slurmjobs.parse_time("1-02:03") == 86400 + 2 * 3600 + 3 * 60
    assert slurmjobs.parse_time("1-02:03:04") == 86400 + 2 * 3600 + 3 * 60 + 4
    assert slurmjobs.parse_time("") is None and slurmjobs.parse_time("UNLIMITED") is None
    with pytest.raises(ValueError):
        slurmjobs.parse_time("12h")


def test_sbatch_command_and_script() -> None:
    job = SiteJob(
        partition="gpu", account="proj42", gpus_per_node=8, cpus_per_task=4, time="1:00:00", extra=("--qos=hi",)
    )
    argv = slurmjobs.sbatch_argv(job, "dldctl-r1-learner-3", "dldctl run_dir=/w/r1 target=learner-3", "/w/l.log", "/w")
    assert argv[:3] == ["sbatch", "--parsable", "--no-requeue"]  # the supervisor, not Slurm, replaces a job
    for flag in ("--partition=gpu", "--account=proj42", "--time=1:00:00", "--gpus-per-node=8", "--cpus-per-task=4"):
        assert flag in argv
    assert "--output=/w/l.log" in argv and "--open-mode=append" in argv and argv[-1] == "--qos=hi"
    bare = slurmjobs.sbatch_argv(SiteJob(), "n", "c", "/l", "/w")
    assert not [a for a in bare if a.startswith(("--partition", "--account", "--time", "--gpus"))]
    script = slurmjobs.batch_script(["python3", "-m", "learner", "--id", "learner-3"], "export A='b c'\n", 1)
    assert script.startswith("#!/bin/sh\nexport A='b c'\n")
    assert "exec srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --kill-on-bad-exit=1 python3 -m learner" in script


def test_a_multi_node_island_rendezvouses_on_the_first_node() -> None:
    argv = ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8", "-m", "learner"]
    line = slurmjobs.island_argv(argv, 2)
    assert "--standalone" not in line and "--nnodes=2" in line and '"$DLDCTL_HEAD:29511"' in line
    assert "DLDCTL_HEAD=$(scontrol show hostnames" in slurmjobs.batch_script(argv, "", 2)
    assert slurmjobs.island_argv(argv, 1) == shlex.join(argv)
    single = slurmjobs.island_argv(["py", "-m", "learner", "--id", "learner-0"], 3)  # nproc 1 on 3 nodes
    assert single.startswith("py -m torch.distributed.run --nnodes=3") and "--nproc-per-node=1 -m learner" in single


def test_job_names_and_targets() -> None:
    assert slurmjobs.job_name("/home/a/.dldctl/runs/0f3a/", "learner-2") == "dldctl-0f3a-learner-2"
    assert slurmjobs.job_name("/x/my run", "learner-2") == "dldctl-my_run-learner-2"
    assert slurmjobs.target_of("/r/logs/learner-12.log") == "learner-12"
    assert slurmjobs.parse_job_id("4242\n") == 4242 and slurmjobs.parse_job_id("17;cluster-a") == 17
    assert slurmjobs.parse_job_id("sbatch: error") is None


def test_squeue_lines() -> None:
    text = (
        "12|PENDING|Resources|(null)|dldctl-r-learner-0\n13|RUNNING|None|node7|n\n14|FAILED|NonZeroExitCode||n\nnoise\n"
    )
    jobs = slurmjobs.parse_squeue(text)
    assert jobs[12] == JobInfo(12, "PENDING", "Resources", "", "dldctl-r-learner-0")
    assert jobs[12].active and jobs[13].active and not jobs[14].active
    assert jobs[12].describe() == "PENDING (Resources)"
    assert jobs[13].describe() == "RUNNING on node7"
    assert jobs[14].describe() == "FAILED (NonZeroExitCode)"


PARTITION = (
    "PartitionName=gpu AllowGroups=ALL AllowAccounts=proj42,proj7 DenyAccounts=bad Default=NO "
    "MaxNodes=2 MaxTime=00:30:00 State=UP TotalCPUs=16"
)


def test_partition_rules() -> None:
    part = slurmjobs.parse_partition(PARTITION)
    assert part["MaxTime"] == "00:30:00" and part["AllowAccounts"] == "proj42,proj7"
    assert slurmjobs.partition_problems(SiteJob(partition="gpu", account="proj42", time="00:20:00"), part) == []
    (wrong,) = slurmjobs.partition_problems(SiteJob(partition="gpu", account="other"), part)
    assert "account 'other' may not use partition gpu (it allows proj42, proj7)" in wrong and "sites.account" in wrong
    (none,) = slurmjobs.partition_problems(SiteJob(partition="gpu"), part)
    assert none.startswith("a job without an account cannot use partition gpu")
    (long,) = slurmjobs.partition_problems(SiteJob(partition="gpu", account="proj7", time="12:00:00"), part)
    assert long == "time 12:00:00 is over partition gpu's limit 00:30:00: set sites.time <= 00:30:00"
    (nodes,) = slurmjobs.partition_problems(SiteJob(partition="gpu", account="proj7", nodes=3), part)
    assert "MaxNodes 2" in nodes
    down = dict(part, State="DOWN")
    assert "is DOWN" in slurmjobs.partition_problems(SiteJob(partition="gpu", account="proj7"), down)[0]
    anyone = slurmjobs.parse_partition("PartitionName=debug AllowAccounts=ALL MaxTime=UNLIMITED State=UP")
    assert slurmjobs.partition_problems(SiteJob(time="30-00:00:00"), anyone) == []


def test_associations_with_accounting_on() -> None:
    text = "proj42|\nproj7|gpu\n"
    assert slurmjobs.association_problems(SiteJob(partition="gpu", account="proj42"), "alice", text) == []
    (none,) = slurmjobs.association_problems(SiteJob(account="other"), "alice", text)
    assert "user alice has no association with account 'other' (has proj42, proj7)" in none
    (part,) = slurmjobs.association_problems(SiteJob(partition="cpu", account="proj7"), "alice", text)
    assert "partition cpu" in part
    assert slurmjobs.association_problems(SiteJob(account="x"), "alice", "") == []  # accounting off: not judged


def test_sites_are_hosts_with_a_scheduler(tmp_path: Path) -> None:
    path = tmp_path / "inv.toml"
    path.write_text(SITE)
    inv = inventory.load(path)
    site = inv.host("cluster-a")
    assert site.site and not site.local and site.address == "alice@login.example.org"
    assert (site.partition, site.account, site.gpus_per_node, site.time) == ("gpu", "proj42", 8, "12:00:00")
    assert [lid for lid, h in inv.learner_hosts() if h.site] == [f"learner-{i}" for i in range(1, 5)]
    again = inventory.parse(json.loads(json.dumps(inventory.to_dict(inv))), "x")  # the run dir's copy
    assert again.host("cluster-a") == site


@pytest.mark.parametrize(
    ("change", "key", "words"),
    [
        ('scheduler = "pbs"', "sites.cluster-a.scheduler", "not a scheduler dldctl drives"),
        ('time = "12h"', "sites.cluster-a.time", "not a Slurm time limit"),
        ("nodes = 0", "sites.cluster-a.nodes", "must be >= 1"),
        ('sbatch_args = ["--output=/tmp/x"]', "sites.cluster-a.sbatch_args", "not an option dldctl can pass"),
        ('sbatch_args = ["qos"]', "sites.cluster-a.sbatch_args", "not an option"),
        ('sbatch_args = ["--partition=cpu"]', "sites.cluster-a.sbatch_args", "write partition = ... instead"),
        ('addres = "x"', "sites.addres", "unknown key"),
    ],
)
def test_site_mistakes_name_the_key(tmp_path: Path, change: str, key: str, words: str) -> None:
    path = tmp_path / "inv.toml"
    key_written = change.split(" =", 1)[0]
    lines = [line for line in SITE.splitlines() if not line.startswith(f"{key_written} =")]
    path.write_text("\n".join([*lines, change, ""]))
    with pytest.raises(ConfigError) as info:
        inventory.load(path)
    assert f"[{key}]" in info.value.line() and words in info.value.line() and str(path) in info.value.line()


def test_site_structure_errors(tmp_path: Path) -> None:
    path = tmp_path / "inv.toml"
    path.write_text(SITE.replace('login = "alice@login.example.org"\n', ""))
    with pytest.raises(ConfigError, match=r"\[sites.login\] site cluster-a has no login"):
        inventory.load(path)
    path.write_text(SITE.replace("login =", "address ="))
    with pytest.raises(ConfigError, match="a site has a login, not an address"):
        inventory.load(path)
    path.write_text(SITE.replace('address = "local"\n', 'address = "local"\npartition = "gpu"\n', 1))
    with pytest.raises(ConfigError, match=r"\[hosts.a.partition\] is a scheduler key"):
        inventory.load(path)
    path.write_text(SITE + '[syncer]\nhost = "cluster-a"\n')
    with pytest.raises(ConfigError, match="is a scheduler site"):
        inventory.load(path)


def _job_proc(job: JobInfo | None, started: float = 100.0) -> Proc:
    return Proc("learner", "cluster-a", ProcStatus.RUNNING, PidRecord(12, JOB_TICKS), started_at=started, job=job)


def test_the_supervisor_keeps_what_the_scheduler_says() -> None:
    proc = _job_proc(JobInfo(12, "PENDING"))
    state = reconcile.RunState("up", procs={"learner-1": proc})
    waiting = reconcile.Observation(True, job=JobInfo(12, "PENDING", "Resources"), job_id=12)
    state, actions, events = reconcile.decide(state, {"learner-1": waiting}, 130.0, 1.0, 60.0)
    assert state.procs["learner-1"].job == JobInfo(12, "PENDING", "Resources") and not actions and not events
    assert learner_state(state.procs["learner-1"], None, []) == "queued"
    ended = reconcile.Observation(False, job=JobInfo(12, "PREEMPTED"), job_id=12)
    state, actions, events = reconcile.decide(state, {"learner-1": ended}, 140.0, 1.0, 60.0)
    after = state.procs["learner-1"]
    assert after.status is ProcStatus.DEAD and after.proc is None and after.job == JobInfo(12, "PREEMPTED")
    ((kind, _target, detail),) = events
    assert kind == "death" and detail.startswith("job 12 ended PREEMPTED after 40.0 s") and "restart 1" in detail


def test_a_job_the_scheduler_forgot_has_ended() -> None:
    state = reconcile.RunState("up", procs={"learner-1": _job_proc(JobInfo(12, "RUNNING"))})
    gone = reconcile.Observation(False, job=None, job_id=12)
    state, _, events = reconcile.decide(state, {"learner-1": gone}, 200.0, 1.0, 60.0)
    assert state.procs["learner-1"].job == JobInfo(12, "ENDED", "last seen RUNNING")
    assert events[0][2].startswith("job 12 ended ENDED (last seen RUNNING)")


def test_a_job_record_round_trips_through_the_state_file() -> None:
    proc = _job_proc(JobInfo(12, "RUNNING", "", "node7"))
    assert Proc.from_json(json.loads(json.dumps(proc.to_json())), "p") == dataclasses.replace(proc)
    assert not proc.proc or proc.proc.start_ticks == JOB_TICKS
