"""`python -m syncer --config RESOLVED.json [--shard N]`: run the syncer (or one shard of it) of
one run until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch

from syncer import checkpoint, config
from syncer.common import jsonl
from syncer.oplog import say, stamp
from syncer.server import SyncerServer


def main(argv: list[str] | None = None, guard_stdio: bool = False) -> int:
    """Parse arguments, serve, exit 0 on a clean stop, 2 on a bad configuration, 1 when it cannot
    start (a port taken; a run whose history was lost and may not start a new global model)."""
    parser = argparse.ArgumentParser(prog="python -m syncer", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="resolved run configuration (JSON)")
    parser.add_argument("--shard", type=int, default=0, help="which shard of a sharded syncer ([syncer] shards)")
    args = parser.parse_args(argv)
    if guard_stdio:  # as a program: a full disk under our log must not kill the syncer (lines dropped, counted)
        jsonl.guard_stdio()
    try:
        cfg = config.load(args.config, args.shard)
    except ValueError as exc:
        print(f"syncer: error: {exc}", file=sys.stderr)
        return 2
    if guard_stdio:
        jsonl.guard_stdio(cfg.settings.max_log_bytes, source="syncer")
    if cfg.neighbours > 1:  # the shards on a host share its cores: torch's threads of each, its share of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.neighbours))
    server = SyncerServer(cfg)

    def stop(signum: int, _frame: object) -> None:
        if not server.stopping.is_set():  # `down` asks first, then signals: the first reason stands
            server.stop_reason = f"signal {signal.Signals(signum).name}"
        server.stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        server.open()
    except (OSError, checkpoint.CheckpointError) as exc:  # e.g. the run's history was lost: refused
        print(f"syncer: error: {exc}", file=sys.stderr)
        server.close()
        return 1
    say([start_line(cfg, server)])
    try:
        server.run()
    finally:
        server.close()
    say([f"{stamp(server.wall())} syncer: stopped ({server.stop_reason})"])
    return 0


def start_line(cfg: config.SyncerConfig, server: SyncerServer) -> str:
    """What an operator needs of a start: where it listens, the fragments, the model, the fleet."""
    s, core = cfg.settings, server.core
    shard = f" shard {cfg.shard} of {cfg.shards}" if cfg.shards > 1 else ""
    model = f"{core.model.numel} parameters" if core.model is not None else "parameters from the first learner"
    frags = f"{s.fragments} fragments"
    if cfg.shards > 1:  # a shard's own part of them (known once the model is: the map needs its sizes)
        frags = f"fragments {list(core.owned)} of {s.fragments}" if core.owned else f"its share of {frags}"
    return (
        f"{stamp(server.wall())} syncer{shard}: serving run {cfg.run_id} on {cfg.bind} (control {cfg.control_bind}), "
        f"epoch {core.epoch}, {frags}, {model}, {len(cfg.learners)} learners declared, "
        f"quorum {s.quorum}, {'INSECURE (no CURVE)' if s.insecure else 'CURVE'}, pid {os.getpid()}"
    )


if __name__ == "__main__":
    sys.exit(main(guard_stdio=True))
