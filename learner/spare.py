"""A warm spare: a learner process started ahead of need, waiting to become whichever learner of
its host dies next.

Most of a restart is not the learner's work: a fresh process spends seconds importing torch and,
when it builds its first optimizer, torch._dynamo (torch.optim imports it lazily). A spare does
all that while the fleet is healthy, then waits for the supervisor to write its assignment,
`{"id", "workdir", "log", "restarts"}`, to a file (renamed into place, so it is never read half
written). It then takes over that learner's log and runs as that learner: it joins by fetching
the global state like any restarted learner.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

POLL_S = 0.05


def warm_up() -> None:
    """Do once now what a fresh learner would do first: the optimizer's lazy imports."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(2)
    opt.step()


def wait_for_assignment(path: Path, poll_s: float = POLL_S) -> dict[str, Any]:
    """Block until the supervisor's assignment appears at `path`; consume and return it."""
    while True:
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            time.sleep(poll_s)
            continue
        path.unlink(missing_ok=True)
        if isinstance(data, dict) and isinstance(data.get("id"), str):
            return data
        time.sleep(poll_s)  # not an assignment: wait for a proper one


def become(data: dict[str, Any]) -> None:
    """Take over the assigned learner's log (stdout and stderr) and restart count."""
    fd = os.open(data["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ["DLDCTL_RESTARTS"] = str(int(data.get("restarts", 0)))
