"""Helpers for end-to-end tests that drive the real `dldctl` console script.

`Dl` runs commands with an isolated DLDCTL_HOME, parses `status --json`, polls until a
condition holds, and `cleanup()` stops whatever a run left behind (by pid and start time from
procs.jsonl, never by name) even when `dldctl down` itself failed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dldctl.hosts.local import read_stat

DLDCTL = str(Path(sys.executable).parent / "dldctl")
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
    return "[run]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())


class Dl:
    """The `dldctl` command with its own home directory."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.env = dict(os.environ, DLDCTL_HOME=str(home), COLUMNS="120", PYTHONUNBUFFERED="1")

    def __call__(
        self, *args: str, timeout: float = 240, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [DLDCTL, *args], env=self.env, capture_output=True, text=True, timeout=timeout, cwd=ROOT, input=input
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"dldctl {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return proc

    def status(self) -> dict[str, Any]:
        return json.loads(self("status", "--json").stdout)

    def wait(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        snap: dict[str, Any] = {}
        while time.monotonic() < deadline:
            snap = self.status()
            if predicate(snap):
                return snap
            time.sleep(0.5)
        raise AssertionError(
            f"timed out ({timeout} s) waiting for {what}; last snapshot:\n"
            + json.dumps({k: snap.get(k) for k in ("syncer", "quorum", "learners", "events")}, indent=1)[-6000:]
        )

    def run_dir(self) -> Path:
        runs = sorted((self.home / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
        return runs[-1]

    def leftovers(self) -> list[dict[str, Any]]:
        """Processes of any run under this home that are still alive (this machine only)."""
        alive = []
        for procs in (self.home / "runs").glob("*/procs.jsonl"):
            for line in procs.read_text().splitlines():
                rec = json.loads(line)
                stat = read_stat(rec["pid"])
                if stat is not None and stat.start_ticks == rec["start_ticks"] and stat.state not in "ZX":
                    alive.append(rec)
        return alive

    def cleanup(self) -> None:
        """Stop everything the runs under this home started, whatever state they are in."""
        if (self.home / "runs").is_dir():
            self("down", timeout=120, check=False)
        for rec in self.leftovers():
            try:
                os.killpg(rec["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def steps_logged_between(dl: Dl, lid: str, t0: float, t1: float) -> list[int]:
    """The steps a learner logged (every eval_every steps, "HH:MM:SS learner-N: step S ...")
    between two wall-clock times: proof that it trained then, whatever the syncer saw."""
    day = time.strftime("%Y-%m-%d ", time.localtime(t0))
    out = []
    for line in dl("logs", lid, "--tail", "2000").stdout.splitlines():
        m = re.match(r"(\d\d:\d\d:\d\d) " + re.escape(lid) + r": step (\d+) ", line)
        if m and t0 <= time.mktime(time.strptime(day + m.group(1), "%Y-%m-%d %H:%M:%S")) <= t1 - 1:
            out.append(int(m.group(2)))
    return out


def learner(snap: dict[str, Any], lid: str) -> dict[str, Any]:
    return next(r for r in snap["learners"] if r["id"] == lid)


def kinds(snap: dict[str, Any], target: str | None = None) -> list[str]:
    return [e["kind"] for e in snap["events"] if target is None or e["target"] == target]
