"""The `Host` interface that `dldctl up/down/chaos` use to run things on a machine.

Shaped like `Popen` (and jupyter_client's provisioners): run a command line, copy files, start a
detached process and later signal it by its `ProcRef`. Two implementations: `LocalHost`
(subprocess, /proc) and `SSHHost` (paramiko). The pieces both share live here: the detached
launcher script, the /proc/<pid>/stat parser, and `tail`/`follow`, which need only `size` and
`read_bytes` from an implementation.

Why a `ProcRef` carries the start time: pids are reused. A learner that died an hour ago may have
left its pid to some unrelated process; signalling that pid would kill the wrong thing. Field 22
of /proc/<pid>/stat (start time in clock ticks since boot) never changes for a process (not even
across exec), so (pid, start_ticks) names exactly one process for the machine's uptime.
"""

from __future__ import annotations

import re
import shlex
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from dldctl.errors import DldError, HostError, UsageError
from dldctl.hosts.slurmjobs import JobInfo


@dataclass(frozen=True)
class CommandResult:
    """What a finished command left behind (output decoded as UTF-8, errors replaced)."""

    status: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class ProcRef:
    """One process on one host: its pid plus its start time, which guards against pid reuse."""

    pid: int
    start_ticks: int


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/<pid>/stat that we use."""

    pid: int
    state: str
    start_ticks: int


# The started process prints this marker and its own /proc/self/stat line before it execs, so
# the launcher learns pid and start time without a pid file or a second round trip.
STARTED_MARKER = "dldctl-started "

# Runs inside the detached child: `$0` is the log file, `"$@"` the argv. The redirections apply
# to the exec'd program, which closes the inherited stdout (so the launching channel sees EOF).
# The detached child: writes its pid next to its log (LOG.pid, for whoever is on that host), tells
# the launcher its stat line (pid and start time: how dldctl knows it later), then becomes the program.
_CHILD = 'echo $$ > "$0.pid"; read -r s < /proc/$$/stat; echo "dldctl-started $s"; exec "$@" >> "$0" 2>&1'

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def launcher_script(argv: list[str], cwd: str, log: str) -> str:
    """A POSIX sh script that starts `argv` detached (pid file `log`.pid) and prints its stat line.

    `setsid -f` forks and calls setsid(2) in the child: the program gets its own session and
    process group (pgid == pid), is reparented away from us (no zombie for the caller to reap),
    and no SIGHUP reaches it when an SSH session closes. `setsid -f` rather than `setsid ... &`:
    a non-interactive shell starts background jobs with SIGINT/SIGQUIT ignored, and ignored
    signals survive exec, so the learner could not be interrupted.
    """
    if not argv:
        raise UsageError("cannot start an empty command")
    q_log, q_cwd, q_prog = shlex.quote(log), shlex.quote(cwd), shlex.quote(argv[0])
    args = " ".join(shlex.quote(a) for a in argv)
    return (
        f'mkdir -p -- "$(dirname -- {q_log})" || exit 96\n'
        f"cd -- {q_cwd} || exit 97\n"
        f"command -v -- {q_prog} > /dev/null || "
        f"{{ echo 'dldctl: command not found: '{q_prog} >&2; exit 98; }}\n"
        f"exec setsid -f sh -c {shlex.quote(_CHILD)} {q_log} {args} < /dev/null 2>> {q_log}\n"
    )


def env_exports(env: dict[str, str]) -> str:
    """`export K='v'` lines for a shell (keys validated so nothing can be injected through them)."""
    for key in env:
        if not _ENV_KEY.match(key):
            raise UsageError(f"invalid environment variable name {key!r}")
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def parse_stat(line: str) -> ProcStat | None:
    """Parse one /proc/<pid>/stat line; None if it is not one.

    The command name (field 2) is in parentheses and may itself contain spaces and ')', so
    split at the last ')'. After it come state (field 3) ... starttime (field 22).
    """
    head, sep, rest = line.rpartition(")")
    pid_text = head.split(" (", 1)[0].strip()
    fields = rest.split()
    if not sep or not pid_text.isdigit() or len(fields) < 20 or not fields[19].isdigit():
        return None
    return ProcStat(int(pid_text), fields[0], int(fields[19]))


def is_live(stat: ProcStat | None, ref: ProcRef) -> bool:
    """True if `stat` is `ref`'s process and it has not exited (zombie 'Z' / dead 'X' = gone)."""
    return stat is not None and stat.start_ticks == ref.start_ticks and stat.state not in "ZX"


def parse_started(host: str, argv: list[str], result: CommandResult) -> ProcRef:
    """The `ProcRef` announced by the launcher, or a HostError saying why nothing started."""
    for line in result.stdout.splitlines():
        if line.startswith(STARTED_MARKER):
            stat = parse_stat(line[len(STARTED_MARKER) :])
            if stat is not None:
                return ProcRef(stat.pid, stat.start_ticks)
    why = output_tail(result) or f"exit status {result.status}"
    raise HostError(host, f"could not start `{shlex.join(argv)}`: {why.strip()}")


def parse_oom_kills(vmstat: bytes) -> int | None:
    """The `oom_kill` counter of a /proc/vmstat text (Linux 4.13 and newer); None without one."""
    for line in vmstat.decode("ascii", "replace").splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def output_tail(result: CommandResult, lines: int = 20) -> str:
    """The last lines of stderr (or of stdout when stderr is empty), for error messages."""
    text = result.stderr if result.stderr.strip() else result.stdout
    return "\n".join(text.splitlines()[-lines:])


def expand_home(path: str, home: Callable[[], str]) -> str:
    """Expand a leading `~` (only the caller's own home; `~user` is left alone)."""
    if path == "~":
        return home()
    if path.startswith("~/"):
        return home().rstrip("/") + path[1:]
    return path


