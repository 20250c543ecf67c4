"""Run directories: where a run's configuration, keys, state, logs and metrics live.

    $DLDCTL_HOME/runs/<name>-<YYYYmmdd-HHMMSS>/
        inventory.toml   config.json   keys/ (0700)   state.json   state.lock
        events.jsonl     metrics.jsonl  checkpoints/  logs/   learners/<id>/   supervisor.log

`state.json` is shared by the supervisor and short-lived CLI commands: every read-modify-write
holds an flock on `state.lock`, and every write is atomic (temp file + rename), so a crash never
leaves half a state behind. Its schema is dldctl/runstate.py; `read_state` and `write_state` here
are its one load and save (everyone else gets and gives a typed, frozen RunState). `config.json`,
the resolved configuration, is a typed, frozen ResolvedConfig (syncer/common/resolved.py) that
`read_config` and `write_config` load and save. A run is live while its supervisor process is.
Commands without `--run` use the most recent live run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dldctl import inventory
from dldctl.errors import RunError
from dldctl.inventory import Inventory
from dldctl.runstate import RunState
from syncer.common import jsonl, jsonlread, resolved, strictjson
from syncer.common.atomic import atomic_write
from syncer.common.resolved import ResolvedConfig
from syncer.common.settings import RunSettings


def home() -> Path:
    """$DLDCTL_HOME, or ~/.dldctl."""
    return Path(os.environ.get("DLDCTL_HOME", "~/.dldctl")).expanduser()


def runs_root() -> Path:
    return home() / "runs"


class RunDir:
    """Paths and state of one run."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._unsaved: tuple[RunState, tuple[int, int, int] | None] | None = None  # state, file it replaces
        self._unsaved_count = 0
        self._log_cap: int | None = None
        self._config: tuple[tuple[int, int, int] | None, ResolvedConfig] | None = None  # file, its record

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config(self) -> Path:
        """config.json: the resolved configuration (read_config / write_config)."""
        return self.path / "config.json"

    @property
    def inventory(self) -> Path:
        """inventory.toml: the inventory as the operator wrote it (a copy, for people)."""
        return self.path / "inventory.toml"

    @property
    def inventory_json(self) -> Path:
        """inventory.json: the inventory the run lives by (read_inventory / write_inventory)."""
        return self.path / "inventory.json"

    @property
    def state_file(self) -> Path:
        """state.json: the run state (read_state / write_state)."""
        return self.path / "state.json"

    @property
    def lock_file(self) -> Path:
        """state.lock: held around every read-modify-write of the state."""
        return self.path / "state.lock"

    @property
    def events(self) -> Path:
        """events.jsonl: the event log."""
        return self.path / "events.jsonl"

    @property
    def metrics(self) -> Path:
        """metrics.jsonl: the syncer's samples and rounds."""
        return self.path / "metrics.jsonl"

    @property
    def keys(self) -> Path:
        """keys: the run's keys (0700)."""
        return self.path / "keys"

    @property
    def checkpoints(self) -> Path:
        """checkpoints: the syncer's checkpoints."""
        return self.path / "checkpoints"

    @property
    def logs(self) -> Path:
        """logs: every process's output."""
        return self.path / "logs"

    @property
    def learners(self) -> Path:
        """learners: the learners' working directories."""
        return self.path / "learners"

    @property
    def supervisor_log(self) -> Path:
        """supervisor.log: the supervisor's own output."""
        return self.path / "supervisor.log"

    @property
    def final_model(self) -> Path:
        """final_model.pt: the global model the syncer wrote at the end."""
        return self.path / "final_model.pt"

    def log_path(self, target: str) -> Path:
        return self.logs / f"{target}.log"

    def learner_dir(self, learner: str) -> Path:
        return self.learners / learner

    # -- the inventory -----------------------------------------------------------------------
    def read_inventory(self) -> Inventory:
        """inventory.json, typed; RunError (one line naming the file) if it is missing or unreadable,
        ConfigError if what it holds is no inventory."""
        data = _read_json(self.inventory_json, "inventory", "unreadable inventory")
        if not isinstance(data, dict):
            raise RunError(f"{self.inventory_json}: not an inventory (a JSON object)")
        return inventory.parse(data, str(self.inventory))

    def write_inventory(self, inv: Inventory) -> None:
        """Replace inventory.json whole (atomic)."""
        atomic_write(self.inventory_json, strictjson.dumps(inventory.to_dict(inv), indent=1))

    # -- the resolved configuration -----------------------------------------------------------
    def read_config(self) -> ResolvedConfig:
        """config.json, typed; RunError (one line naming the file and what to do) if it is
        missing, of another schema version or malformed. Parsed again only when the file changed."""
        signature = _signature(self.config)
        if self._config is not None and signature is not None and self._config[0] == signature:
            return self._config[1]
        try:
            config = resolved.load(self.config)
        except ValueError as exc:
            raise RunError(str(exc)) from None
        self._config = (signature, config)
        return config

    def write_config(self, config: ResolvedConfig) -> None:
        """Replace config.json whole (atomic)."""
        resolved.save(self.config, config)
        self._config = None

    # -- state -------------------------------------------------------------------------------
    def read_state(self) -> RunState:
        """The state file; RunError (naming the file and what to do) if missing, corrupt, of
        another schema version or malformed (dldctl/runstate.py).
        (This process's own state that it could not write, while nobody else wrote the file.)"""
        if self._unsaved is not None:
            if _signature(self.state_file) == self._unsaved[1]:
                return self._unsaved[0]  # frozen: nobody can change it under us
            self._unsaved, self._unsaved_count = None, 0  # another process wrote it since: it wins
        hint = f"`dldctl down --run {self.name}` still stops every process it can find"
        data = _read_json(self.state_file, "state file", "corrupt state", hint)
        return RunState.from_json(data, self.state_file)

    def write_state(self, state: RunState) -> None:
        """Atomic replace; call while holding `locked()`. Never raises: if the disk is full (or
        failing), this process keeps the state in memory (read_state returns it while nobody else
        wrote the file) and writes it with its next change once it can."""
        state = replace(state, updated=time.time())
        try:
            atomic_write(self.state_file, strictjson.dumps(state.to_json(), indent=1, sort_keys=True))
        except OSError as exc:
            self._keep_unsaved(state, exc)
            return
        if self._unsaved is not None:
            count, self._unsaved, self._unsaved_count = self._unsaved_count, None, 0
            self.event(
                "write_resumed", jsonl.source(), f"writing state.json again: {count} changes were kept in memory"
            )

    def _keep_unsaved(self, state: RunState, exc: OSError) -> None:
        first = self._unsaved is None
        self._unsaved = (state, _signature(self.state_file))
        self._unsaved_count += 1
        if first:
            jsonl.notify(
                "write_dropped",
                f"{jsonl.why(exc)} writing state.json: keeping the state in memory until it can write again",
                self.events,
            )

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive lock for a read-modify-write of the state."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @contextlib.contextmanager
    def update(self) -> Iterator[Edit]:
        """`with run.update() as edit: edit.state = edit.state.with_status("up")` reads under the
        lock, lets you put a new state in its place, writes it back atomically."""
        with self.locked():
            edit = Edit(self.read_state())
            yield edit
            self.write_state(edit.state)

    def event(self, kind: str, target: str, detail: str = "", **fields: object) -> dict[str, Any]:
        """Append to events.jsonl (rotated past the run's max_log_mb; dropped and counted, never
        raised, when the disk is full); `fields` are the event's structured facts, for readers
        (the detail is for people)."""
        record = {"t": time.time(), "kind": kind, "target": target, "detail": detail, **fields}
        jsonl.append(self.events, record, max_bytes=self.log_cap(), notices=self.events)
        return record

    def log_cap(self) -> int:
        """The run's `max_log_mb` in bytes, from config.json (the default until it exists)."""
        if self._log_cap is None:
            try:
                self._log_cap = self.read_config().run.max_log_bytes
            except RunError:
                return RunSettings().max_log_bytes
        return self._log_cap

    def record_proc(self, target: str, host: str, proc: dict[str, int]) -> None:
        """Append to procs.jsonl: every process ever started, so `down` finds them all even
        if state.json is lost (never rotated; a line the disk cannot take is dropped and counted)."""
        jsonl.append(
            self.path / "procs.jsonl",
            {"t": time.time(), "target": target, "host": host, **proc},
            max_bytes=0,
            notices=self.events,
        )

    def started_procs(self) -> list[dict[str, Any]]:
        return list(jsonlread.read(self.path / "procs.jsonl"))

    def crashed(self) -> bool:
        """Meant to be up (state.json says starting or up), but its supervisor is gone."""
        try:
            return self.read_state().status in ("starting", "up") and not self.live()
        except RunError:
            return False

    def live(self) -> bool:
        """Whether the run's supervisor is running (the run is up)."""
        try:
            state = self.read_state()
        except RunError:
            return False
        sup = state.supervisor
        return state.status in ("starting", "up") and sup is not None and proc_alive(sup.pid, sup.start_ticks)


