"""Pre-tokenized data: files of raw little-endian token ids, a small JSON metadata file beside
each, and a directory of them read as one flat array without copying (docs/data.md).

    X.bin                          uint16 ids, no metadata file (nanoGPT's prepare.py format)
    X.u16 | X.u32                  uint16 | uint32 ids (the suffix says which)
    X.bin | X.u16 | X.u32 + X.json {"dtype": "uint16" | "uint32", "vocab_size": N, "eos": ID}:
                                   dtype required, vocab_size and eos optional
    a directory of those           every token file directly inside it, sorted by name, all of one
                                   dtype, vocab_size and eos: one `TokenShards` over their memmaps

Every file is checked when it is opened: not empty, a whole number of tokens, and every id below
the metadata's vocab_size. Finding the largest id (and the sha256 the corpus digest is made of)
reads the whole file once; the result is remembered in the cache (`data.cache_root()`) under the
file's path, size, mtime and dtype, so a learner restart opens the file and nothing more.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from syncer.common.atomic import atomic_write
from workload.data import SHARED_MODE, TokenArray, cache_root

TOKEN_SUFFIXES = (".bin", ".u16", ".u32")
DTYPES: dict[str, np.dtype[Any]] = {
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
}  # little-endian, whatever the host
_SUFFIX_DTYPE = {".u16": "uint16", ".u32": "uint32"}
META_KEYS = ("dtype", "vocab_size", "eos")
_EXAMPLE = '{"dtype": "uint32", "vocab_size": 128256, "eos": 128001}'
SCAN_FORMAT = 1  # bump when what a scan remembers changes
SCAN_CHUNK = 1 << 24  # ids per step of the scan


@dataclass(frozen=True)
class TokenMeta:
    """What a token file's metadata says (a bare .bin: uint16, nothing else)."""

    dtype: np.dtype[Any]
    vocab_size: int | None
    eos: int | None
    metadata: Path | None  # the .json it came from; None: none beside the file

    def describe(self) -> str:
        return f"{self.dtype.name}, vocab_size {self.vocab_size}, eos {self.eos}"


@dataclass(frozen=True)
class TokenData:
    """Opened token files: the ids, their metadata, the largest id and the file that holds it."""

    tokens: TokenArray
    meta: TokenMeta
    top: int
    top_file: Path
    digest: str  # one file: sha256 of its bytes; a directory: sha256 of its files' sha256s in order
    source: str


def is_token_file(path: Path) -> bool:
    return path.suffix in TOKEN_SUFFIXES


def metadata_path(path: Path) -> Path:
    """X.json beside X.bin / X.u16 / X.u32."""
    return path.with_suffix(".json")


def shard_files(root: Path) -> list[Path]:
    """The token files directly inside `root` (not hidden), sorted by name."""
    return sorted(p for p in root.iterdir() if is_token_file(p) and not p.name.startswith(".") and p.is_file())


# --------------------------------------------------------------------------- the metadata file


def read_meta(path: Path) -> TokenMeta:
    """The metadata of token file `path`: its .json when there is one, else what its suffix says."""
    meta = metadata_path(path)
    if not meta.is_file():
        return TokenMeta(DTYPES[_SUFFIX_DTYPE.get(path.suffix, "uint16")], None, None, None)
    where = f"data {str(path)!r}: metadata file {meta.name}"
    try:
        doc = json.loads(meta.read_bytes())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        first = str(exc).split("\n")[0][:120]
        raise ValueError(f"{where} is not JSON ({first}); write e.g. {_EXAMPLE}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where} holds a JSON {type(doc).__name__}, not an object; write e.g. {_EXAMPLE}")
    for key in doc:
        if key not in META_KEYS:
            raise ValueError(f"{where}: unknown key {key!r}; the keys are {', '.join(META_KEYS)}")
    name = doc.get("dtype")
    if name not in DTYPES:
        got = "no dtype" if name is None else f"dtype {name!r}"
        raise ValueError(f'{where}: {got}; write "dtype": "uint16" or "uint32" (the width of each token id)')
    if path.suffix in _SUFFIX_DTYPE and _SUFFIX_DTYPE[path.suffix] != name:
        raise ValueError(f"{where}: dtype {name!r} contradicts the file's suffix {path.suffix}; fix one of them")
    vocab = _optional_int(doc, "vocab_size", where, 1)
    if vocab is not None and name == "uint16" and vocab > 1 << 16:
        raise ValueError(f"{where}: vocab_size {vocab} does not fit uint16 ids; write the tokens as uint32")
    eos = _optional_int(doc, "eos", where, 0)
    if eos is not None and vocab is not None and eos >= vocab:
        raise ValueError(f"{where}: eos {eos} is not < vocab_size {vocab}")
    return TokenMeta(DTYPES[name], vocab, eos, meta)