def _decode(lines: list[bytes]) -> Iterator[str]:
    return (line.decode("utf-8", "replace") for line in lines)


class Host(ABC):
    """One machine we can run commands on and start detached processes on (or, where `scheduler`
    is set, a cluster whose scheduler runs them as jobs: dldctl/hosts/slurm.py)."""

    name: str
    scheduler = ""  # "" for a machine; "slurm" for a site whose processes are batch jobs

    @abstractmethod
    def run(
        self,
        command: str,
        *,
        timeout: float = 60.0,
        input: bytes | None = None,
        check: bool = True,
        env: dict[str, str] | None = None,
    ) -> CommandResult:
        """Run a shell command line; raise RemoteCommandError on non-zero status if `check`."""

    @abstractmethod
    def put_file(self, local: Path, remote: str, mode: int = 0o644) -> None:
        """Copy a local file to `remote` (parents created), atomically."""

    @abstractmethod
    def put_bytes(self, data: bytes, remote: str, mode: int = 0o600) -> None:
        """Write `data` to `remote` atomically; never readable by others before `mode` is set."""

    @abstractmethod
    def get_file(self, remote: str, local: Path) -> None:
        """Copy `remote` to a local path (parents created)."""

    @abstractmethod
    def read_bytes(self, remote: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        """Up to `limit` bytes of `remote` from `offset` (b'' past the end)."""

    @abstractmethod
    def size(self, remote: str) -> int | None:
        """The size of `remote` in bytes, or None if it does not exist."""

    @abstractmethod
    def exists(self, remote: str) -> bool:
        """Whether `remote` exists."""

    @abstractmethod
    def mkdir(self, remote: str, mode: int = 0o755) -> None:
        """Create a directory and its parents (no error if it exists)."""

    @abstractmethod
    def home(self) -> str:
        """The absolute home directory of the user we act as."""

    @abstractmethod
    def start(self, argv: list[str], *, cwd: str, log: str, env: dict[str, str] | None = None) -> ProcRef:
        """Start `argv` detached (own session, stdin /dev/null, output appended to `log`)."""

    @abstractmethod
    def signal(self, ref: ProcRef, sig: int, *, group: bool = True) -> bool:
        """Signal the process group (or the pid); False if the process is gone or was reused."""

    @abstractmethod
    def alive(self, refs: list[ProcRef]) -> dict[int, bool]:
        """pid -> alive, in one round trip; a zombie or a reused pid counts as dead."""

    @abstractmethod
    def proc_state(self, ref: ProcRef) -> str | None:
        """'R', 'S', 'T' (stopped), 'Z', ... or None if the process is gone (or pid reused)."""

    def oom_kills(self) -> int | None:
        """How many processes the kernel's OOM killer has killed on this machine since it booted
        (/proc/vmstat `oom_kill`, any cgroup's or the whole machine's); None where that cannot be
        read, or on a scheduler's site (its jobs run on nodes of their own)."""
        if self.scheduler:
            return None
        try:
            return parse_oom_kills(self.read_bytes("/proc/vmstat", 0, 1 << 16))
        except (DldError, OSError):
            return None

    def describe(self, refs: list[ProcRef], max_age: float = 0.0) -> dict[int, JobInfo]:
        """What a scheduler says of each job (pending, running, why it waits), at most `max_age`
        seconds old; a machine has none."""
        return {}

    def cancel(self, ref: ProcRef) -> bool:
        """Cancel a scheduler's job as a preemption would; a machine has no jobs to cancel."""
        raise UsageError(f"host {self.name} runs processes, not scheduler jobs: there is no job to cancel")

    @abstractmethod
    def close(self) -> None:
        """Release connections; started processes keep running."""

    def tail(self, path: str, lines: int = 50) -> str:
        """The last `lines` lines of a text file."""
        size = self.size(path)
        if size is None:
            raise HostError(self.name, f"cannot read {path}: no such file")
        if lines <= 0:
            return ""
        data = self._tail_bytes(path, size, lines)
        data = data[:-1] if data.endswith(b"\n") else data
        return b"\n".join(data.split(b"\n")[-lines:]).decode("utf-8", "replace")

    def follow(
        self, path: str, *, from_end_lines: int = 10, poll_s: float = 0.5, stop: Callable[[], bool] | None = None
    ) -> Iterator[str]:
        """Yield the last `from_end_lines` lines, then each new line (no trailing newline).

        Waits for the file to appear; starts over if it is truncated. Ends when `stop()` is true
        (checked before every poll), otherwise never.
        """
        offset: int | None = None
        pending = b""
        while not (stop and stop()):
            size = self.size(path)
            if size is None:  # not created yet, or being rotated
                time.sleep(poll_s)
                continue
            if offset is None:
                *done, pending = self._tail_bytes(path, size, from_end_lines).split(b"\n")
                offset = size
                yield from _decode(done[-from_end_lines:] if from_end_lines > 0 else [])
                continue
            if size < offset:
                offset, pending = 0, b""  # truncated or replaced: read it from the start
            if size > offset:
                chunk = self.read_bytes(path, offset, min(size - offset, 1 << 20))
                offset += len(chunk)
                *done, pending = (pending + chunk).split(b"\n")
                yield from _decode(done)
                continue
            time.sleep(poll_s)

    def _tail_bytes(self, path: str, size: int, lines: int) -> bytes:
        """The end of the file holding at least `lines` complete lines (or all of it)."""
        block, start = 64 << 10, size
        data = b""
        while start > 0 and data.count(b"\n") <= lines:
            step = min(block, start)
            start -= step
            data = self.read_bytes(path, start, step) + data
            block *= 2
        return data

    def __enter__(self) -> Host:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
