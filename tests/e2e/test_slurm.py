"""Learners as Slurm batch jobs, against a real slurmctld and slurmd (tests/slurmcluster.py).

One fleet with a Slurm site whose login is this machine (`login = "local"`) and a second site
whose jobs are held in the queue (`--begin`): `check`, `up`, each learner a job named after the
run, `status` with job ids, states and the reason a job waits, `chaos kill` (the learner inside
its job) and `chaos preempt` (the job cancelled) healed by resubmission, `learner add --site`,
`logs` of a job, and `down` with nothing of the run left in the queue. Then the mistakes refused
before anything is submitted (unknown partition, an account that may not use it, a time over the
partition's limit), and a site reached through a real sshd login node.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dldctl.testing import DldctlHome
from syncer.common import jsonlread
from tests.e2e.fleetutil import ROOT, learner, run_table
from tests.slurmcluster import SlurmCluster, available
from tests.sshfleet import SSHFleet

pytestmark = [pytest.mark.timeout(400)]
# a site with login "local" makes the syncer listen on every address and advertise this machine's
# name (its compute nodes are elsewhere on a real cluster); the tests keep to loopback
LOOPBACK = '\n[syncer]\nadvertise = "127.0.0.1"\n'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = available()
    if why is not None:  # as root (CI) scripts/test.sh installs it: missing there is a failure
        message = f"no Slurm to test against: {why} (scripts/test.sh installs slurmctld, slurmd, munge)"
        pytest.fail(message) if os.geteuid() == 0 else pytest.skip(message)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def site(name: str, cluster: SlurmCluster, learners: int, login: str = "local", **extra: object) -> str:
    lines = [
        "",
        "[[sites]]",
        f'name = "{name}"',
        'scheduler = "slurm"',
        f'login = "{login}"',
        f"learners = {learners}",
        f'python = "{sys.executable}"',
        f'env = {{ SLURM_CONF = "{cluster.conf}" }}',
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def ours(cluster: SlurmCluster, run_dir: Path) -> list[dict[str, str]]:
    """The queue's jobs of this run (by the name dldctl gives them), active or not."""
    return [j for j in cluster.jobs() if j["name"].startswith(f"dldctl-{run_dir.name}-")]


def active(cluster: SlurmCluster, run_dir: Path) -> list[dict[str, str]]:
    return [j for j in ours(cluster, run_dir) if j["state"] in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")]


def job_of(snap: dict, lid: str) -> dict:
    return learner(snap, lid).get("job") or {}


@pytest.fixture(scope="module")
def slurm_run(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DldctlHome, Path]]:
    home = tmp_path_factory.mktemp("slurmhome")
    inv = home / "inventory.toml"
    # a user's factory from a shipped workdir: the jobs and the syncer import it from the snapshot
    inv.write_text(
        run_table("slurm", quorum=1, model="custom_model:factory", workdir=str(ROOT / "examples"))
        + LOOPBACK
        + site("cluster", cluster, 2, partition="debug", time="30:00")
        + site("later", cluster, 1, sbatch_args=["--begin=now+3600"])  # queued for an hour: never runs here
    )
    with DldctlHome(home) as dl:
        yield dl, inv


def test_check_sees_the_sites_scheduler(slurm_run: tuple[DldctlHome, Path]) -> None:
    dl, inv = slurm_run
    plan = dl("up", str(inv), "--dry-run", timeout=60).stdout
    assert "learner-0 on cluster (a slurm job of 1 node(s) via sbatch here, partition debug, time 30:00)" in plan
    report = json.loads(dl("check", str(inv), "--json", timeout=120).stdout)
    rows = {h["name"]: h["checks"] for h in report["hosts"]}
    assert rows["cluster"]["slurm"]["ok"] and "partition debug takes the jobs" in rows["cluster"]["slurm"]["detail"]
    assert rows["later"]["slurm"]["ok"]
    assert not any(m["host"] in ("cluster", "later") for m in report["learner_memory"] or [])  # jobs: Slurm's --mem


