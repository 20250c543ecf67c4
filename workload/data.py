"""The learner's data: a token corpus, its split into shards and an eval slice, and batches.

Corpus sources (`load_corpus(spec)`):
- ``"builtin"``: the Python standard library's own ``.py`` sources (every Python installation
  carries them), sorted by path, test suites and site-packages skipped, read as bytes
  (vocabulary 256), capped at `BUILTIN_MAX_BYTES`.
- a text file (read as bytes, memory-mapped in place), or a directory of text files (every
  non-hidden file without NUL bytes in its head, sorted by relative path, concatenated).
- a ``.bin`` file of uint16 tokens with no header (nanoGPT's `prepare.py` format); every token
  must be < `vocab_size` (default 50304).

Reading ~1800 stdlib files is most of a learner restart's cost on a small machine, so a
concatenated corpus is prepared once and cached on disk (``$DLDCTL_CACHE`` or
``~/.cache/dldctl``): a raw uint8 file plus a JSON sidecar, each written to a temporary file and
renamed into place (learners starting together may race to build it; the rename is atomic and
both write the same bytes). Later loads open it with `np.memmap`: no copy, no re-read.

`split` cuts the corpus into the eval slice (its tail: the same for every learner) and disjoint,
contiguous train shards of the rest. `Batches` samples random windows of one shard, seeded;
`eval_batches` takes fixed, evenly spaced windows of the eval slice.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from syncer.common.atomic import atomic_write

SHARED_MODE = 0o644  # other users' learners on the host may share the corpus cache

BUILTIN_MAX_BYTES = 24 << 20  # the stdlib minus tests is ~13 MB on 3.11; a bound for others
DEFAULT_BIN_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64, as in nanoGPT
CACHE_FORMAT = 1  # bump when the prepared layout changes
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_SEPARATOR = b"\n"  # between concatenated files


@dataclass(frozen=True)
class Corpus:
    """A flat token array (uint8 for bytes, uint16 for .bin; memmap ok) and what it came from."""

    tokens: np.ndarray
    vocab_size: int
    source: str
    digest: str = ""  # sha256 of the prepared bytes when known (builtin, text dir): compare across hosts


def cache_root(cache_dir: str | None = None) -> Path:
    """Where prepared corpora live: the argument, else $DLDCTL_CACHE, else ~/.cache/dldctl."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("DLDCTL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dldctl"


def load_corpus(spec: str = "builtin", *, vocab_size: int | None = None, cache_dir: str | None = None) -> Corpus:
    """The corpus named by `spec`: "builtin", a text file or directory, or a uint16 .bin file."""
    if spec == "builtin":
        _check_byte_vocab(vocab_size, spec)
        return _cached(_builtin_key(), "builtin (Python stdlib sources)", _read_builtin, vocab_size, cache_dir)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"data {spec!r}: no such file or directory ({path.resolve()}); "
            'use "builtin", a text file or directory, or a uint16 .bin file'
        )
    if path.is_file() and path.suffix == ".bin":
        return _load_bin(path, DEFAULT_BIN_VOCAB if vocab_size is None else vocab_size, cache_dir)
    _check_byte_vocab(vocab_size, spec)
    if path.is_file():
        if path.stat().st_size == 0:
            raise ValueError(f"data {str(path)!r}: the file is empty")
        # a text file already is a byte corpus: map it in place, nothing to prepare or cache
        return Corpus(np.memmap(path, dtype=np.uint8, mode="r"), vocab_size or 256, f"text file {path}")
    if path.is_dir():
        key = _dir_key(path)
        return _cached(key, f"text directory {path}", lambda: _read_dir(path), vocab_size, cache_dir)
    raise ValueError(f"data {str(path)!r}: not a regular file or directory")


def _check_byte_vocab(vocab_size: int | None, spec: str) -> None:
    if vocab_size is not None and vocab_size < 256:
        raise ValueError(f"data {spec!r} is read as bytes: vocab_size must be >= 256, got {vocab_size}")


# --------------------------------------------------------------------------- reading sources


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted by relative path, without tests or site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _concat(paths: list[Path], limit: int | None) -> tuple[bytes, int]:
    """The files' bytes joined by a newline, stopping at `limit` bytes; and how many were used."""
    parts: list[bytes] = []
    total = used = 0
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable (permissions, a dangling link): skip it, deterministically
        parts.append(data + _SEPARATOR)
        total += len(data) + len(_SEPARATOR)
        used += 1
        if limit is not None and total >= limit:
            break
    blob = b"".join(parts)
    return (blob[:limit] if limit is not None else blob), used


