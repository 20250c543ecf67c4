"""`python -m learner --config RESOLVED.json --id learner-N`: run one learner until stopped.
(`--spare FILE` instead of `--id`: a warm spare that becomes the learner FILE names, see spare.py.)

Under torchrun (WORLD_SIZE > 1) every rank runs this; rank 0 talks to the syncer and the island
keeps the other ranks identical (see learner/island.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import uuid
from pathlib import Path

import learner
from learner import config, logline, spare
from learner.logline import log
from learner.trainer import Trainer, install_signal_handlers
from syncer.common import jsonl


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and train; exit 0 when stopped cleanly, 2 on a bad configuration."""
    parser = argparse.ArgumentParser(prog="python -m learner", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="resolved run configuration (JSON)")
    parser.add_argument("--id", help="this learner's name, e.g. learner-0")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where control.json lives (default: next to the config)"
    )
    parser.add_argument(
        "--spare",
        type=Path,
        default=None,
        metavar="ASSIGNMENT",
        help="start as a warm spare: wait for this file to say which learner to become",
    )
    args = parser.parse_args(argv)
    jsonl.guard_stdio()  # a full disk under our log must not kill training: lines are dropped and counted
    if args.spare is not None:
        spare.warm_up()
        log(f"spare pid {os.getpid()} ready; waiting for {args.spare}")
        data = spare.wait_for_assignment(args.spare)
        spare.become(data)
        learner.STARTED = time.monotonic()  # its time to the first step counts from here
        logline.configure(str(data["id"]))
        log(f"taking over from a warm spare (pid {os.getpid()})")
        args.id, args.workdir = data["id"], Path(data["workdir"])
    elif not args.id:
        parser.error("--id is required (or --spare)")
    try:
        cfg = config.load(args.config, args.id, args.workdir)
    except ValueError as exc:
        print(f"learner: error: {exc}", file=sys.stderr)
        return 2
    jsonl.guard_stdio(cfg.settings.max_log_bytes, source=cfg.spec.id)
    logline.configure(cfg.spec.id)  # each line: "HH:MM:SS [#incarnation] learner-N: ..."
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    island = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from learner.island import Island

        island = Island.from_env(cfg.spec.device, cfg.spec.island)
    incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    trainer = Trainer(cfg, incarnation, island)
    install_signal_handlers(trainer)
    try:
        if island is not None and not island.leader:
            return island.follow(trainer)
        return trainer.run()
    except RuntimeError as exc:
        log(f"error: {exc}")
        return 1
    except Exception as exc:  # a bug: its log ends with the cause (the supervisor's death event quotes it)
        log(traceback.format_exc().rstrip())
        log(f"error: {type(exc).__name__}: {exc}")
        sys.stdout.flush()
        os._exit(1)  # nothing after: a teardown of live threads printed "terminate called ..." over the cause
    finally:
        if island is not None:
            trainer.release()  # no model may outlive the process group (an FSDP mesh aborted exits)
            island.close()


if __name__ == "__main__":
    sys.exit(main())
