"""The harness that drives the real `dldctl` CLI in a throw-away home, for tests and benchmarks.

Like `torch.testing`, this is library code for the project's own checks (tests/ and bench/ build
on it), not a part of the operator's commands. It never imports `learner` or torch: driving
dldctl needs neither, and a harness that starts in a fraction of a second keeps tests cheap.

    with DldctlHome(name="smoke") as home:              # DLDCTL_HOME = a new temp dir
        home.up({"model": "gpt-tiny", "H": 8}, [local_host("here", 2)])   # `dldctl up INV -d`
        snap = home.wait(lambda s: s["syncer"]["outer_steps"] >= 3, 120, "three merges")
        home.dl("chaos", "pause", "learner-0", "--duration", "5", "--force")
        home.events("death"), home.metrics("round"), home.config(), home.state()
        summary = home.down()                          # `dldctl down --json`
    # here nothing the home started is running, whatever happened in the block

- `DldctlHome` runs `dldctl ARGS` with its `DLDCTL_HOME` (`dl`, or calling the home itself),
  in the background (`popen`: stopped at the end), brings a run up from a `[run]` table and
  hosts (`up`), reads what the run wrote (`run_dir`, `config`, `state`, `events`, `metrics`,
  `log`) and polls (`wait_for` any check, `wait` on `dldctl status --json`). `close()` (the
  context's exit) always tears down, in order: the background commands (SIGTERM, then SIGKILL),
  `dldctl down` if a run may be up, then a SIGKILL for every process the home's runs recorded in
  `procs.jsonl` that is still alive with its recorded start time (to its process group when it
  leads one; a reused pid is left alone; nothing is ever killed by name). A home the harness made
  is then deleted, unless `keep` (its path is printed then, for a post-mortem).
- `Processes`: named processes a harness started itself, each spawned in its own session,
  signalled by pid or process group and always stopped at the end (tests/localrun.py runs a
  syncer and learners on it without dldctl).
- `wait_until` polls a check until it returns something true, or raises `WaitTimeout` naming
  what it waited for and what `describe()` says about the last try.
- `inventory_text`, `local_host`, `read_jsonl`: what goes into a run and what comes out.

The errors are AssertionErrors, so pytest reports a failure, and the builtin a script catches:

    HarnessError(AssertionError)
     +-- CommandFailed(RuntimeError)    dldctl exited non-zero (`.proc` holds its output)
     +-- WaitTimeout(TimeoutError)      a condition did not hold in time
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar

from dldctl.hosts.local import read_stat
from dldctl.ports import free_port
from dldctl.rundir import RunDir
from syncer.common import jsonl, keys, resolved

if TYPE_CHECKING:
    from dldctl.runstate import RunState
    from syncer.common.resolved import ResolvedConfig

ROOT = Path(__file__).resolve().parents[1]  # the checkout's root: the commands' working directory
DLDCTL = str(Path(sys.executable).parent / "dldctl")  # this interpreter's console script
T = TypeVar("T")


class HarnessError(AssertionError):
    """Something the harness was asked for did not happen (a test failure, to pytest)."""


class CommandFailed(HarnessError, RuntimeError):
    """`dldctl ARGS` exited non-zero; `proc` is the finished command, its output included."""

    def __init__(self, args: tuple[str, ...], proc: subprocess.CompletedProcess[str]) -> None:
        super().__init__(
            f"dldctl {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
        self.proc = proc


class WaitTimeout(HarnessError, TimeoutError):
    """A condition did not hold within its timeout."""


def wait_until(
    check: Callable[[], T | None],
    timeout: float,
    what: str,
    *,
    every: float = 0.5,
    describe: Callable[[], str] | None = None,
) -> T:
    """Call `check` every `every` s until it returns something true, and return that; checked once
    more after the deadline, then `WaitTimeout` saying what was awaited (and `describe()`)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            break
        time.sleep(every)
    detail = ""
    if describe is not None:
        try:
            detail = "\n" + describe()
        except Exception as exc:  # the message must not hide the timeout
            detail = f"\n(describing the last try failed: {exc!r})"
    raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}{detail}")


# --------------------------------------------------------------------------- a run's input and output


