"""`LocalHost`: the `Host` interface on the operator's own machine (subprocess, os, /proc).

Used by the built-in default run (`dldctl up` with no inventory) and for hosts whose address is
"local". Commands run under /bin/sh in a new session so a timeout can kill the whole process group
(a shell's children included), not just the shell.
"""

from __future__ import annotations

import os
import shutil
import signal as _signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from dldctl.errors import HostError, RemoteCommandError
from dldctl.hosts.base import (
    CommandResult,
    Host,
    ProcRef,
    ProcStat,
    is_live,
    launcher_script,
    output_tail,
    parse_started,
    parse_stat,
)
from syncer.common.atomic import atomic_file


def read_stat(pid: int) -> ProcStat | None:
    """This machine's /proc/<pid>/stat, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return parse_stat(f.read())
    except OSError:
        return None


class LocalHost(Host):
    """The operator's machine."""

    def __init__(self, name: str = "local") -> None:
        self.name = name

    def run(
        self,
        command: str,
        *,
        timeout: float = 60.0,
        input: bytes | None = None,
        check: bool = True,
        env: dict[str, str] | None = None,
    ) -> CommandResult:
        """Run `command` under /bin/sh; stdout and stderr are drained concurrently."""
        full_env = {**os.environ, **env} if env else None
        try:
            proc = subprocess.Popen(
                command,
                shell=True,
                env=full_env,
                start_new_session=True,
                stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        except OSError as exc:
            raise HostError(self.name, f"cannot run `{command}`: {exc.strerror}") from exc
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            self._kill_group(proc)
            raise HostError(self.name, f"`{command}` did not finish within {timeout:g}s (killed it)") from exc
        except BaseException:
            self._kill_group(proc)  # Ctrl-C in the CLI: leave nothing behind
            raise
        result = CommandResult(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
        if check and result.status != 0:
            raise RemoteCommandError(self.name, command, result.status, output_tail(result))
        return result

    @staticmethod
    def _kill_group(proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the command's whole process group, then reap it."""
        try:
            os.killpg(proc.pid, _signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            # something outside the group still holds our pipes; stop waiting for it
            for pipe in (proc.stdout, proc.stderr):
                if pipe:
                    pipe.close()
            proc.wait()

    def put_file(self, local: Path, remote: str, mode: int = 0o644) -> None:
        """Copy `local` to `remote` atomically (tmp + rename)."""
        try:
            with open(local, "rb") as src:
                self._write_atomic(remote, mode, lambda dst: shutil.copyfileobj(src, dst))
        except OSError as exc:
            raise HostError(self.name, f"cannot copy {local} to {remote}: {exc}") from exc

    def put_bytes(self, data: bytes, remote: str, mode: int = 0o600) -> None:
        """Write `data` to `remote` atomically, the file created with `mode` before any write."""
        try:
            self._write_atomic(remote, mode, lambda dst: dst.write(data))
        except OSError as exc:
            raise HostError(self.name, f"cannot write {remote}: {exc}") from exc

    def _write_atomic(self, remote: str, mode: int, fill: Callable[[BinaryIO], object]) -> None:
        """Create a private tmp file beside `remote`, fchmod, fill, fsync, rename over `remote`."""
        dest = Path(os.path.expanduser(remote))
        dest.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(dest, mode) as f:  # O_EXCL 0600 until complete: nobody reads it half-written
            fill(f)

    def get_file(self, remote: str, local: Path) -> None:
        """Copy `remote` to `local` (tmp + rename, parents created)."""
        src = os.path.expanduser(remote)
        try:
            with open(src, "rb") as f:
                local.parent.mkdir(parents=True, exist_ok=True)
                with atomic_file(local) as out:
                    shutil.copyfileobj(f, out)
        except OSError as exc:
            raise HostError(self.name, f"cannot copy {remote} to {local}: {exc}") from exc

    def read_bytes(self, remote: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        """Up to `limit` bytes of `remote` from `offset`."""
        try:
            with open(os.path.expanduser(remote), "rb") as f:
                f.seek(offset)
                return f.read(limit)
        except FileNotFoundError as exc:
            raise HostError(self.name, f"cannot read {remote}: no such file") from exc
        except OSError as exc:
            raise HostError(self.name, f"cannot read {remote}: {exc.strerror}") from exc

    def size(self, remote: str) -> int | None:
        """Size in bytes, None if missing."""
        try:
            return os.stat(os.path.expanduser(remote)).st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HostError(self.name, f"cannot stat {remote}: {exc.strerror}") from exc

    def exists(self, remote: str) -> bool:
        """Whether the path exists."""
        return os.path.lexists(os.path.expanduser(remote))

    def mkdir(self, remote: str, mode: int = 0o755) -> None:
        """Create the directory and its parents."""
        try:
            os.makedirs(os.path.expanduser(remote), mode=mode, exist_ok=True)
        except OSError as exc:
            raise HostError(self.name, f"cannot create directory {remote}: {exc}") from exc

    def home(self) -> str:
        """The current user's home directory."""
        return os.path.expanduser("~")

    def start(self, argv: list[str], *, cwd: str, log: str, env: dict[str, str] | None = None) -> ProcRef:
        """Start `argv` detached; `env` reaches it through the environment, never argv."""
        script = launcher_script(argv, os.path.expanduser(cwd), os.path.expanduser(log))
        result = self.run(script, timeout=30.0, check=False, env=env)
        return parse_started(self.name, argv, result)

    def signal(self, ref: ProcRef, sig: int, *, group: bool = True) -> bool:
        """Send `sig` to the group (or pid) of `ref`; False if it is gone or the pid was reused.

        With `group`, a leader that already exited (gone or zombie) still gets its group swept:
        while any member lives, the kernel cannot hand pid == pgid to a new process, so the
        group is still ours. The result is False then, since the process itself is gone.
        """
        stat = read_stat(ref.pid)
        if stat is not None and stat.start_ticks != ref.start_ticks:
            return False  # pid reused by an unrelated process
        live = is_live(stat, ref)
        try:
            if group:
                os.killpg(ref.pid, sig)
            elif live:
                os.kill(ref.pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError as exc:
            raise HostError(self.name, f"not allowed to signal pid {ref.pid}") from exc
        return live

    def alive(self, refs: list[ProcRef]) -> dict[int, bool]:
        """pid -> alive (zombie or reused pid = dead)."""
        return {ref.pid: is_live(read_stat(ref.pid), ref) for ref in refs}

    def proc_state(self, ref: ProcRef) -> str | None:
        """The process state letter, None if gone or the pid was reused."""
        stat = read_stat(ref.pid)
        return stat.state if stat and stat.start_ticks == ref.start_ticks else None

    def close(self) -> None:
        """Nothing to release."""
