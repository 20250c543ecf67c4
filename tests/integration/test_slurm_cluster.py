"""The Slurm test harness itself (tests/slurmcluster.py) against a real munged, slurmctld and slurmd.

A batch job with an srun step runs and completes; a job for a partition its account may not use
stays pending with a reason naming the account; `stop()` cancels a still-running job, leaves no
daemon and no job process behind, and may be called twice.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.slurmcluster import SlurmCluster, alive, available

pytestmark = pytest.mark.timeout(90)


def require_slurm() -> None:
    """Fail where root could have installed Slurm (scripts/test.sh does), skip only for non-root."""
    reason = available()
    if reason is not None:
        if os.geteuid() == 0:
            pytest.fail(reason)
        pytest.skip(reason)


def wait_for_file(path: Path, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.1)
    raise TimeoutError(f"{path} not written within {timeout} s")


def processes_of(cluster: SlurmCluster) -> list[str]:
    """Live processes started under this cluster's config: every daemon, step daemon and job
    process inherits SLURM_CONF from us (zombies have no environ to read, and are gone anyway)."""
    mark = f"SLURM_CONF={cluster.conf}".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(f"{entry} {Path(f'/proc/{entry}/cmdline').read_bytes()!r}")
        except OSError:
            continue
    return found


def submit(cluster: SlurmCluster, *args: str) -> str:
    res = cluster.run("sbatch", "--parsable", "--no-requeue", *args)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().split(";")[0]


def test_jobs_run_pend_and_stop_cleans_up(tmp_path: Path) -> None:
    require_slurm()
    w = tmp_path / "slurm"
    cluster = SlurmCluster(w)
    with cluster:
        done = submit(cluster, "-o", f"{w}/out%j", "--wrap", "srun echo hi")
        assert cluster.wait_state(done, ["COMPLETED", "FAILED", "CANCELLED"])["state"] == "COMPLETED"
        assert (w / f"out{done}").read_text().strip() == "hi"

        pending = submit(cluster, "-p", "gpu", "-A", "other", "-o", "/dev/null", "--wrap", "true")
        sleeper = submit(cluster, "-o", "/dev/null", "--wrap", f"echo $$ > {w}/sleeper.pid; exec sleep 300")
        sleeper_pid = int(wait_for_file(w / "sleeper.pid"))
        time.sleep(2.5)  # a scheduling pass (sched_interval=2) has looked at the pending job
        jobs = {j["id"]: j for j in cluster.jobs()}
        assert jobs[pending]["state"] == "PENDING"
        assert "account" in jobs[pending]["reason"].lower(), jobs[pending]
        assert jobs[sleeper]["state"] == "RUNNING"
        assert {j["id"] for j in cluster.active_jobs()} == {pending, sleeper}
        pids = cluster.daemon_pids()
        assert set(pids) == {"munged", "slurmctld", "slurmd"}
        assert len(processes_of(cluster)) >= 6  # the 3 daemons, slurmscriptd, slurmstepd, sh/sleep

    assert cluster.daemon_pids() == {}
    assert not any(alive(pid, name) for name, pid in pids.items())
    assert not alive(sleeper_pid, "sleep")  # the running job was cancelled, its process is gone
    assert processes_of(cluster) == []  # nor any slurmscriptd, slurmstepd or job process
    cluster.stop()  # idempotent