def toml_value(value: Any) -> str:
    """One TOML value: str, bool, int, float, a list of those, or a flat dict as an inline table."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def inventory_text(
    run: Mapping[str, Any],
    hosts: list[dict[str, Any]] | None = None,
    syncer: Mapping[str, Any] | None = None,
    tables: Mapping[str, Mapping[str, Any]] | None = None,
) -> str:
    """An inventory: the `[run]` table, a `[syncer]` table if given, other tables (`[ssh]`,
    `[model]`, ...) from `tables`, one `[[hosts]]` table per host."""
    lines = ["[run]"] + [f"{k} = {toml_value(v)}" for k, v in run.items()]
    if syncer:
        lines += ["", "[syncer]"] + [f"{k} = {toml_value(v)}" for k, v in syncer.items()]
    for name, table in (tables or {}).items():
        lines += ["", f"[{name}]"] + [f"{k} = {toml_value(v)}" for k, v in table.items()]
    for host in hosts or []:
        lines += ["", "[[hosts]]"] + [f"{k} = {toml_value(v)}" for k, v in host.items()]
    return "\n".join(lines) + "\n"


def local_host(name: str, learners: int, **extra: Any) -> dict[str, Any]:
    """A `[[hosts]]` entry on this machine: one torch thread per learner unless `extra` says otherwise."""
    return {"name": name, "address": "local", "learners": learners, "threads": 1, **extra}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON record of a file (a torn last line is skipped); [] if it is missing."""
    return list(jsonl.read(path))


def local_config(directory: Path, run: Mapping[str, Any], entries: list[dict[str, Any]], run_id: str) -> Path:
    """What `dldctl up` writes for a run on this machine, without dldctl: `config.json` (the syncer
    on 127.0.0.1, free ports) and, unless `run` is insecure, CURVE keys for the syncer, the operator
    and every learner entry."""
    directory.mkdir(parents=True, exist_ok=True)
    if not run.get("insecure", False):
        for name in ["syncer", "operator", *(e["id"] for e in entries)]:
            keys.create(directory / "keys", name)
    syncer = {"host": "local", "bind_host": "127.0.0.1", "port": free_port(), "control_port": free_port()}
    cfg = {
        "version": 1,
        "run_id": run_id,
        "run": dict(run),
        "syncer": {**syncer, "advertise": "127.0.0.1", "dir": str(directory)},
        "learners": entries,
        "keys": {"dir": "keys"},
    }
    path = directory / "config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


# --------------------------------------------------------------------------- processes, by pid only


def alive(pid: int, start_ticks: int) -> bool:
    """Whether `pid` is running and is still the process that started at `start_ticks`."""
    stat = read_stat(pid)
    return stat is not None and stat.start_ticks == start_ticks and stat.state not in "ZX"


def signal_pid(pid: int, sig: int) -> bool:
    """Send `sig` to the process group `pid` leads, or to `pid` alone if it leads none; False if gone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class Processes(Mapping[str, subprocess.Popen[Any]]):
    """Processes a harness started itself, by name (the latest of a name; all are stopped)."""

    def __init__(self) -> None:
        self._latest: dict[str, subprocess.Popen[Any]] = {}
        self._all: list[subprocess.Popen[Any]] = []

    def __getitem__(self, name: str) -> subprocess.Popen[Any]:
        return self._latest[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._latest)

    def __len__(self) -> int:
        return len(self._latest)

    def add(self, name: str, proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
        """Track `proc` (started elsewhere) under `name`; it is stopped in `stop()`."""
        self._latest[name] = proc
        self._all.append(proc)
        return proc

    def spawn(self, name: str, argv: list[str], *, log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen[Any]:
        """Start `argv` in its own session (a process group to kill), stdout and stderr appended to `log`."""
        with open(log, "ab") as out:  # the child holds its own descriptor
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
        return self.add(name, proc)

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout: float = 30) -> None:
        """Send `sig` to `name`'s process (its group) if it still runs, and wait for it to exit."""
        proc = self._latest[name]
        if proc.poll() is None:
            signal_pid(proc.pid, sig)
        proc.wait(timeout=timeout)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop every process still running: SIGTERM and up to `grace_s` s to exit (if > 0), then SIGKILL."""
        running = [p for p in self._all if p.poll() is None]
        if grace_s > 0:
            for proc in running:
                signal_pid(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(p.poll() is None for p in running):
                time.sleep(0.1)
        for proc in running:
            if proc.poll() is None:
                signal_pid(proc.pid, signal.SIGKILL)
        for proc in running:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


# --------------------------------------------------------------------------- the home


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