@dataclass
class Edit:
    """The state being changed inside `RunDir.update()`: assign a new one to `state`."""

    state: RunState


def _read_json(path: Path, what: str, bad: str, hint: str | None = None) -> Any:
    """A run file's JSON; RunError naming the file: missing ("no WHAT; this is not a run
    directory"), or unreadable or not JSON (`bad`, with `hint`)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RunError(f"{path}: no {what}; this is not a run directory (or `up` never got far)") from None
    except (OSError, ValueError) as exc:
        raise RunError(f"{path}: {bad} ({exc})", hint=hint) from None


def _signature(path: Path) -> tuple[int, int, int] | None:
    """Which version of a file this is (inode, mtime, size); None if it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def proc_alive(pid: Any, start_ticks: Any) -> bool:
    """Whether `pid` is a live process on this machine that started at `start_ticks` (not a reused pid)."""
    if not isinstance(pid, int):
        return False
    from dldctl.hosts.local import read_stat  # local: the supervisor runs on this machine

    stat = read_stat(pid)
    return stat is not None and stat.state not in "ZX" and (start_ticks is None or stat.start_ticks == start_ticks)


def create(name: str) -> RunDir:
    """A new run directory <name>-<timestamp> (keys/ made 0700)."""
    root = runs_root()
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = root / f"{name}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = root / f"{name}-{stamp}-{n}"
    path.mkdir()
    (path / "keys").mkdir(mode=0o700)
    for sub in ("logs", "learners", "checkpoints"):
        (path / sub).mkdir()
    return RunDir(path)


