"""What the end-to-end tests share beyond the harness: their inventory and their assertion helpers.

The harness itself (a `dldctl` home, the real commands in it, polling, and a teardown that stops
everything by pid and start time, never by name) is `dldctl.testing.DldctlHome`; this module
adds the tests' small, fast `[run]` table and readers of a `status --json` snapshot.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

from dldctl.testing import DldctlHome, inventory_text
from tests.sshfleet import FleetHost

ROOT = Path(__file__).resolve().parents[2]


def run_table(name: str, **extra: object) -> str:
    """The [run] table of a small, fast test inventory (gpt-tiny; plain averaging, stable at H = 8;
    no warm spares unless asked for: they are extra processes on a 2-core machine)."""
    settings: dict[str, object] = dict(
        name=name,
        model="gpt-tiny",
        seq_len=32,
        batch_size=8,
        H=8,
        outer_lr=1.0,
        outer_momentum=0.0,
        eval_every=20,
        eval_batches=2,
        heartbeat_s=0.25,
        liveness_s=2.0,
        restart_delay_s=1.0,
        warm_spares=False,
    )
    settings.update(extra)
    return inventory_text(settings)


def steps_logged_between(dl: DldctlHome, lid: str, t0: float, t1: float) -> list[int]:
    """The steps a learner logged (every eval_every steps, "HH:MM:SS learner-N: step S ...")
    between two wall-clock times: proof that it trained then, whatever the syncer saw."""
    day = time.strftime("%Y-%m-%d ", time.localtime(t0))
    out = []
    for line in dl("logs", lid, "--tail", "2000").stdout.splitlines():
        m = re.match(r"(\d\d:\d\d:\d\d) (?:\[#\d+[^\]]*\] )?" + re.escape(lid) + r": step (\d+) ", line)
        if m and t0 <= time.mktime(time.strptime(day + m.group(1), "%Y-%m-%d %H:%M:%S")) <= t1 - 1:
            out.append(int(m.group(2)))
    return out


def learner(snap: dict[str, Any], lid: str) -> dict[str, Any]:
    """A learner's row of a status snapshot."""
    return next(r for r in snap["learners"] if r["id"] == lid)


def kinds(snap: dict[str, Any], target: str | None = None) -> list[str]:
    """The kinds of a snapshot's events (of one target)."""
    return [e["kind"] for e in snap["events"] if target is None or e["target"] == target]


def host_entry(name: str, host: FleetHost, workdir: Path, learners: int = 1) -> str:
    """A [[hosts]] entry with `learners` learners on a test sshd host, its files under workdir/<name>."""
    return f"""
[[hosts]]
name = "{name}"
address = "{host.address}"
port = {host.port}
learners = {learners}
python = "{sys.executable}"
workdir = "{workdir / name}"
"""