def _read_builtin() -> tuple[bytes, dict[str, Any]]:
    blob, used = _concat(stdlib_sources(), BUILTIN_MAX_BYTES)
    root = sysconfig.get_paths()["stdlib"]
    return blob, {"files": used, "stdlib": root, "python": sys.version.split()[0]}


def _text_files(root: Path) -> list[Path]:
    """Non-hidden regular files under `root`, sorted, whose first 8 KiB hold no NUL byte."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            path = Path(dirpath) / name
            if name.startswith(".") or not path.is_file():
                continue
            try:
                with open(path, "rb") as fh:
                    if b"\0" not in fh.read(8192):
                        found.append(path)
            except OSError:
                continue  # unreadable: skipped, like a binary file
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_dir(root: Path) -> tuple[bytes, dict[str, Any]]:
    files = _text_files(root)
    blob, used = _concat(files, None)
    if not blob:
        raise ValueError(f"data {str(root)!r}: the directory holds no non-empty text files")
    return blob, {"files": used}


def _dir_key(root: Path) -> str:
    """A cache key that changes when any file under `root` is added, removed or modified."""
    h = hashlib.sha256(str(root.resolve()).encode())
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            st = os.stat(os.path.join(dirpath, name))
            h.update(f"{dirpath}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return "dir-" + h.hexdigest()[:16]


def _builtin_key() -> str:
    stdlib = sysconfig.get_paths()["stdlib"]
    ident = f"{CACHE_FORMAT}:{stdlib}:{sys.version}:{BUILTIN_MAX_BYTES}:{sorted(_SKIP_DIRS)}"
    return f"builtin-py{sys.version_info[0]}{sys.version_info[1]}-" + hashlib.sha256(ident.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- the on-disk cache


def _cached(
    key: str,
    source: str,
    read: Callable[[], tuple[bytes, dict[str, Any]]],
    vocab_size: int | None,
    cache_dir: str | None,
) -> Corpus:
    """Load prepared bytes `key` from the cache, or prepare them with `read()` and store them."""
    root = cache_root(cache_dir)
    raw, meta = root / f"{key}.u8", root / f"{key}.json"
    hit = _open_cached(raw, meta)
    if hit is not None:
        tokens, info = hit
        return Corpus(tokens, vocab_size or 256, source, info.get("sha256", ""))
    blob, info = read()
    info = {
        **info,
        "format": CACHE_FORMAT,
        "source": source,
        "bytes": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "dtype": "uint8",
    }
    try:
        root.mkdir(parents=True, exist_ok=True)
        atomic_write(raw, blob, SHARED_MODE)
        atomic_write(meta, json.dumps(info, indent=1), SHARED_MODE)  # the sidecar commits the entry
        tokens = np.memmap(raw, dtype=np.uint8, mode="r")
    except OSError as exc:  # a read-only home: still train, just without the cache
        print(f"dldctl: cannot cache the corpus in {root} ({exc}); using it from memory", file=sys.stderr)
        tokens = np.frombuffer(blob, dtype=np.uint8)
    return Corpus(tokens, vocab_size or 256, source, info["sha256"])


def _open_cached(raw: Path, meta: Path) -> tuple[np.ndarray, dict[str, Any]] | None:
    """The memory-mapped prepared corpus if its sidecar exists and agrees with it, else None."""
    try:
        info = json.loads(meta.read_text())
        if info.get("format") != CACHE_FORMAT or raw.stat().st_size != info["bytes"] or not info["bytes"]:
            return None
        return np.memmap(raw, dtype=np.uint8, mode="r"), info
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _load_bin(path: Path, vocab_size: int, cache_dir: str | None) -> Corpus:
    """A headerless uint16 token file; every token is checked < vocab_size (result cached)."""
    size = path.stat().st_size
    if size == 0 or size % 2:
        raise ValueError(
            f"data {str(path)!r}: a .bin corpus must hold uint16 tokens, "
            f"but its size ({size} bytes) is {'zero' if size == 0 else 'odd'}"
        )
    if not 2 <= vocab_size <= 65536:
        raise ValueError(f"data {str(path)!r}: vocab_size must be in 2..65536 for uint16 tokens, got {vocab_size}")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    top = _max_token(path, tokens, cache_dir)
    if top >= vocab_size:
        raise ValueError(
            f"data {str(path)!r}: holds token id {top}, not < vocab_size {vocab_size}; "
            f"set vocab_size to at least {top + 1} (GPT-2 BPE: 50304)"
        )
    return Corpus(tokens, vocab_size, f"uint16 tokens {path}")


def _max_token(path: Path, tokens: np.ndarray, cache_dir: str | None) -> int:
    """The largest token id, scanned in chunks once per (file, size, mtime) and remembered."""
    st = path.stat()
    ident = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    note = cache_root(cache_dir) / f"bin-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"
    try:
        return int(json.loads(note.read_text())["max_token"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    chunk = 1 << 24
    top = max(int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk))
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(note, json.dumps({"path": str(path), "max_token": top}), SHARED_MODE)
    except OSError:
        pass  # uncached: the scan simply runs again next time
    return top


# --------------------------------------------------------------------------- split and batches


def split(
    corpus: Corpus, *, shards: int, eval_fraction: float = 0.02, max_eval_tokens: int = 1 << 20
) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """[start, stop) of each of `shards` contiguous train shards, and of the eval slice (the tail)."""
    n = len(corpus.tokens)
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if not 0.0 < eval_fraction < 1.0 or max_eval_tokens < 1:
        raise ValueError(
            f"eval_fraction must be in (0, 1) and max_eval_tokens >= 1, got {eval_fraction}, {max_eval_tokens}"
        )
    n_eval = max(1, min(int(n * eval_fraction), max_eval_tokens))
    n_train = n - n_eval
    if n_train < shards:
        raise ValueError(f"corpus {corpus.source} has {n} tokens: too few for {shards} shards and an eval slice")
    bounds = [i * n_train // shards for i in range(shards + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(shards)], (n_train, n)


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """x = tokens[s : s+T], y = tokens[s+1 : s+T+1] for each start s, as int64 (B, T) on `device`."""
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # (B, T+1)
    buf = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))  # one gather, one copy
    if device.type == "cuda":
        buf = buf.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        buf = buf.to(device)
    return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


def _check_range(tokens: np.ndarray, start: int, stop: int, seq_len: int, what: str) -> None:
    if not 0 <= start < stop <= len(tokens):
        raise ValueError(f"{what} range [{start}, {stop}) is outside the corpus (0..{len(tokens)})")
    if stop - start < seq_len + 1:
        raise ValueError(
            f"{what} range [{start}, {stop}) holds {stop - start} tokens: fewer than "
            f"seq_len + 1 = {seq_len + 1}; use a shorter seq_len, fewer learners or more data"
        )


class Batches:
    """Random windows of tokens[start:stop], seeded: an endless iterator of (x, y) int64 (B, T)."""

    def __init__(
        self,
        tokens: np.ndarray,
        start: int,
        stop: int,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        device: str | torch.device = "cpu",
    ) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        _check_range(tokens, start, stop, seq_len, "shard")
        self.tokens, self.start, self.stop = tokens, start, stop
        self.batch_size, self.seq_len = batch_size, seq_len
        self.device = torch.device(device)
        self.tokens_per_batch = batch_size * seq_len  # every x position is one trained token
        self._rng = np.random.default_rng(seed)

    def next(self) -> tuple[Tensor, Tensor]:
        """The next batch: window starts uniform in [start, stop - seq_len - 1]."""
        starts = self._rng.integers(self.start, self.stop - self.seq_len, size=self.batch_size)
        return _windows(self.tokens, starts, self.seq_len, self.device)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        return self.next()


def eval_batches(
    tokens: np.ndarray,
    start: int,
    stop: int,
    *,
    batch_size: int,
    seq_len: int,
    count: int,
    device: str | torch.device = "cpu",
) -> list[tuple[Tensor, Tensor]]:
    """`count` fixed batches of windows evenly spaced over tokens[start:stop] (no RNG at all)."""
    if batch_size < 1 or seq_len < 1 or count < 1:
        raise ValueError(f"batch_size, seq_len and count must be >= 1, got {batch_size}, {seq_len}, {count}")
    _check_range(tokens, start, stop, seq_len, "eval")
    last = stop - seq_len - 1
    starts = np.linspace(start, last, num=batch_size * count).round().astype(np.int64)
    dev = torch.device(device)
    return [_windows(tokens, starts[i * batch_size : (i + 1) * batch_size], seq_len, dev) for i in range(count)]