def _optional_int(doc: dict[str, Any], key: str, where: str, minimum: int) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


# --------------------------------------------------------------------------- one file, a directory


def open_file(path: Path, cache_dir: str | None) -> TokenData:
    """Token file `path` memory-mapped and checked (size, every id < the metadata's vocab_size)."""
    meta = read_meta(path)
    tokens = _map(path, meta.dtype)
    top, digest = scan(path, tokens, cache_dir)
    _check_top(path, meta, top)
    return TokenData(tokens, meta, top, path, digest, f"{meta.dtype.name} tokens {path}")


def open_dir(root: Path, cache_dir: str | None) -> TokenData:
    """Every token file directly inside `root`, in name order, as one `TokenShards`."""
    files = shard_files(root)
    _refuse_others(root, files)
    metas = [read_meta(p) for p in files]
    for path, meta in zip(files[1:], metas[1:]):
        if (meta.dtype, meta.vocab_size, meta.eos) != (metas[0].dtype, metas[0].vocab_size, metas[0].eos):
            raise ValueError(
                f"data {str(root)!r}: {files[0].name} is {metas[0].describe()} but {path.name} is "
                f"{meta.describe()}; every token file of a directory needs the same dtype, vocab_size and eos"
            )
    parts, top, top_file = [], -1, files[0]
    h = hashlib.sha256()
    for path, meta in zip(files, metas):
        tokens = _map(path, meta.dtype)
        file_top, digest = scan(path, tokens, cache_dir)
        _check_top(path, meta, file_top)
        parts.append(tokens)
        h.update(f"{path.name}:{digest}\n".encode())
        if file_top > top:
            top, top_file = file_top, path
    array: TokenArray = parts[0] if len(parts) == 1 else TokenShards(parts)
    source = f"{metas[0].dtype.name} token directory {root} ({len(files)} files)"
    return TokenData(array, metas[0], top, top_file, h.hexdigest(), source)


def _refuse_others(root: Path, files: list[Path]) -> None:
    """A directory of token files holds only them and their metadata (subdirectories aside)."""
    allowed = set(files) | {metadata_path(p) for p in files}
    for path in sorted(root.iterdir()):
        if path.name.startswith(".") or path in allowed or not path.is_file():
            continue
        raise ValueError(
            f"data {str(root)!r}: holds token file {files[0].name} and {path.name}, which is not one; a directory "
            "of token files holds only them (.bin, .u16, .u32) and their .json metadata: move "
            f"{path.name} out, or point data at one file"
        )


