"""`python -m syncer --config RESOLVED.json`: run the syncer of one run until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from syncer import checkpoint, config
from syncer.common import jsonl
from syncer.server import SyncerServer


def main(argv: list[str] | None = None, guard_stdio: bool = False) -> int:
    """Parse arguments, serve, exit 0 on a clean stop, 2 on a bad configuration, 1 when it cannot
    start (a port taken; a run whose history was lost and may not start a new global model)."""
    parser = argparse.ArgumentParser(prog="python -m syncer", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="resolved run configuration (JSON)")
    args = parser.parse_args(argv)
    if guard_stdio:  # as a program: a full disk under our log must not kill the syncer (lines dropped, counted)
        jsonl.guard_stdio()
    try:
        cfg = config.load(args.config)
    except ValueError as exc:
        print(f"syncer: error: {exc}", file=sys.stderr)
        return 2
    if guard_stdio:
        jsonl.guard_stdio(cfg.settings.max_log_bytes, source="syncer")
    server = SyncerServer(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stopping.set())
    try:
        server.open()
    except (OSError, checkpoint.CheckpointError) as exc:  # e.g. the run's history was lost: refused
        print(f"syncer: error: {exc}", file=sys.stderr)
        server.close()
        return 1
    print(
        f"syncer: serving run {cfg.run_id} on {cfg.bind} (control {cfg.control_bind}), epoch {server.core.epoch}",
        flush=True,
    )
    try:
        server.run()
    finally:
        server.close()
    print("syncer: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(guard_stdio=True))
