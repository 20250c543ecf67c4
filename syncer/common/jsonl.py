"""Writing append-only JSON-lines logs (metrics.jsonl, events.jsonl) and log streams, never raising.

Each record is written with one `write()` on a file opened with O_APPEND, so lines from the
syncer, the supervisor and chaos commands never interleave mid-line. Reading them is `jsonlread`'s
(the operator's side: it tolerates a truncated last line, a writer killed mid-write).

No write here can kill a process: a record that cannot be written (ENOSPC, EDQUOT, EIO, ...) is
dropped and counted per file, one notice says so when dropping starts ("disk full writing
metrics.jsonl: dropping records until space is back") and one when writing works again (with the
count). Notices go to stderr and, where the process said where (`configure(events=...)`, or
`notices=` per call), as `write_dropped` / `write_resumed` events. A line cut short by a full disk
is ended by the next good write, so it costs one unreadable line, never two records.

A file over its cap (`max_bytes`, from the run's `max_log_mb`) is renamed to NAME.1, replacing the
older segment, and a new NAME begun; an flock and an inode check let only one of several writing
processes do it (`jsonlread` reads NAME.1 before NAME). `guard_stdio()` gives a process's
stdout and stderr (its log file, redirected by the launcher) the same guarantees.
"""

from __future__ import annotations

import abc
import collections
import errno
import fcntl
import io
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

from syncer.common import strictjson

FULL = (errno.ENOSPC, errno.EDQUOT)


def _default_source() -> str:
    """Who writes, for notices: the program ("syncer" for `python -m syncer`, "supervisor", ...)."""
    prog = Path(sys.argv[0] if sys.argv and sys.argv[0] else "python")
    return prog.parent.name if prog.stem == "__main__" else prog.stem


class _Config:
    events: Path | None = None  # where notices go as events (besides stderr)
    source: str = _default_source()
    max_bytes: int = 0  # default cap of append(); 0 = none


_config = _Config()
_totals: collections.Counter[str] = collections.Counter()  # file name -> records dropped in this process
_in_notice = threading.local()


def configure(*, events: Path | None = None, source: str | None = None, max_bytes: int | None = None) -> None:
    """Process-wide: the events file for notices, the writer's name in them, and append()'s cap."""
    if events is not None:
        _config.events = Path(events)
    if source is not None:
        _config.source = source
    if max_bytes is not None:
        _config.max_bytes = int(max_bytes)


def source() -> str:
    """This process's name in notices ("syncer", "supervisor", "learner-0", ...)."""
    return _config.source


def dropped() -> dict[str, int]:
    """Records (or log lines) this process could not write, per file name, since it started."""
    return dict(_totals)


def why(exc: OSError) -> str:
    """Why a write failed, in words: disk full (ENOSPC, EDQUOT) or the error's own text (EIO: Input/output error)."""
    return "disk full" if exc.errno in FULL else (exc.strerror or str(exc))


def notify(kind: str, detail: str, events: Path | None = None) -> bool:
    """One stderr line and (if there is an events file) one event; never raises.
    False when called from inside a notice (its own write failing), so the caller retries later."""
    if getattr(_in_notice, "busy", False):
        return False
    _in_notice.busy = True
    try:
        line = f"{_config.source}: {detail}"
        try:
            print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)
        except (OSError, ValueError, AttributeError):
            pass
        target = events or _config.events
        if target is not None:
            append(target, {"t": time.time(), "kind": kind, "target": _config.source, "detail": line})
    finally:
        _in_notice.busy = False
    return True


