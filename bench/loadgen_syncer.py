"""One real syncer process for bench/loadgen.py, without dldctl: its configuration, keys, process,
status and records.

`write_run` writes what `dldctl up` would (a resolved configuration, JSON, and CURVE keys for the
syncer, the operator and every learner; tests/localrun.py `write_config` does the same for the
integration tests); `SyncerProcess` starts `python -m syncer --config ...` in its own process
group (dldctl.testing.Processes: stopped in close(), whatever happens), asks its control socket for
status with the operator's key, and reads its metrics and log.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import zmq

from dldctl.testing import Processes, local_config, read_jsonl, wait_until
from syncer.common import keys, resolved
from syncer.wire.protocol import Message, decode, encode

ROOT = Path(__file__).resolve().parents[1]


def write_run(directory: Path, learners: int, run: dict[str, Any], run_id: str = "loadgen") -> Path:
    """A resolved configuration for `learners` learners (learner-0 ...) plus every key it names."""
    entries = [{"id": f"learner-{i}", "shard": i, "shards": learners} for i in range(learners)]
    return local_config(directory, run, entries, run_id)


class SyncerProcess:
    """The syncer of one load generator run; always close() it."""

    def __init__(self, directory: Path, config: Path) -> None:
        self.dir = directory
        self.config = config
        self.cfg = resolved.load(config)
        self.procs = Processes()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._ctl: zmq.Socket[bytes] | None = None

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.cfg.syncer.port}"

    @property
    def pid(self) -> int:
        return int(self.procs["syncer"].pid)

    def start(self) -> None:
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
        argv = [sys.executable, "-m", "syncer", "--config", str(self.config)]
        self.procs.spawn("syncer", argv, log=self.dir / "syncer.log", env=env, cwd=ROOT)

    def wait_up(self, timeout: float) -> None:
        def up() -> bool:
            if self.procs["syncer"].poll() is not None:
                raise RuntimeError(f"the syncer exited: {self.log()[-2000:]}")
            try:
                return bool(self.status(timeout=2.0))
            except TimeoutError:
                return False

        wait_until(up, timeout, "the syncer to answer", every=0.25, describe=lambda: self.log()[-2000:])

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        """The syncer's status snapshot; TimeoutError if it does not answer in time (busy)."""
        sock = self._control()
        sock.send_multipart(encode(Message("status_req", {})))
        if not sock.poll(int(timeout * 1000)):
            sock.close(linger=0)
            self._ctl = None  # a late answer must not be read as the next request's
            raise TimeoutError("the syncer's control socket did not answer")
        snapshot: dict[str, Any] = decode(sock.recv_multipart())["snapshot"]
        return snapshot

    def _control(self) -> zmq.Socket[bytes]:
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

    def metrics(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in read_jsonl(self.dir / "metrics.jsonl") if r.get("kind") == kind]

    def log(self) -> str:
        path = self.dir / "syncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        self.procs.stop()
        if self._ctl is not None:
            self._ctl.close(linger=0)
        self.ctx.term()
