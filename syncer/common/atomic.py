"""All-or-nothing file writes, the one way the project replaces a file (a leaf: stdlib only).

`atomic_write(path, data)` and `with atomic_file(path) as fh:` write a private temporary file
beside `path` (O_EXCL, mode 0600 until it is complete), flush and fsync it, rename it over `path`
and fsync the directory, so that after a crash or a power cut `path` holds either the old content
or the new, never a mix, and the rename itself is durable. A failure (a full disk: ENOSPC, EIO)
removes the temporary file and raises `OSError`; whether that is fatal is the caller's decision
(the syncer, the learners and the supervisor keep running and retry with their next write).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(directory: Path) -> None:
    """Make renames in `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """A fresh hidden name beside `path` (unique per process and call)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


@contextlib.contextmanager
def atomic_file(path: Path | str, mode: int = 0o644) -> Iterator[BinaryIO]:
    """Yield a binary file that replaces `path` when the block ends without an exception."""
    path = Path(path)
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
            os.fchmod(fh.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(path: Path | str, data: bytes | str, mode: int = 0o644) -> None:
    """Replace `path` with `data` (str is written as UTF-8), all or nothing."""
    with atomic_file(path, mode) as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