def is_run_of(dirname: str, name: str) -> bool:
    """Whether a run directory name is `<name>-<YYYYmmdd>-<HHMMSS>[-n]` (so run "exp" is not "exp-2")."""
    return re.fullmatch(re.escape(name) + r"-\d{8}-\d{6}(-\d+)?", dirname) is not None


def all_runs() -> list[RunDir]:
    """Every run directory, newest first."""
    root = runs_root()
    if not root.is_dir():
        return []
    dirs = [RunDir(p) for p in root.iterdir() if p.is_dir() and (p / "state.json").exists()]
    return sorted(dirs, key=lambda r: r.state_file.stat().st_mtime if r.state_file.exists() else 0, reverse=True)


def resolve(run: str | None, *, live_only: bool = True) -> RunDir:
    """The run named `run` (a directory name, a run name, or a path), or the newest live run."""
    if run:
        candidate = Path(run).expanduser()
        if candidate.is_dir() and (candidate / "state.json").exists():
            return RunDir(candidate)
        exact = runs_root() / run
        if exact.is_dir():
            return RunDir(exact)
        named = [r for r in all_runs() if is_run_of(r.name, run)]
        live = [r for r in named if r.live()]
        if live or named:
            return (live or named)[0]
        raise RunError(f"no run named {run!r} under {runs_root()}", hint="`dldctl runs` lists the runs")
    for r in all_runs():
        if r.live():
            return r
    if not live_only:
        runs = all_runs()
        if runs:
            return runs[0]
        raise RunError("no run yet", hint="start one with `dldctl up`")
    crashed = next((r for r in all_runs() if r.crashed()), None)
    if crashed is not None:
        raise RunError(
            f"no live run: {crashed.name} crashed (its supervisor is gone)",
            hint=f"`dldctl up --resume {crashed.name}` continues it from its newest checkpoint",
        )
    raise RunError("no live run", hint="this command needs a run that is up: start one with `dldctl up`")


def find_orphan(name: str) -> RunDir | None:
    """A run of this name that is meant to be up but whose supervisor died (processes may run on)."""
    for r in all_runs():
        if not is_run_of(r.name, name):
            continue
        if r.crashed():
            return r
    return None


def find_live(name: str) -> RunDir | None:
    """The live run with this run name, if any (for `up` to converge instead of starting twice)."""
    for r in all_runs():
        if is_run_of(r.name, name) and r.live():
            return r
    return None