def _map(path: Path, dtype: np.dtype[Any]) -> np.memmap[Any, np.dtype[Any]]:
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"data {str(path)!r}: the file is empty")
    over = size % dtype.itemsize
    if over:
        odd = "an odd size: " if dtype.itemsize == 2 else ""
        raise ValueError(
            f"data {str(path)!r}: {size} bytes is not a whole number of {dtype.name} tokens ({odd}{over} "
            f"byte{'s' if over > 1 else ''} over); a truncated file? write it again"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def _check_top(path: Path, meta: TokenMeta, top: int) -> None:
    if meta.vocab_size is not None and top >= meta.vocab_size:
        assert meta.metadata is not None
        raise ValueError(
            f"data {str(path)!r}: holds token id {top}, not < vocab_size {meta.vocab_size} (its metadata file "
            f"{meta.metadata.name}); write there the vocab_size of the tokenizer that made these tokens"
        )


def scan(path: Path, tokens: TokenArray, cache_dir: str | None) -> tuple[int, str]:
    """The largest id and the sha256 of the file, read once per (file, size, mtime, dtype) and
    remembered in the cache."""
    st = path.stat()
    ident = f"{SCAN_FORMAT}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{tokens.dtype.name}"
    note = cache_root(cache_dir) / f"scan-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"
    try:
        info = json.loads(note.read_text())
        return int(info["max_token"]), str(info["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    top, h = 0, hashlib.sha256()
    for i in range(0, len(tokens), SCAN_CHUNK):
        piece = np.ascontiguousarray(tokens[i : i + SCAN_CHUNK])
        top = max(top, int(piece.max()))
        h.update(piece.data)  # the bytes as stored, no copy
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(note, json.dumps({"path": str(path), "max_token": top, "sha256": h.hexdigest()}), SHARED_MODE)
    except OSError:
        pass  # uncached: the scan simply runs again next time
    return top, h.hexdigest()


# --------------------------------------------------------------------------- many files as one array


class TokenShards:
    """Several 1-D token arrays (memmaps) read as their concatenation, never copied whole.

    `len()`, `.dtype`, and `[...]` with an int, a slice, or an integer array of positions of any
    shape (a gather: each position is found in its file with a binary search over the files'
    offsets, so a window may cross from one file into the next)."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        if not parts or any(p.ndim != 1 or p.dtype != parts[0].dtype for p in parts):
            raise ValueError("TokenShards needs one or more 1-D arrays of one dtype")
        self.parts = list(parts)
        lengths = np.array([len(p) for p in parts], dtype=np.int64)
        self.ends = np.cumsum(lengths)  # parts[k] holds positions [ends[k] - len, ends[k])
        self.starts = self.ends - lengths
        self._dtype: np.dtype[Any] = parts[0].dtype

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int | np.integer):
            i = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"index {int(key)} is out of bounds for {len(self)} tokens")
            k = int(np.searchsorted(self.ends, i, side="right"))
            return self.parts[k][i - self.starts[k]]
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step == 1:
                return self._range(start, max(start, stop))
            return self._gather(np.arange(start, stop, step, dtype=np.int64))
        positions = np.asarray(key)
        if positions.dtype.kind not in "iu":
            raise TypeError(f"TokenShards takes an int, a slice or an integer array, not {positions.dtype}")
        return self._gather(positions)

    def _range(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self.ends, start, side="right"))
        pieces = []
        for k in range(first, len(self.parts)):
            if self.starts[k] >= stop:
                break
            pieces.append(self.parts[k][max(start - self.starts[k], 0) : stop - self.starts[k]])
        if len(pieces) == 1:
            return np.asarray(pieces[0])
        return np.concatenate(pieces) if pieces else np.empty(0, self.dtype)

    def _gather(self, positions: np.ndarray) -> np.ndarray:
        flat = positions.astype(np.int64).reshape(-1)
        flat = np.where(flat < 0, flat + len(self), flat)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"positions {int(flat.min())}..{int(flat.max())} are outside 0..{len(self) - 1}")
        which = np.searchsorted(self.ends, flat, side="right")  # the file of each position
        out = np.empty(flat.shape, self.dtype)
        for k in np.unique(which):
            here = which == k
            out[here] = self.parts[k][flat[here] - self.starts[k]]
        return out.reshape(positions.shape)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """The whole concatenation (a copy: for tests and small data, not the training path)."""
        whole = np.concatenate(self.parts)
        return whole if dtype is None else whole.astype(dtype)
