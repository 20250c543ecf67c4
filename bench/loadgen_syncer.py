"""One real syncer process (or one shard of a sharded syncer) for bench/loadgen.py, without
dldctl: its configuration, keys, process, status and records.

`write_run` writes what `dldctl up` would (a resolved configuration, JSON, and CURVE keys for the
syncer, the operator and every learner; tests/localrun.py `write_config` does the same for the
integration tests), with `[syncer] shards` and two free ports per shard after the first when
sharded; `SyncerProcess` starts `python -m syncer --config ... [--shard N]` in its own process
group (dldctl.testing.Processes: stopped in close(), whatever happens), asks its control socket for
status with the operator's key, and reads its metrics (shard N > 0: `shard-N/` in the run
directory, syncer/config.py `shard_dir`) and log (`syncer.log`, `syncer-N.log`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import zmq

from dldctl.ports import free_port
from dldctl.testing import Processes, local_config, read_jsonl, wait_until
from syncer.common import keys, resolved
from syncer.config import shard_dir
from syncer.wire.protocol import Message, decode, encode

ROOT = Path(__file__).resolve().parents[1]


def write_run(directory: Path, learners: int, run: dict[str, Any], run_id: str = "loadgen", shards: int = 1) -> Path:
    """A resolved configuration for `learners` learners (learner-0 ...) and a syncer of `shards`
    shards (ports of shards 1.. in `shard_ports`), plus every key it names. The shards share the
    syncer's key pair, as `dldctl up` writes them."""
    entries = [{"id": f"learner-{i}", "shard": i, "shards": learners} for i in range(learners)]
    path = local_config(directory, run, entries, run_id)
    if shards > 1:
        data = json.loads(path.read_text())
        data["syncer"].update(shards=shards, shard_ports=[free_port() for _ in range(2 * (shards - 1))])
        path.write_text(json.dumps(data, indent=1))
    return path


class SyncerDied(RuntimeError):
    """A shard's process ended while the load generator needed it (a crash, the OOM killer)."""


class SyncerProcess:
    """The syncer (shard `shard`) of one load generator run; always close() it."""

    def __init__(self, directory: Path, config: Path, shard: int = 0, env: dict[str, str] | None = None) -> None:
        self.dir = directory
        self.env = dict(env or {})  # added to the process's environment (e.g. OMP_NUM_THREADS)
        self.config = config
        self.cfg = resolved.load(config)
        self.shard = shard
        self.section = self.cfg.syncer.shard(shard)  # its own ports
        self.name = "syncer" if shard == 0 else f"syncer-{shard}"
        self.procs = Processes()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._ctl: zmq.Socket[bytes] | None = None

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.section.port}"

    @property
    def pid(self) -> int:
        return int(self.procs[self.name].pid)

    def start(self) -> None:
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", **self.env)
        argv = [sys.executable, "-m", "syncer", "--config", str(self.config)]
        if self.cfg.syncer.shards > 1:
            argv += ["--shard", str(self.shard)]
        self.procs.spawn(self.name, argv, log=self.dir / f"{self.name}.log", env=env, cwd=ROOT)

    def exited(self) -> str | None:
        """None while the process runs; else how it ended, in words (a SIGKILL nobody here sent
        is most often the kernel's OOM killer)."""
        code = self.procs[self.name].poll()
        if code is None:
            return None
        if code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
            if -code == signal.SIGKILL:
                how += " (the kernel's OOM killer? `dmesg | grep -i oom`; fewer learners or a smaller model)"
        else:
            how = f"exited with status {code}"
        return f"{self.name} (pid {self.procs[self.name].pid}) {how}; its log: {self.dir / f'{self.name}.log'}"

    def check_alive(self) -> None:
        """SyncerDied, with the end of its log, if the process has ended."""
        why = self.exited()
        if why is not None:
            raise SyncerDied(f"{why}\n{self.log()[-2000:]}")

    def wait_up(self, timeout: float) -> None:
        def up() -> bool:
            self.check_alive()
            try:
                return bool(self.status(timeout=2.0))
            except TimeoutError:
                return False

        wait_until(up, timeout, f"{self.name} to answer", every=0.25, describe=lambda: self.log()[-2000:])

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
            sock.connect(f"tcp://127.0.0.1:{self.section.control_port}")
            self._ctl = sock
        return self._ctl

    def metrics(self, kind: str) -> list[dict[str, Any]]:
        """This shard's records of `kind` (its fragments in its local numbering)."""
        path = shard_dir(self.dir, self.shard) / "metrics.jsonl"
        return [r for r in read_jsonl(path) if r.get("kind") == kind]

    def log(self) -> str:
        path = self.dir / f"{self.name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        self.procs.stop()
        if self._ctl is not None:
            self._ctl.close(linger=0)
        self.ctx.term()