class _Sink(abc.ABC):
    """Appends whole lines to one file; drops and counts what it cannot write; never raises."""

    what = "records"

    def __init__(self, max_bytes: int = 0, notices: Path | None = None) -> None:
        self.max_bytes = max_bytes
        self.notices = notices
        self.dropped = 0  # since writing last worked
        self.reason = ""
        self._announced = False
        self._cut = False  # a partial line is on disk: begin the next write with a newline
        self._lock = threading.RLock()

    # what a kind of sink provides: FileSink (a named file) and FdSink (stdout/stderr's fd)
    @abc.abstractmethod
    def name(self) -> str:
        """The file's name, for notices."""

    @abc.abstractmethod
    def _acquire(self) -> int:
        """An fd to write to."""

    @abc.abstractmethod
    def _release(self, fd: int, broken: bool) -> None:
        """Done with `fd` (`broken`: a write on it failed)."""

    @abc.abstractmethod
    def _path(self, fd: int) -> str | None:
        """The path `fd` writes to, for rotation (None: cannot rotate)."""

    @abc.abstractmethod
    def _reopen(self, fd: int, path: str) -> int:
        """A fresh fd on `path` after a rotation."""

    def put(self, data: bytes) -> bool:
        """Append `data` (whole lines); False if it was dropped. Notices go out unlocked."""
        resumed, ok = 0, False
        with self._lock:
            fd = -1
            try:
                fd = self._acquire()
                reopen = self._rotated(fd, len(data))
                if reopen is not None:
                    fd, old = -1, fd
                    fd = self._reopen(old, reopen)
                self._write(fd, data)
            except OSError as exc:
                if fd >= 0:
                    self._release(fd, True)
                announce = self._drop(data, exc)
            else:
                self._release(fd, False)
                announce, ok = None, True
                resumed, self.dropped, self._announced = self.dropped, 0, False
        if not ok:
            if announce is not None and not notify("write_dropped", announce, self.notices):
                self._announced = False  # inside another notice: say it at the next drop
            return False
        if resumed and not notify(
            "write_resumed",
            f"writing {self.name()} again: {resumed} {self.what} were dropped ({self.reason})",
            self.notices,
        ):
            with self._lock:
                self.dropped += resumed  # say it at the next good write
                self._announced = True
        return True

    def _write(self, fd: int, data: bytes) -> None:
        data = b"\n" + data if self._cut else data
        view, done = memoryview(data), 0
        try:
            while done < len(data):
                n = os.write(fd, view[done:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += n
        except OSError:
            self._cut = self._cut or done > 0
            raise
        self._cut = False

    def _rotated(self, fd: int, size: int) -> str | None:
        """Rotate the file if `size` more bytes would take it over the cap; the path to reopen."""
        if self.max_bytes <= 0:
            return None
        have = os.fstat(fd).st_size
        if have == 0 or have + size <= self.max_bytes:
            return None
        path = self._path(fd)
        return path if path is not None and _rotate(fd, path) else None

    def _drop(self, data: bytes, exc: OSError) -> str | None:
        """Count a dropped write; the notice to give if dropping just started."""
        count = max(1, data.count(b"\n"))
        self.dropped += count
        _totals[self.name()] += count
        self.reason = why(exc)
        if self._announced:
            return None
        self._announced = True
        until = "space is back" if exc.errno in FULL else "it can write again"
        return f"{self.reason} writing {self.name()}: dropping {self.what} until {until}"


def _rotate(fd: int, path: str) -> bool:
    """Rename `path` to `path`.1 if `fd` is still that file; True if the caller should reopen
    `path` (rotated now, or already by another process, or gone)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # another process is rotating it
    try:
        mine = os.fstat(fd)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            return True
        if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
            os.replace(path, path + ".1")
        return True
    except OSError:
        return False
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class FileSink(_Sink):
    """A sink on a path: opened per write (safe across processes) or kept open (a busy log)."""

    def __init__(self, path: Path, max_bytes: int = 0, keep_open: bool = False, notices: Path | None = None) -> None:
        super().__init__(max_bytes, notices)
        self.path = str(path)
        self.keep_open = keep_open
        self._fd = -1

    def name(self) -> str:
        return os.path.basename(self.path)

    def _acquire(self) -> int:
        if self._fd < 0:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            if not self.keep_open:
                return fd
            self._fd = fd
        return self._fd

    def _release(self, fd: int, broken: bool) -> None:
        if self.keep_open and not broken:
            return
        if fd == self._fd:
            self._fd = -1
        _close(fd)

    def _path(self, fd: int) -> str | None:
        return self.path

    def _reopen(self, fd: int, path: str) -> int:
        self._release(fd, True)
        return self._acquire()

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                _close(self._fd)
                self._fd = -1


_files: dict[str, FileSink] = {}
_files_lock = threading.Lock()


def _line(record: dict[str, Any]) -> bytes:
    """One record as a JSON line every reader parses: NaN and infinities become null, objects strings."""
    return (strictjson.dumps(record, separators=(",", ":"), default=str) + "\n").encode()


def append(path: Path, record: dict[str, Any], *, max_bytes: int | None = None, notices: Path | None = None) -> bool:
    """Append one record as a line (opens and closes the file: safe across processes); False if
    it was dropped. `max_bytes` caps the file (default: `configure`'s; 0 = never rotate)."""
    with _files_lock:
        sink = _files.get(str(path))
        if sink is None:
            sink = _files[str(path)] = FileSink(path, _config.max_bytes)
    if max_bytes is not None:
        sink.max_bytes = max_bytes
    if notices is not None:
        sink.notices = notices
    return sink.put(_line(record))


class Writer:
    """A kept-open appender for a busy log (the syncer's metrics); `write` never raises."""

    def __init__(self, path: Path, max_bytes: int | None = None) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # the first write says so
        self.sink = FileSink(self.path, _config.max_bytes if max_bytes is None else max_bytes, keep_open=True)
        try:
            self.sink._acquire()  # create the file now, as before; a failure is the first write's
        except OSError:
            pass

    def write(self, record: dict[str, Any]) -> bool:
        return self.sink.put(_line(record))

    def close(self) -> None:
        self.sink.close()


class FdSink(_Sink):
    """A sink on an inherited file descriptor (stdout, stderr); rotation renames the file it
    names and points the descriptor (and stdout/stderr, where they share it) at a new one."""

    what = "log lines"

    def __init__(self, fd: int, max_bytes: int = 0) -> None:
        super().__init__(max_bytes)
        self.fd = fd

    def name(self) -> str:
        path = self._path(self.fd)
        return os.path.basename(path) if path else {1: "stdout", 2: "stderr"}.get(self.fd, f"fd {self.fd}")

    def _acquire(self) -> int:
        return self.fd

    def _release(self, fd: int, broken: bool) -> None:
        pass

    def _path(self, fd: int) -> str | None:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        return None if path.endswith(" (deleted)") or not path.startswith("/") else path

    def _reopen(self, fd: int, path: str) -> int:
        old = os.fstat(fd)
        new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for other in {fd, 1, 2}:
                try:
                    same = os.fstat(other)
                except OSError:
                    continue
                if (same.st_dev, same.st_ino) == (old.st_dev, old.st_ino):
                    os.dup2(new, other)
        finally:
            _close(new)
        return fd


class GuardedStream(io.TextIOBase):
    """A text stream on fd 1 or 2 that never raises: complete lines go out in one write each;
    what cannot be written is dropped and counted (see FdSink)."""

    def __init__(self, fd: int, max_bytes: int = 0) -> None:
        super().__init__()
        self.sink = FdSink(fd, max_bytes)
        self._buf: list[str] = []
        self._size = 0
        self._buf_lock = threading.Lock()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    @property
    def errors(self) -> str:  # type: ignore[override]
        return "backslashreplace"

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.sink.fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self.sink.fd)
        except OSError:
            return False

    def write(self, text: str) -> int:
        with self._buf_lock:
            self._buf.append(text)
            self._size += len(text)
            due = "\n" in text or self._size > 8192
        if due:
            self.flush()
        return len(text)

    def flush(self) -> None:
        with self._buf_lock:
            text, self._buf, self._size = "".join(self._buf), [], 0
        if text:
            self.sink.put(text.encode("utf-8", "backslashreplace"))


def guard_stdio(max_bytes: int | None = None, source: str | None = None) -> None:
    """Make sys.stdout and sys.stderr streams that never raise (idempotent: a second call only
    sets the cap, e.g. once the configuration is read)."""
    if source is not None:
        configure(source=source)
    for attr, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, attr)
        if isinstance(stream, GuardedStream):
            if max_bytes is not None:
                stream.sink.max_bytes = max_bytes
            continue
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
        setattr(sys, attr, GuardedStream(fd, max_bytes or 0))
