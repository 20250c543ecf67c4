"""Test harness: a real syncer and real learner processes on 127.0.0.1, without dldctl.

Writes a resolved configuration (the same JSON `dldctl up` writes) and CURVE keys into a temp
dir, starts `python -m syncer` and `python -m learner` as subprocesses in their own process
groups, talks to the syncer's control socket like the operator does, and stops every process it
started (by pid/process group) in `close()`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from syncer.common import jsonl, keys
from syncer.wire.protocol import Message, control, decode, encode

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(
    directory: Path,
    learners: list[dict[str, Any]],
    run: dict[str, Any] | None = None,
    insecure: bool = False,
    run_id: str = "testrun",
) -> Path:
    """A resolved configuration plus keys for the syncer, the operator and every learner."""
    directory.mkdir(parents=True, exist_ok=True)
    # H = 8 keeps tests fast; at so small an H the outer Nesterov momentum (0.9) diverges within a
    # few thousand steps on gpt-tiny, while plain averaging (lr 1, momentum 0) is stable
    settings = {
        "model": "gpt-tiny",
        "seq_len": 32,
        "batch_size": 8,
        "H": 8,
        "fragments": 4,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "eval_every": 20,
        "eval_batches": 2,
        "heartbeat_s": 0.2,
        "liveness_s": 1.5,
        "insecure": insecure,
        "warmup": 5,
    }
    settings.update(run or {})
    entries = []
    for i, extra in enumerate(learners):
        entry = {"id": f"learner-{i}", "shard": i, "shards": len(learners), **extra}
        entries.append(entry)
    if not insecure:
        keydir = directory / "keys"
        for name in ["syncer", "operator", *(e["id"] for e in entries)]:
            keys.create(keydir, name)
    cfg = {
        "version": 1,
        "run_id": run_id,
        "run": settings,
        "syncer": {
            "host": "local",
            "bind_host": "127.0.0.1",
            "port": free_port(),
            "control_port": free_port(),
            "advertise": "127.0.0.1",
            "dir": str(directory),
        },
        "learners": entries,
        "keys": {"dir": "keys"},
    }
    path = directory / "config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


class LocalRun:
    """Processes of one test run; always call close() (use as a context manager)."""

    def __init__(self, directory: Path, config: Path) -> None:
        self.dir = directory
        self.config = config
        self.cfg = json.loads(config.read_text())
        self.procs: dict[str, subprocess.Popen] = {}
        self.ctx = zmq.Context()
        self._ctl: zmq.Socket | None = None

    def __enter__(self) -> LocalRun:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _spawn(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 (the child's stdout; closed at stop)
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))  # keep the caller's
        env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", **(extra_env or {}))
        proc = subprocess.Popen(
            [sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        log.close()
        self.procs[name] = proc
        return proc

    def start_syncer(self, env: dict[str, str] | None = None) -> subprocess.Popen:
        return self._spawn("syncer", ["-m", "syncer", "--config", str(self.config)], env)

    def start_learner(self, i: int, env: dict[str, str] | None = None) -> subprocess.Popen:
        lid = f"learner-{i}"
        tail = ["-m", "learner", "--config", str(self.config), "--id", lid]
        nproc = int(self.cfg["learners"][i].get("nproc", 1))
        if nproc > 1:  # an island: the same command dldctl runs
            return self._spawn(
                lid, ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *tail], env
            )
        return self._spawn(lid, tail, env)

    def wait_log(self, name: str, text: str, timeout: float) -> None:
        """Wait until a process's log contains `text` (e.g. a fault point)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log(name):
                return
            time.sleep(0.05)
        raise AssertionError(f"{name} never logged {text!r}: {self.log(name)[-2000:]}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
        proc.wait(timeout=30)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._ctl is not None:
            self._ctl.close(linger=0)
        self.ctx.term()

    # -- the operator's control socket -------------------------------------------------------
    def _control_socket(self) -> zmq.Socket:
        if self._ctl is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if not self.cfg["run"].get("insecure"):
                keydir = self.dir / "keys"
                sock.curve_publickey, sock.curve_secretkey = keys.load_pair(keydir / "operator.key_secret")
                sock.curve_serverkey = keys.load_public(keydir / "syncer.key")
            sock.connect(f"tcp://127.0.0.1:{self.cfg['syncer']['control_port']}")
            self._ctl = sock
        return self._ctl

    def request(self, msg: Message, timeout: float = 5.0) -> Message:
        sock = self._control_socket()
        sock.send_multipart(encode(msg))
        if not sock.poll(int(timeout * 1000)):
            self._ctl.close(linger=0)
            self._ctl = None
            raise TimeoutError("syncer control socket did not answer")
        return decode(sock.recv_multipart())

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        return self.request(Message("status_req", {}), timeout)["snapshot"]

    def control(self, action: str, **args: Any) -> Message:
        return self.request(control(action, **args))

    def wait_for(self, predicate, timeout: float, what: str, poll: float = 0.25) -> dict[str, Any]:
        """Poll status until predicate(snapshot) is true; raise with the last snapshot if not."""
        deadline = time.monotonic() + timeout
        snap: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                snap = self.status(timeout=2.0)
            except TimeoutError:
                snap = {}
            if snap and predicate(snap):
                return snap
            for name, proc in self.procs.items():
                if name == "syncer" and proc.poll() is not None and not self._expect_dead(name):
                    raise AssertionError(f"syncer exited ({proc.returncode}): {self.log('syncer')[-2000:]}")
            time.sleep(poll)
        raise AssertionError(
            f"timed out waiting for {what}; last snapshot: {json.dumps(snap)[:3000]}\n"
            + "\n".join(f"--- {n}\n{self.log(n)[-1500:]}" for n in self.procs)
        )

    def _expect_dead(self, name: str) -> bool:
        return getattr(self, "expect_dead", set()).__contains__(name)

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self) -> list[dict[str, Any]]:
        return list(jsonl.read(self.dir / "events.jsonl"))

    def metrics(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [r for r in jsonl.read(self.dir / "metrics.jsonl") if kind is None or r.get("kind") == kind]
