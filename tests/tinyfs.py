"""Test helper: a small tmpfs to fill up (real ENOSPC), mounted as root and always unmounted.

    with tinyfs.mounted(tmp_path / "fs", "64k") as fs:
        filler = tinyfs.fill(fs)      # the file system is now full
        ...
        filler.unlink()               # space is back

Tests that need it skip (with the reason) where mounting is not allowed (not root, no tmpfs).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted(path: Path, size: str) -> Iterator[Path]:
    """A fresh tmpfs of `size` (e.g. "64k", "48m") at `path`; unmounted on the way out, even on failure."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)  # still busy: detach


def fill(directory: Path, name: str = "filler") -> Path:
    """Write a file in `directory` until its file system says ENOSPC; the file (delete it to free the space)."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    block = b"\0" * (1 << 16)
    try:
        while True:
            try:
                if os.write(fd, block) <= 0:
                    break
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(block) == 1:
                    break
                block = block[: len(block) // 16 or 1]  # then the last bytes of the last page
    finally:
        os.close(fd)
    return path


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def top_up(path: Path, page: int = 4096) -> None:
    """Fill the rest of a file's last page (on a full tmpfs a file still takes appends until its
    last page is full): its writer's next line then needs space the file system does not have."""
    with open(path, "ab", buffering=0) as fh:
        room = -fh.seek(0, os.SEEK_END) % page
        if room:
            try:
                fh.write(b"." * (room - 1) + b"\n")
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
