"""The learner's data: a token corpus, its split into shards and an eval slice, and batches.

`load_corpus(spec, tokenizer=...)` reads every format docs/data.md describes; the readers live in
workload/datasets.py (which format a spec names; text, JSONL, Parquet), workload/tokenfiles.py
(pre-tokenized token files and directories of them) and workload/tokenized.py (text tokenized
with a tokenizer.json, once per host). This module keeps what they all share:

- `Corpus`: a flat array of token ids (`TokenArray`: a numpy array, a memmap, or
  `tokenfiles.TokenShards` over several files), its vocabulary, where it came from, and its
  end-of-document token when it has one.
- the built-in corpus (``"builtin"``): the Python standard library's own ``.py`` sources (every
  Python installation carries them), sorted by path, test suites and site-packages skipped, read
  as bytes (vocabulary 256), capped at `BUILTIN_MAX_BYTES`.
- the byte cache: reading ~1800 stdlib files is most of a learner restart's cost on a small
  machine, so a concatenated byte corpus is prepared once and cached on disk (``$DLDCTL_CACHE``
  or ``~/.cache/dldctl``): a raw uint8 file plus a JSON sidecar, each written to a temporary file
  and renamed into place (learners starting together may race to build it; the rename is atomic
  and both write the same bytes). Later loads open it with `np.memmap`: no copy, no re-read.

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
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from syncer.common.atomic import atomic_write

SHARED_MODE = 0o644  # other users' learners on the host may share the corpus cache

BUILTIN_MAX_BYTES = 24 << 20  # the stdlib minus tests is ~13 MB on 3.11; a bound for others
DEFAULT_BIN_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64, as in nanoGPT
CACHE_FORMAT = 1  # bump when the prepared layout changes
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
SEPARATOR = b"\n"  # after each concatenated file or document of a byte corpus


class TokenArray(Protocol):
    """What the batches read a corpus through: a 1-D array of ids (numpy, memmap, TokenShards).

    `tokens[idx]` with an integer numpy array of positions (any shape) gathers ids in that shape;
    a slice gives a 1-D array; `len(tokens)` counts them."""

    @property
    def dtype(self) -> np.dtype[Any]: ...

    def __len__(self) -> int: ...

    def __getitem__(self, key: Any) -> Any: ...


@dataclass(frozen=True)
class Corpus:
    """A flat token array (uint8 bytes, uint16 or uint32 ids; memmap ok) and what it came from."""

    tokens: TokenArray
    vocab_size: int
    source: str
    digest: str = ""  # sha256 of the prepared tokens when known: compare across hosts
    eos: int | None = None  # the end-of-document token between documents, when the data has one


def cache_root(cache_dir: str | None = None) -> Path:
    """Where prepared corpora live: the argument, else $DLDCTL_CACHE, else ~/.cache/dldctl."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("DLDCTL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dldctl"


def load_corpus(
    spec: str = "builtin",
    *,
    vocab_size: int | None = None,
    cache_dir: str | None = None,
    tokenizer: str | None = None,
) -> Corpus:
    """The corpus named by `spec` (docs/data.md): "builtin", token files (.bin, .u16, .u32 with a
    .json metadata file) or a directory of them, or text, JSONL or Parquet, read as bytes or, with
    `tokenizer` (a tokenizer.json), tokenized once per host. `vocab_size` None: what the data
    says (256 for bytes, the metadata's or the tokenizer's vocabulary)."""
    from workload import datasets  # it imports this module

    return datasets.load(spec, vocab_size=vocab_size, cache_dir=cache_dir, tokenizer=tokenizer)


def check_byte_vocab(vocab_size: int | None, spec: str) -> None:
    """Refuse a vocabulary that cannot hold every byte value, naming the data."""
    if vocab_size is not None and vocab_size < 256:
        raise ValueError(f"data {spec!r} is read as bytes: vocab_size must be >= 256, got {vocab_size}")


def builtin_corpus(vocab_size: int | None = None, cache_dir: str | None = None) -> Corpus:
    """The built-in corpus as bytes, prepared once per host and memory-mapped."""
    check_byte_vocab(vocab_size, "builtin")
    return cached_bytes(_builtin_key(), "builtin (Python stdlib sources)", _read_builtin, vocab_size, cache_dir)


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
        parts.append(data + SEPARATOR)
        total += len(data) + len(SEPARATOR)
        used += 1
        if limit is not None and total >= limit:
            break
    blob = b"".join(parts)
    return (blob[:limit] if limit is not None else blob), used


def _read_builtin() -> tuple[bytes, dict[str, Any]]:
    blob, used = _concat(stdlib_sources(), BUILTIN_MAX_BYTES)
    root = sysconfig.get_paths()["stdlib"]
    return blob, {"files": used, "stdlib": root, "python": sys.version.split()[0]}


def _builtin_key() -> str:
    stdlib = sysconfig.get_paths()["stdlib"]
    ident = f"{CACHE_FORMAT}:{stdlib}:{sys.version}:{BUILTIN_MAX_BYTES}:{sorted(_SKIP_DIRS)}"
    return f"builtin-py{sys.version_info[0]}{sys.version_info[1]}-" + hashlib.sha256(ident.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- the on-disk cache


def cached_bytes(
    key: str,
    source: str,
    read: Callable[[], tuple[bytes, dict[str, Any]]],
    vocab_size: int | None,
    cache_dir: str | None,
) -> Corpus:
    """Load prepared bytes `key` from the cache, or prepare them with `read()` and store them
    (`read` gives the bytes and facts about them for the sidecar)."""
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


def _windows(tokens: TokenArray, starts: np.ndarray, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """x = tokens[s : s+T], y = tokens[s+1 : s+T+1] for each start s, as int64 (B, T) on `device`."""
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # (B, T+1)
    buf = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))  # one gather, one copy
    if device.type == "cuda":
        buf = buf.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        buf = buf.to(device)
    return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


def _check_range(tokens: TokenArray, start: int, stop: int, seq_len: int, what: str) -> None:
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
        tokens: TokenArray,
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
    tokens: TokenArray,
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
