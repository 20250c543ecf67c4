"""The processes of one torchft DiLoCo run (`bench/torchft_diloco.py`): torchft's Lighthouse and
one `bench/torchft_worker.py` per replica group, each in its own session, all on 127.0.0.1.

`Job` starts them, SIGKILLs a group's worker and restarts it after a delay, restarts a worker that
exited on its own, and `close()` stops every process it started (workers, then the Lighthouse);
`LIGHTHOUSE_OPTS` are the Lighthouse's flags (shorter timeouts than torchft's: on one host a dead
replica is noticed fast).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dldctl.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "bench" / "torchft_worker.py"
HOST = "127.0.0.1"
LIGHTHOUSE_OPTS = {"min_replicas": 1, "join_timeout_ms": 2000, "heartbeat_timeout_ms": 2000, "quorum_tick_ms": 50}


class Proc:
    """A process this benchmark started, in its own session (process group = its pid)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "ab") as fh:
            self.popen = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL its process group (only while the leader is unreaped: its pid cannot be reused)."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=30)


def lighthouse_bin() -> str:
    exe = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) or shutil.which(
        "torchft_lighthouse"
    )
    if exe is None:
        raise RuntimeError("torchft_lighthouse not found: pip install torchft==0.2.0 into this environment")
    return exe


def start_lighthouse(out_dir: Path, env: dict[str, str]) -> tuple[Proc, str]:
    """torchft's Lighthouse on 127.0.0.1; (process, address) once it accepts connections."""
    port = free_port(HOST)
    opts = [f"--{k}={v}" for k, v in LIGHTHOUSE_OPTS.items()]
    proc = Proc([lighthouse_bin(), f"--bind={HOST}:{port}", *opts], env, out_dir / "lighthouse.log")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and proc.alive():
        try:
            socket.create_connection((HOST, port), timeout=0.5).close()
            return proc, f"http://{HOST}:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the lighthouse did not come up: {tail(out_dir / 'lighthouse.log')}")


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def worker_env(lighthouse: str) -> dict[str, str]:
    env = dict(
        os.environ, TORCHFT_LIGHTHOUSE=lighthouse, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TORCHFT_USE_OTEL="false"
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's sockets on the loopback interface
    return env


class Job:
    """The lighthouse and the replica groups of one run; `close()` stops every one of them."""

    def __init__(self, out_dir: Path, config: Path, replicas: int) -> None:
        self.out_dir, self.config, self.replicas = out_dir, config, replicas
        self.env = worker_env("")
        self.lighthouse: Proc | None = None
        self.workers: dict[int, Proc] = {}
        self.incarnation = dict.fromkeys(range(replicas), -1)
        self.restart_at: dict[int, float] = {}
        self.retired: list[Proc] = []

    def start(self) -> None:
        self.lighthouse, address = start_lighthouse(self.out_dir, self.env)
        self.env = worker_env(address)
        for g in range(self.replicas):
            self.spawn(g)

    def spawn(self, g: int) -> None:
        self.incarnation[g] += 1
        inc = self.incarnation[g]
        out = self.out_dir / f"replica-{g}"
        out.mkdir(parents=True, exist_ok=True)
        env = dict(self.env, REPLICA_GROUP_ID=str(g), TORCHFT_INCARNATION=str(inc))
        cmd = [sys.executable, str(WORKER), "--config", str(self.config), "--out", str(out)]
        self.workers[g] = Proc(cmd, env, out / f"worker-{inc}.log")

    def kill(self, g: int, delay_s: float) -> dict[str, Any] | None:
        """SIGKILL group g's worker and schedule its restart; None if it is not running now."""
        proc = self.workers.get(g)
        if proc is None or not proc.alive():
            return None
        proc.kill()
        self.retired.append(self.workers.pop(g))
        now = time.time()
        self.restart_at[g] = now + delay_s
        return {"time": now, "victim": g, "pid": proc.pid, "incarnation": self.incarnation[g]}

    def tend(self, delay_s: float) -> int:
        """Restart what is due; schedule a restart for a worker that exited on its own. Returns
        how many such unexpected exits it found."""
        crashed = 0
        for g, proc in list(self.workers.items()):
            if not proc.alive():
                crashed += 1
                self.retired.append(self.workers.pop(g))
                self.restart_at[g] = time.time() + delay_s
        for g, at in list(self.restart_at.items()):
            if time.time() >= at:
                del self.restart_at[g]
                self.spawn(g)
        return crashed

    def close(self) -> list[int]:
        """SIGKILL every process group still running (workers, then the lighthouse); the pids of
        any process that survived (none expected)."""
        procs = [*self.workers.values(), *self.retired] + ([self.lighthouse] if self.lighthouse else [])
        for proc in procs:
            proc.kill()
        return [p.pid for p in procs if p.alive()]
