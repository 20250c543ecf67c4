"""A private, real single-node Slurm cluster on this machine, for the tests that drive sbatch.

Its own munged (own key and socket), slurmctld and slurmd, all configured by a generated
`slurm.conf` under `workdir` and listening on free ports on 127.0.0.1. Nothing of a system-wide
Slurm or munge (if a package started one) is used: every client command gets `SLURM_CONF`
pointing at our config, whose `AuthInfo` names our munge socket. `stop()` cancels every job,
then stops the three daemons by the pids in their own pid files, so it never touches anyone
else's processes.

    with SlurmCluster(tmp_path) as cluster:
        job = cluster.run("sbatch", "--parsable", "--wrap", "true").stdout.strip()
        cluster.jobs()  # [{"id": "1", "name": "wrap", "state": "RUNNING", ...}]
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from dldctl.ports import free_port

MUNGED = "/usr/sbin/munged"
SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
CLIENTS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo")
ACTIVE_STATES = frozenset({"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"})
START_TIMEOUT_S = 30.0
# Slurm's default KillWait is 30 s: a job that ignores SIGTERM is SIGKILLed only after that
DRAIN_TIMEOUT_S = 40.0
SEP = "\x1f"  # between squeue's output fields
# inherited settings that would steer our clients elsewhere (a test run inside a real Slurm job
# has SLURM_JOB_ID and friends; SBATCH_PARTITION and the like change what sbatch submits)
FOREIGN_ENV = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_", "SCANCEL_", "SCONTROL_")

CONF_TEMPLATE = """\
ClusterName=dldtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={w}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/slurmd.pid
SlurmctldLogFile={w}/log/slurmctld.log
SlurmdLogFile={w}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=600
SchedulerParameters=sched_interval=2
NodeName={host} NodeAddr=127.0.0.1 CPUs=16 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=01:00:00 State=UP
PartitionName=gpu Nodes=ALL MaxTime=00:30:00 AllowAccounts=proj42 State=UP
"""


def available() -> str | None:
    """None when a cluster can be started here (binaries present, running as root), else why not."""
    missing = [p for p in (MUNGED, SLURMCTLD, SLURMD) if not os.access(p, os.X_OK)]
    missing += [c for c in CLIENTS if shutil.which(c) is None]
    if missing:
        what = ", ".join(missing)
        return f"Slurm test cluster: missing {what} (scripts/test.sh installs slurmctld slurmd slurm-client munge)"
    if os.geteuid() != 0:
        return "Slurm test cluster: needs root (slurmd runs jobs as their submitting user)"
    return None


class SlurmCluster:
    """Start/stop a private munged + slurmctld + slurmd under `workdir`; see the module docstring.

    `extra_conf` lines are appended to slurm.conf (e.g. another `PartitionName=... State=UP`)."""

    def __init__(self, workdir: Path, extra_conf: Sequence[str] = ()) -> None:
        self.workdir = Path(workdir).resolve()
        self.extra_conf = tuple(extra_conf)
        self.conf = self.workdir / "slurm.conf"
        self.env: dict[str, str] = {"SLURM_CONF": str(self.conf)}
        self.hostname = socket.gethostname()
        self.logs = self.workdir / "log"
        # daemon name (as /proc/<pid>/cmdline shows it) -> its pid file, in stop order
        self.pid_files: dict[str, Path] = {
            "slurmd": self.workdir / "slurmd.pid",
            "slurmctld": self.workdir / "slurmctld.pid",
            "munged": self.workdir / "munged.pid",
        }
        self._started = False

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- start ----

    def start(self) -> SlurmCluster:
        """Write the config, start munged, slurmctld and slurmd, wait until the node is idle."""
        reason = available()
        if reason is not None:
            raise RuntimeError(reason)
        for sub in ("state", "spool", "log"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self._started = True  # from here on, stop() has something to clean up
        try:
            self._write_conf()
            self._start_munged()
            self._start_daemon("slurmctld", [SLURMCTLD, "-i"], self.logs / "slurmctld.log")
            self._start_daemon("slurmd", [SLURMD], self.logs / "slurmd.log")
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _write_conf(self) -> None:
        w = str(self.workdir)
        text = CONF_TEMPLATE.format(host=self.hostname, w=w, ctld_port=free_port(), slurmd_port=free_port())
        self.conf.write_text(text + "".join(f"{line}\n" for line in self.extra_conf))

    def _start_munged(self) -> None:
        w = self.workdir
        key = w / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        argv = [
            MUNGED,
            f"--key-file={key}",
            f"--socket={w / 'munge.sock'}",
            f"--pid-file={w / 'munged.pid'}",
            f"--log-file={w / 'munged.log'}",
            f"--seed-file={w / 'munge.seed'}",
            # munged refuses a socket under a directory others cannot search (pytest's
            # /tmp/pytest-of-root is 0700); --force makes that a warning: all our clients are root
            "--force",
        ]
        self._start_daemon("munged", argv, w / "munged.log")

    def _start_daemon(self, name: str, argv: list[str], log: Path) -> None:
        """Run a daemon that forks itself away; wait for its pid file to name a live process."""
        out = self.logs / f"{name}.stdout"
        with open(out, "ab") as sink:
            proc = subprocess.run(
                argv,
                env=self.client_env(),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=START_TIMEOUT_S,
                check=False,
            )
        if proc.returncode != 0:
            raise RuntimeError(f"{name} exited with {proc.returncode}: see {out} and {log}")
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.daemon_pid(name) is not None:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{name} wrote no pid file within {START_TIMEOUT_S:.0f} s: see {log}")

    def _wait_idle(self) -> None:
        """Until sinfo says our node is idle (slurmd registered with slurmctld)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        states = ""
        while time.monotonic() < deadline:
            for name in ("slurmctld", "slurmd"):
                if self.daemon_pid(name) is None:
                    raise RuntimeError(f"{name} died while starting: see {self.logs / (name + '.log')}")
            res = self.run("sinfo", "-h", "-o", "%T", timeout=10)
            states = res.stdout.strip() or res.stderr.strip()
            if res.returncode == 0 and set(states.split()) == {"idle"}:
                return
            time.sleep(0.2)
        raise RuntimeError(
            f"Slurm node not idle within {START_TIMEOUT_S:.0f} s (sinfo: {states!r}): "
            f"see {self.logs / 'slurmctld.log'} and {self.logs / 'slurmd.log'}"
        )

    # ---- clients ----

    def client_env(self) -> dict[str, str]:
        """os.environ without any inherited Slurm settings, plus `env`: for a process that should
        talk to this cluster (every daemon and client command here runs with it)."""
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN_ENV)}
        return {**inherited, **self.env}

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (`run("squeue", "-h")`) against this cluster; never raises
        on a non-zero exit (look at returncode)."""
        return subprocess.run(
            list(args),
            env=self.client_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def jobs(self) -> list[dict[str, str]]:
        """Every job slurmctld still knows (finished ones stay MinJobAge = 600 s): id, name,
        state, reason and comment (squeue's `(null)` for no comment becomes "")."""
        # fields split on ASCII unit separators, not '|': job names and comments are free text
        res = self.run("squeue", "-h", "-t", "all", "-o", SEP.join(("%i", "%j", "%T", "%r", "%k")))
        if res.returncode != 0:
            raise RuntimeError(f"squeue failed ({res.returncode}): {res.stderr.strip()}")
        jobs = []
        for line in res.stdout.splitlines():
            if not line.strip():
                continue
            job_id, name, state, reason, comment = line.split(SEP, 4)
            jobs.append(
                {
                    "id": job_id,
                    "name": name,
                    "state": state,
                    "reason": reason,
                    "comment": "" if comment == "(null)" else comment,
                }
            )
        return jobs

    def job(self, job_id: str) -> dict[str, str] | None:
        """One job of `jobs()` by id, or None when slurmctld no longer knows it."""
        return next((j for j in self.jobs() if j["id"] == str(job_id)), None)

    def active_jobs(self) -> list[dict[str, str]]:
        """The jobs not finished yet (pending, running, configuring, completing, suspended)."""
        return [j for j in self.jobs() if j["state"] in ACTIVE_STATES]

    def wait_state(self, job_id: str, states: Sequence[str], timeout: float = 20) -> dict[str, str]:
        """Until job `job_id` is in one of `states`; its record. Raises on timeout with the last one."""
        deadline = time.monotonic() + timeout
        last: dict[str, str] | None = None
        while time.monotonic() < deadline:
            last = self.job(job_id)
            if last is not None and last["state"] in states:
                return last
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} not in {list(states)} within {timeout} s: {last}")

    def cancel_all(self) -> None:
        """Cancel every job on this cluster (only this one: the command runs with our SLURM_CONF)."""
        self.run("scancel", "--user", "root")

    # ---- stop ----

    def stop(self) -> None:
        """Cancel all jobs, wait (bounded) until none is active, stop slurmd, slurmctld and munged.

        Safe to call twice, and after a start that failed halfway."""
        if not self._started:
            return
        self._started = False
        try:
            if self.daemon_pid("slurmctld") is not None and self.daemon_pid("slurmd") is not None:
                self._drain()
        finally:
            for name in self.pid_files:
                self._stop_daemon(name)

    def _drain(self) -> None:
        """Cancel everything; wait until slurmctld reports no active job (or give up quietly)."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                self.cancel_all()
                if not self.active_jobs():
                    return
            except (RuntimeError, subprocess.TimeoutExpired):
                pass  # a stuck slurmctld: stop it anyway
            time.sleep(0.5)

    def daemon_pids(self) -> dict[str, int]:
        """The live daemons of this cluster: {"slurmd": pid, "slurmctld": pid, "munged": pid}."""
        pids = {name: self.daemon_pid(name) for name in self.pid_files}
        return {name: pid for name, pid in pids.items() if pid is not None}

    def daemon_pid(self, name: str) -> int | None:
        """The pid in `name`'s pid file if that process is alive and really is `name`, else None."""
        try:
            pid = int(self.pid_files[name].read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if alive(pid, name) else None

    def _stop_daemon(self, name: str, timeout: float = 10) -> None:
        """SIGTERM the daemon by its pid file, SIGKILL it if it is still there after `timeout`."""
        pid = self.daemon_pid(name)
        if pid is None:
            return
        _signal(pid, signal.SIGTERM)
        # watch the pid, not the pid file: a daemon may remove its file before it is done
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not alive(pid, name):
                return
            time.sleep(0.05)
        if alive(pid, name):
            _signal(pid, signal.SIGKILL)
            time.sleep(0.1)


def alive(pid: int, name: str) -> bool:
    """Whether `pid` is a live process whose command line names `name` (not a reused pid, not a
    zombie waiting for init to reap it)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return name.encode() in cmdline and state not in "ZX"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
