"""The operator's client for the syncer's control socket (status snapshots, checkpoint, shutdown).

CURVE with the run's operator key (the only key that socket admits). Every request has a
deadline; a syncer that does not answer is a SyncerError, never a hang.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq

from dldctl import shards
from dldctl.errors import SyncerError
from syncer.common import keys
from syncer.common.resolved import ResolvedConfig
from syncer.wire.protocol import Message, ProtocolError, control, decode, encode


class SyncerControl:
    """One DEALER socket to a run's syncer; use as a context manager."""

    def __init__(self, address: str, keys_dir: Path | None, name: str = "syncer") -> None:
        self.address = address
        self.name = name  # its process (`syncer`, a shard's `syncer-N`): where `dldctl logs` looks
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys_dir is not None:
            try:
                self.sock.curve_publickey, self.sock.curve_secretkey = keys.load_pair(keys_dir / "operator.key_secret")
                self.sock.curve_serverkey = keys.load_public(keys_dir / "syncer.key")
            except (OSError, ValueError) as exc:
                self.close()
                raise SyncerError(f"cannot load the operator key from {keys_dir}: {exc}") from exc
        self.sock.connect(address)

    @classmethod
    def for_run(cls, config: ResolvedConfig, run_path: Path, shard: int = 0) -> SyncerControl:
        """The control client of a run's syncer (of shard `shard` of a sharded one; the operator's
        copy of the config is in `run_path`). Every shard admits the operator's key alike."""
        return cls(config.syncer.shard(shard).control, config.keys_dir(run_path), shards.proc_name(shard))

    def __enter__(self) -> SyncerControl:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def request(self, msg: Message, timeout: float = 3.0) -> Message:
        self.sock.send_multipart(encode(msg))
        if not self.sock.poll(int(timeout * 1000)):
            raise SyncerError(
                f"the syncer at {self.address} did not answer within {timeout:g} s",
                hint=f"`dldctl logs {self.name}` shows why; the supervisor restarts a dead syncer",
            )
        try:
            return decode(self.sock.recv_multipart())
        except ProtocolError as exc:
            raise SyncerError(f"the syncer at {self.address} sent a malformed reply: {exc}") from exc

    def status(self, timeout: float = 3.0) -> dict[str, Any]:
        return self.request(Message("status_req", {}), timeout)["snapshot"]

    def control(self, action: str, timeout: float = 10.0, **args: Any) -> str:
        reply = self.request(control(action, **args), timeout)
        if not reply["ok"]:
            raise SyncerError(f"the syncer refused {action!r}: {reply['detail']}")
        return str(reply["detail"])


def tell_every_shard(
    config: ResolvedConfig, run_path: Path, action: str, timeout: float, **args: Any
) -> dict[int, SyncerError | None]:
    """The control `action` sent to every shard of the run's syncer, one after the other (each
    within `timeout`); shard -> None (done) or the SyncerError of a shard that did not take it."""
    out: dict[int, SyncerError | None] = {}
    for shard in range(config.syncer.shards):
        try:
            with SyncerControl.for_run(config, run_path, shard) as ctl:
                ctl.control(action, timeout=timeout, **args)
            out[shard] = None
        except SyncerError as exc:
            out[shard] = exc
    return out
