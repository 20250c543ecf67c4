"""`python -m learner --config RESOLVED.json --id learner-N`: run one learner until stopped.

Under torchrun (WORLD_SIZE > 1) every rank runs this; rank 0 talks to the syncer and the island
keeps the other ranks identical (see learner/island.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

from learner import config
from learner.trainer import Trainer, install_signal_handlers, log


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and train; exit 0 when stopped cleanly, 2 on a bad configuration."""
    parser = argparse.ArgumentParser(prog="python -m learner", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="resolved run configuration (JSON)")
    parser.add_argument("--id", required=True, help="this learner's name, e.g. learner-0")
    parser.add_argument("--workdir", type=Path, default=None, help="where control.json lives (default: next to the config)")
    args = parser.parse_args(argv)
    try:
        cfg = config.load(args.config, args.id, args.workdir)
    except ValueError as exc:
        print(f"learner: error: {exc}", file=sys.stderr)
        return 2
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    island = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from learner.island import Island
        island = Island.from_env(cfg.spec.device)
    incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    trainer = Trainer(cfg, incarnation, island)
    install_signal_handlers(trainer)
    try:
        if island is not None and not island.leader:
            return island.follow(trainer)
        return trainer.run()
    except RuntimeError as exc:
        log(f"learner: error: {exc}")
        return 1
    finally:
        if island is not None:
            island.close()


if __name__ == "__main__":
    sys.exit(main())
