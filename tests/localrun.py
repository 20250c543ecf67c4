"""A real syncer and real learner processes on 127.0.0.1, without dldctl (integration tests).

Writes a resolved configuration (the same JSON `dldctl up` writes) and CURVE keys into a temp
dir, starts `python -m syncer` and `python -m learner` as subprocesses in their own process
groups, and talks to the syncer's control socket like the operator does. What it shares with
every harness is the project's (`dldctl.testing`): the processes it started (`Processes`: by
pid and process group, all stopped in `close()`), polling with a timeout (`wait_until`) and
the JSON-lines readers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from dldctl.testing import Processes, local_config, read_jsonl, wait_until
from syncer.common import keys, resolved
from syncer.wire.protocol import Message, control, decode, encode

ROOT = Path(__file__).resolve().parents[1]


def write_config(
    directory: Path,
    learners: list[dict[str, Any]],
    run: dict[str, Any] | None = None,
    insecure: bool = False,
    run_id: str = "testrun",
) -> Path:
    """A resolved configuration plus keys for the syncer, the operator and every learner."""
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
    entries = [{"id": f"learner-{i}", "shard": i, "shards": len(learners), **extra} for i, extra in enumerate(learners)]
    return local_config(directory, settings, entries, run_id)


def user_module(directory: Path, name: str, source: str) -> Path:
    """A user's model code, `name`.py, in DIRECTORY/usercode; returns that folder (a test puts it
    on PYTHONPATH for the processes that may import it)."""
    code = directory / "usercode"
    code.mkdir(exist_ok=True)
    (code / f"{name}.py").write_text(source)
    return code


class LocalRun:
    """Processes of one test run; always call close() (use as a context manager)."""

    def __init__(self, directory: Path, config: Path) -> None:
        self.dir = directory
        self.config = config
        self.cfg = resolved.load(config)
        self.procs = Processes()
        self.expect_dead: set[str] = set()  # processes whose exit `wait_for` does not report
        self.ctx = zmq.Context()
        self._ctl: zmq.Socket | None = None

    def __enter__(self) -> LocalRun:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def spawn(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        """`python ARGV` in its own process group, its output in DIR/NAME.log."""
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))  # keep the caller's
        env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", **(extra_env or {}))
        return self.procs.spawn(name, [sys.executable, *argv], log=self.dir / f"{name}.log", env=env, cwd=ROOT)

    def start_syncer(self, env: dict[str, str] | None = None) -> subprocess.Popen:
        return self.spawn("syncer", ["-m", "syncer", "--config", str(self.config)], env)

    def start_learner(self, i: int, env: dict[str, str] | None = None) -> subprocess.Popen:
        lid = f"learner-{i}"
        tail = ["-m", "learner", "--config", str(self.config), "--id", lid]
        nproc = self.cfg.learners[i].nproc
        if nproc > 1:  # an island: the same command dldctl runs
            return self.spawn(
                lid, ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *tail], env
            )
        return self.spawn(lid, tail, env)

    def wait_log(self, name: str, text: str, timeout: float) -> None:
        """Wait until a process's log contains `text` (e.g. a fault point)."""
        wait_until(
            lambda: text in self.log(name),
            timeout,
            f"{name} to log {text!r}",
            every=0.05,
            describe=lambda: self.log(name)[-2000:],
        )

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to a process's group and wait for it to exit."""
        self.procs.kill(name, sig)

    def close(self) -> None:
        self.procs.stop()
        if self._ctl is not None:
            self._ctl.close(linger=0)
        self.ctx.term()

    # -- the operator's control socket -------------------------------------------------------
    def _control_socket(self) -> zmq.Socket:
        if self._ctl is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if not self.cfg.run.insecure:
                keydir = self.dir / "keys"
                sock.curve_publickey, sock.curve_secretkey = keys.load_pair(keydir / "operator.key_secret")
                sock.curve_serverkey = keys.load_public(keydir / "syncer.key")
            sock.connect(f"tcp://127.0.0.1:{self.cfg.syncer.control_port}")
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

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], Any], timeout: float, what: str, poll: float = 0.25
    ) -> dict[str, Any]:
        """Poll status until predicate(snapshot) is true; raise with the last snapshot if not (at
        once if the syncer exited and is not in `expect_dead`)."""
        last: dict[str, Any] = {}

        def check() -> dict[str, Any] | None:
            try:
                snap = self.status(timeout=2.0)
            except TimeoutError:
                snap = {}
            last.clear()
            last.update(snap)
            if snap and predicate(snap):
                return snap
            syncer = self.procs.get("syncer")
            if syncer is not None and syncer.poll() is not None and "syncer" not in self.expect_dead:
                raise AssertionError(f"syncer exited ({syncer.returncode}): {self.log('syncer')[-2000:]}")
            return None

        def describe() -> str:
            logs = "\n".join(f"--- {n}\n{self.log(n)[-1500:]}" for n in self.procs)
            return f"last snapshot: {json.dumps(last)[:3000]}\n{logs}"

        return wait_until(check, timeout, what, every=poll, describe=describe)

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.dir / "events.jsonl")

    def metrics(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [r for r in read_jsonl(self.dir / "metrics.jsonl") if kind is None or r.get("kind") == kind]