def test_up_submits_one_job_per_learner_and_they_train(
    slurm_run: tuple[DldctlHome, Path], cluster: SlurmCluster
) -> None:
    dl, inv = slurm_run
    dl("up", str(inv), "-d", timeout=300)
    snap = dl.wait(
        lambda s: (
            s["syncer"]["outer_steps"] >= 3
            and all(learner(s, f"learner-{i}")["state"] == "running" for i in (0, 1))
            and s["loss"]["global"] is not None  # the syncer scores the workdir's model too
        ),
        180,
        "two learners training as Slurm jobs",
    )
    jobs = {j["name"]: j for j in ours(cluster, dl.run_dir)}
    for lid in ("learner-0", "learner-1"):
        job = jobs[f"dldctl-{dl.run_dir.name}-{lid}"]
        assert job["state"] == "RUNNING" and f"target={lid}" in job["comment"]
        assert job_of(snap, lid)["id"] == int(job["id"]) and job_of(snap, lid)["state"] == "RUNNING"
    waiting = learner(snap, "learner-2")
    assert waiting["state"] == "queued" and waiting["job"]["says"] == "PENDING (BeginTime)"
    plain = dl("status").stdout  # the table names the job and why it waits
    assert "PENDING (BeginTime)" in plain and f"{job_of(snap, 'learner-0')['id']} RUNNING" in plain


def test_a_learner_killed_inside_its_job_is_resubmitted(
    slurm_run: tuple[DldctlHome, Path], cluster: SlurmCluster
) -> None:
    dl, _ = slurm_run
    before = job_of(dl.status(), "learner-0")["id"]
    out = json.loads(dl("chaos", "kill", "learner-0", "--force", "--json", timeout=60).stdout)
    assert f"slurm job {before}" in out["detail"]
    snap = dl.wait(
        lambda s: (
            learner(s, "learner-0")["restarts"] == 1
            and learner(s, "learner-0")["state"] == "running"
            and job_of(s, "learner-0").get("state") == "RUNNING"
        ),
        120,
        "learner-0 back in a new job",
    )
    assert job_of(snap, "learner-0")["id"] != before
    assert cluster.job(str(before))["state"] == "FAILED"  # the learner died, so its job did
    deaths = [
        e for e in jsonlread.read(dl.run_dir / "events.jsonl") if e["kind"] == "death" and e["target"] == "learner-0"
    ]
    assert deaths and deaths[-1]["detail"].startswith((f"job {before} ended FAILED", f"job {before} ended COMPLETING"))


def test_a_preempted_job_is_replaced(slurm_run: tuple[DldctlHome, Path], cluster: SlurmCluster) -> None:
    dl, _ = slurm_run
    dl("chaos", "pause", "learner-1", "--duration", "60", "--force", timeout=60)  # SIGSTOP inside the job
    assert learner(dl.status(), "learner-1")["state"] == "paused"
    dl("chaos", "heal", "learner-1", timeout=60)
    dl.wait(lambda s: learner(s, "learner-1")["state"] == "running", 60, "the pause undone inside the job")
    before = job_of(dl.status(), "learner-1")["id"]
    dl("chaos", "preempt", "learner-1", "--force", timeout=60)
    dl.wait(
        lambda s: (
            learner(s, "learner-1")["restarts"] == 1
            and job_of(s, "learner-1").get("id") != before
            and learner(s, "learner-1")["state"] == "running"
        ),
        120,
        "learner-1 back after its job was cancelled",
    )
    assert cluster.job(str(before))["state"] == "CANCELLED"
    t0 = time.time()
    dl.wait_for(
        lambda: any(
            r.get("kind") == "round" and r["t"] > t0 and "learner-1" in r["contributors"]
            for r in jsonlread.read(dl.run_dir / "metrics.jsonl")
        ),
        90,
        "learner-1 merging again",
    )


def test_preempt_refuses_a_learner_that_is_not_a_job(slurm_run: tuple[DldctlHome, Path]) -> None:
    dl, _ = slurm_run
    out = dl("chaos", "preempt", "syncer", check=False, timeout=60)
    assert out.returncode == 2 and "cannot preempt 'syncer'" in out.stderr


def test_learner_add_site_and_logs_of_a_job(slurm_run: tuple[DldctlHome, Path], cluster: SlurmCluster) -> None:
    dl, _ = slurm_run
    dl("learner", "add", "--site", "cluster", "--count", "1", timeout=300)
    snap = dl.wait(
        lambda s: any(r["id"] == "learner-3" and r["state"] == "running" for r in s["learners"]),
        120,
        "learner-3 running as a new job",
    )
    assert learner(snap, "learner-3")["host"] == "cluster" and job_of(snap, "learner-3")["state"] == "RUNNING"
    logs = dl("logs", "learner-0", "--tail", "200")
    assert "dldctl: slurm job" in logs.stdout and "learner-0" in logs.stdout
    assert f"learner-0 is slurm job {job_of(snap, 'learner-0')['id']}: RUNNING" in logs.stderr
    queued = dl("logs", "learner-2", check=False)  # its job never ran: the scheduler says why
    assert queued.returncode == 0 and "PENDING (BeginTime)" in queued.stderr
    bad = dl("learner", "add", "--site", "nope", check=False)
    assert bad.returncode == 2 and "no host named 'nope'" in bad.stderr


