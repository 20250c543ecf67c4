"""`python -m syncer --config RESOLVED.json`: run the syncer of one run until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from syncer import config
from syncer.server import SyncerServer


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, serve, exit 0 on a clean stop, 2 on a bad configuration."""
    parser = argparse.ArgumentParser(prog="python -m syncer", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="resolved run configuration (JSON)")
    args = parser.parse_args(argv)
    try:
        cfg = config.load(args.config)
    except ValueError as exc:
        print(f"syncer: error: {exc}", file=sys.stderr)
        return 2
    server = SyncerServer(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stopping.set())
    try:
        server.open()
    except OSError as exc:
        print(f"syncer: error: {exc}", file=sys.stderr)
        server.close()
        return 1
    print(f"syncer: serving run {cfg.run_id} on {cfg.bind} (control {cfg.control_bind}), epoch {server.core.epoch}", flush=True)
    try:
        server.run()
    finally:
        server.close()
    print("syncer: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
