"""`DldctlHome`: one throw-away `DLDCTL_HOME` and the runs in it, driven through the real `dldctl`.

It runs `dldctl ARGS` with its `DLDCTL_HOME` (`dl`, or calling the home itself), in the background
(`popen`: stopped at the end), brings a run up from a `[run]` table and hosts (`up`), reads what
the run wrote (`run_dir`, `config`, `state`, `events`, `metrics`, `log`) and polls (`wait_for` any
check, `wait` on `dldctl status --json`). `close()` (the context's exit) always tears down, in
order: the background commands (SIGTERM, then SIGKILL), `dldctl down` if a run may be up, then a
SIGKILL for every process the home's runs recorded in `procs.jsonl` that is still alive with its
recorded start time (to its process group when it leads one; a reused pid is left alone; nothing is
ever killed by name). A home the harness made is then deleted, unless `keep` (its path is printed
then, for a post-mortem).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar

from dldctl.rundir import RunDir
from dldctl.testing.procs import Processes, alive, signal_pid
from dldctl.testing.runfiles import inventory_text, read_jsonl
from dldctl.testing.waiting import CommandFailed, HarnessError, wait_until
from syncer.common import resolved

if TYPE_CHECKING:
    from dldctl.runstate import RunState
    from syncer.common.resolved import ResolvedConfig

ROOT = Path(__file__).resolve().parents[2]  # the checkout's root: the commands' working directory
DLDCTL = str(Path(sys.executable).parent / "dldctl")  # this interpreter's console script
T = TypeVar("T")


class DldctlHome:
    """One `DLDCTL_HOME` and the runs in it, driven through the real `dldctl` command.

    `home`: the directory (created if missing, never deleted); None makes a temp dir, deleted in
    `close()` unless `keep`. `tmpfs_mb`: mount a tmpfs of that size on it (as root; to fill up).
    `columns`: the width the commands see (`COLUMNS`).
    """

    def __init__(
        self,
        home: Path | None = None,
        *,
        name: str = "dld",
        keep: bool = False,
        tmpfs_mb: int | None = None,
        columns: int = 120,
    ) -> None:
        self.name = name
        self.keep = keep
        self.owned = home is None
        self.home = Path(tempfile.mkdtemp(prefix=f"dld-{name}-")) if home is None else Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.tmpfs = bool(tmpfs_mb) and _mount_tmpfs(self.home, int(tmpfs_mb or 0))
        self.env = dict(os.environ, DLDCTL_HOME=str(self.home), COLUMNS=str(columns), PYTHONUNBUFFERED="1")
        self.background = Processes()
        self.summary: dict[str, Any] | None = None  # what the last `down()` said
        self._run_dir: Path | None = None
        self._may_be_up = True  # until a `down` of every run through this harness succeeds
        self._released = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands ----------------------------------------------------------------------------
    def dl(
        self, *args: str, timeout: float = 240, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run `dldctl ARGS` in this home (stdin: `input`, else nothing); `CommandFailed` if it
        exits non-zero and `check`."""
        if args[:1] == ("up",):
            self._may_be_up = True
        proc = subprocess.run(
            [DLDCTL, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            input=input,
            stdin=subprocess.DEVNULL if input is None else None,
        )
        if args[:1] == ("down",) and proc.returncode == 0 and "--run" not in args:
            self._may_be_up = False
        if check and proc.returncode != 0:
            raise CommandFailed(args, proc)
        return proc

    __call__ = dl

    def popen(self, *args: str, name: str | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `dldctl ARGS` in the background in this home (`kwargs` go to Popen; stdin is
        nothing unless they say otherwise); stopped in `close()` if it still runs then."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen([DLDCTL, *args], env=self.env, cwd=ROOT, **kwargs)
        return self.background.add(name or " ".join(args), proc)

    def up(
        self,
        run: Mapping[str, Any],
        hosts: list[dict[str, Any]] | None,
        timeout: float = 240,
        syncer: Mapping[str, Any] | None = None,
        tables: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Path:
        """`dldctl up INVENTORY -d` from the `[run]` table `run` (named after this home unless it
        says), `hosts`, the `[syncer]` table `syncer` and other `tables` ([ssh], [model]), or the
        built-in default when `hosts` is None; returns the run dir."""
        args = ["up", "-d", "--timeout", str(timeout)]
        if hosts is not None:
            inv = self.home / "inventory.toml"
            inv.write_text(inventory_text({"name": self.name, **run}, hosts, syncer, tables))
            args.insert(1, str(inv))
        self.dl(*args, timeout=timeout + 60)
        self._run_dir = self.latest_run()
        if self._run_dir is None:
            raise HarnessError(f"dldctl up succeeded but {self.home / 'runs'} holds no run")
        return self._run_dir

    def status(self) -> dict[str, Any]:
        """One `dldctl status --json` snapshot."""
        return dict(json.loads(self.dl("status", "--json", timeout=60).stdout))

    def kill(self, target: str, sig: str = "KILL") -> bool:
        """`dldctl chaos kill TARGET --signal SIG --force`; False if it was refused (not running)."""
        return self.dl("chaos", "kill", target, "--signal", sig, "--force", check=False, timeout=60).returncode == 0

    def down(self, timeout: float = 180) -> dict[str, Any]:
        """`dldctl down --json`; its summary (`final_model`: the path of final_model.pt)."""
        self.summary = dict(json.loads(self.dl("down", "--json", timeout=timeout).stdout))
        return self.summary

    # -- what the runs wrote -----------------------------------------------------------------
    @property
    def run_dir(self) -> Path | None:
        """The run `up()` started, else the most recently changed run of the home (None: no run yet)."""
        return self._run_dir if self._run_dir is not None else self.latest_run()

    def latest_run(self) -> Path | None:
        runs = self.home / "runs"
        dirs = (
            sorted((p for p in runs.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime) if runs.is_dir() else []
        )
        return dirs[-1] if dirs else None

    def _run(self) -> Path:
        run = self.run_dir
        if run is None:
            raise HarnessError(f"no run in {self.home} yet (dldctl up first)")
        return run

    def config(self) -> ResolvedConfig:
        """The run's resolved configuration (config.json), typed."""
        return resolved.load(self._run() / "config.json")

    def state(self) -> RunState:
        """The run's state (state.json), typed."""
        return RunDir(self._run()).read_state()

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The run's events (all, or those of `kind`); [] before there is a run."""
        run = self.run_dir
        return [e for e in read_jsonl(run / "events.jsonl") if kind is None or e.get("kind") == kind] if run else []

    def metrics(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The syncer's metric records (all, or those of `kind`: "sample", "round", ...)."""
        run = self.run_dir
        return [r for r in read_jsonl(run / "metrics.jsonl") if kind is None or r.get("kind") == kind] if run else []

    def log(self, target: str) -> str:
        """The text of a process's log in the run dir (learner-N, syncer, ...); "" if there is none."""
        path = self._run() / "logs" / f"{target}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- waiting -----------------------------------------------------------------------------
    def wait_for(self, check: Callable[[], T | None], timeout: float, what: str, every: float = 0.5) -> T:
        """Poll `check` (it calls dldctl only if it wants to) until it returns something true."""
        return wait_until(check, timeout, f"{what} (home {self.home})", every=every)

    def wait(self, predicate: Callable[[dict[str, Any]], Any], timeout: float, what: str) -> dict[str, Any]:
        """Poll `dldctl status --json` until `predicate(snapshot)`; the snapshot, or `WaitTimeout`
        with the last one."""
        last: dict[str, Any] = {}

        def check() -> dict[str, Any] | None:
            last.clear()
            last.update(self.status())
            return last if predicate(last) else None

        def describe() -> str:  # what a wait is usually about last: a CI log keeps the tail
            shown = {"events": (last.get("events") or [])[-6:]}
            shown |= {k: last.get(k) for k in ("syncer", "quorum", "faults", "learners")}
            return "last snapshot:\n" + json.dumps(shown, indent=1)[-6000:]

        return wait_until(check, timeout, what, describe=describe)

    # -- the end -----------------------------------------------------------------------------
    def leftovers(self) -> list[dict[str, Any]]:
        """Processes of any run of this home (procs.jsonl) still alive with their start time (this machine)."""
        return [
            rec
            for procs in sorted((self.home / "runs").glob("*/procs.jsonl"))
            for rec in read_jsonl(procs)
            if alive(int(rec["pid"]), int(rec["start_ticks"]))
        ]

    def live_runs(self) -> list[str]:
        """The runs of this home whose supervisor runs (what dldctl takes for up)."""
        runs = self.home / "runs"
        return sorted(p.name for p in runs.iterdir() if p.is_dir() and RunDir(p).live()) if runs.is_dir() else []

    def close(self) -> list[dict[str, Any]]:
        """Stop everything this home started, whatever state it is in; returns what had to be
        SIGKILLed after `dldctl down`. Every step runs even if one before it failed (the first
        error is raised at the end); safe to call again."""
        killed: list[dict[str, Any]] = []
        steps: list[Callable[[], object]] = [
            lambda: self.background.stop(grace_s=10.0),  # a monkey undoes its faults on SIGTERM
            self._down_if_up,
            lambda: killed.extend(self._kill_leftovers()),
            self._release_home,
        ]
        errors: list[BaseException] = []
        for step in steps:
            try:
                step()
            except BaseException as exc:  # Ctrl-C included: teardown goes on, then it is raised
                errors.append(exc)
        if errors:
            raise errors[0]
        return killed

    def _down_if_up(self) -> None:
        if self._may_be_up and (self.home / "runs").is_dir():
            try:
                self.dl("down", timeout=180, check=False)
            except subprocess.TimeoutExpired:
                pass  # what it left running is killed next
            self._may_be_up = False

    def _kill_leftovers(self) -> list[dict[str, Any]]:
        killed = self.leftovers()
        for rec in killed:
            if alive(int(rec["pid"]), int(rec["start_ticks"])):  # checked again: never a reused pid
                signal_pid(int(rec["pid"]), signal.SIGKILL)
        return killed

    def _release_home(self) -> None:
        if self._released:
            return
        self._released = True
        if self.tmpfs:
            self.tmpfs = False
            if subprocess.run(["umount", str(self.home)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(self.home)], capture_output=True)
        if self.owned and not self.keep:
            shutil.rmtree(self.home, ignore_errors=True)
        elif self.owned:
            print(f"{self.name}: home kept at {self.home}", file=sys.stderr)


def _mount_tmpfs(path: Path, size_mb: int) -> bool:
    """Mount a tmpfs of `size_mb` on `path` (needs root); whether it worked."""
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)]
    return subprocess.run(cmd, capture_output=True).returncode == 0