def test_down_leaves_nothing_queued(slurm_run: tuple[DldctlHome, Path], cluster: SlurmCluster) -> None:
    dl, _ = slurm_run
    summary = dl.down()
    assert summary["outer_steps"] > 0
    assert active(cluster, dl.run_dir) == []
    assert len(ours(cluster, dl.run_dir)) >= 6  # 3 first jobs, 2 replacements, 1 added: all ended


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"partition": "nope"}, "partition 'nope' does not exist (the cluster has"),
        ({"partition": "gpu", "account": "other"}, "account 'other' may not use partition gpu (it allows proj42)"),
        ({"partition": "gpu", "account": "proj42", "time": "2:00:00"}, "over partition gpu's limit 00:30:00"),
    ],
)
def test_mistakes_are_refused_before_anything_is_submitted(
    cluster: SlurmCluster, tmp_path: Path, extra: dict[str, str], words: str
) -> None:
    inv = tmp_path / "inventory.toml"
    inv.write_text(run_table("bad", quorum=1) + LOOPBACK + site("cluster", cluster, 1, **extra))
    before = len(cluster.jobs())
    with DldctlHome(tmp_path / "home") as dl:
        out = dl("up", str(inv), "-d", check=False, timeout=120)
        assert out.returncode == 2, out.stderr
        (line,) = [ln for ln in out.stderr.splitlines() if ln.strip()]
        assert f"{inv}: [sites.cluster]" in line and words in line
        assert not (dl.home / "runs").exists() or not list((dl.home / "runs").iterdir())
        check = dl("check", str(inv), "--json", check=False, timeout=120)
        slurm = json.loads(check.stdout)["hosts"][0]["checks"]["slurm"]
        assert check.returncode == 1 and not slurm["ok"] and words in slurm["detail"]
    assert len(cluster.jobs()) == before


def test_a_site_behind_a_login_node_over_ssh(cluster: SlurmCluster, ssh_fleet: SSHFleet, tmp_path: Path) -> None:
    login = ssh_fleet.hosts[0]
    inv = tmp_path / "inventory.toml"
    ssh = (
        f'\n[ssh]\nuser = "{login.user}"\nidentity_file = "{login.identity_file}"\n'
        f'known_hosts = "{login.known_hosts}"\nuse_ssh_config = false\n'
    )
    text = run_table("viassh", quorum=1) + ssh
    text += site("remote", cluster, 1, login=login.address, port=login.port, workdir=str(tmp_path / "shared"))
    inv.write_text(text)
    with DldctlHome(tmp_path / "home") as dl:
        dl("up", str(inv), "-d", timeout=300)
        snap = dl.wait(
            lambda s: s["syncer"]["outer_steps"] >= 2 and learner(s, "learner-0")["state"] == "running",
            180,
            "a learner submitted through the SSH login node, training",
        )
        assert job_of(snap, "learner-0")["state"] == "RUNNING" and len(active(cluster, Path(snap_dir(tmp_path)))) == 1
        assert list((tmp_path / "shared" / "site").glob("*/dldctl/__init__.py")), "the login node was not set up"
        dl.down()
        assert active(cluster, Path(snap_dir(tmp_path))) == []


def snap_dir(tmp_path: Path) -> str:
    """The run directory on the login node (its name is the run id: what the jobs are named after)."""
    return str(next((tmp_path / "shared" / "runs").iterdir()))


def test_a_job_slurm_refuses_says_why_in_events_and_logs(cluster: SlurmCluster, tmp_path: Path) -> None:
    """An sbatch option the cluster refuses at submission (no such node): the supervisor records
    sbatch's own error, backs off, and `dldctl logs` says why there is no log."""
    inv = tmp_path / "inventory.toml"
    extra = site("cluster", cluster, 1, sbatch_args=["--nodelist=nosuchnode"])
    inv.write_text(run_table("refused", quorum=1) + LOOPBACK + extra + site("ok", cluster, 1))
    with DldctlHome(tmp_path / "home") as dl:
        dl("up", str(inv), "-d", "--timeout", "3", timeout=120)
        failed = dl.wait_for(
            lambda: [e for e in dl.events("start_failed") if e["target"] == "learner-0"], 60, "a refused submission"
        )
        assert "sbatch refused the job of learner-0" in failed[0]["detail"] and "node" in failed[0]["detail"].lower()
        out = dl("logs", "learner-0", check=False)
        assert out.returncode == 0 and "learner-0 has not started: host cluster: sbatch refused the job" in out.stderr
        dl.down()
        assert active(cluster, dl.run_dir) == []
