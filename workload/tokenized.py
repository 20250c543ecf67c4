"""The data of an `hf:` model: text tokenized with the model directory's tokenizer, once per host.

    tokenizer.json in the model dir   text data ("builtin", a text file, a directory of text
                                      files: workload/data.py reads them as bytes) is tokenized
                                      with `tokenizers.Tokenizer`, cached, memory-mapped
    no tokenizer.json                 the text is read as bytes (ids 0..255: vocab_size >= 256)
    a .bin token file                 used as is (uint16, nanoGPT's format)

Every token id must be < the model's vocab_size (a tokenizer larger than the model's embedding
table would index past it): a ValueError names the model directory and the data.

The cache (`data.cache_root()`: $DLDCTL_CACHE or ~/.cache/dldctl) holds `tok-<key>.u16|u32` and
a JSON sidecar; key = sha256(tokenizer.json, the data's identity: the sha256 of the prepared
bytes for builtin and directories, path + size + mtime for a text file). The tokens are written
to a temporary file and renamed into place, then the sidecar (which commits the entry), so
learners starting together on a host may race and both write the same bytes. Tokenizing runs in
~1 MB chunks cut after a newline (`encode_batch`, no special tokens), which makes it
deterministic and bounded in memory.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from syncer.common.atomic import atomic_file, atomic_write
from workload import data as data_mod
from workload.data import Corpus

TOKENIZED_FORMAT = 1  # bump when the cached layout or the chunking changes
CHUNK_BYTES = 1 << 20  # text per encode; cut after the last newline inside it
CHUNKS_PER_BATCH = 8  # encode_batch runs these in parallel (tokenizers' own threads)
_UINT16_VOCAB = 1 << 16


def token_dtype(vocab_size: int) -> type[np.unsignedinteger[Any]]:
    """The narrowest dtype that holds ids 0..vocab_size-1: uint16 up to 65536, else uint32."""
    return np.uint16 if vocab_size <= _UINT16_VOCAB else np.uint32


def load(model_dir: str, spec: str, vocab_size: int, cache_dir: str | None = None) -> Corpus:
    """The corpus `spec` for the model in `model_dir` (config vocab `vocab_size`), as token ids."""
    tokenizer_json = Path(model_dir) / "tokenizer.json"
    path = Path(spec).expanduser()
    if spec != "builtin" and path.is_file() and path.suffix == ".bin":
        return _token_file(model_dir, path, vocab_size, cache_dir)
    if not tokenizer_json.is_file():
        if vocab_size < 256:
            raise ValueError(
                f"model directory {model_dir} has no tokenizer.json, so data {spec!r} is read as bytes "
                f"(ids 0..255), but its vocab_size is {vocab_size}; add the model's tokenizer.json or set "
                "vocab_size >= 256 in [model]"
            )
        return data_mod.load_corpus(spec, vocab_size=vocab_size, cache_dir=cache_dir)
    return _tokenized(model_dir, tokenizer_json, spec, vocab_size, cache_dir)


def _token_file(model_dir: str, path: Path, vocab_size: int, cache_dir: str | None) -> Corpus:
    """A uint16 .bin file: its largest id (scanned once, remembered) must be < vocab_size."""
    corpus = data_mod.load_corpus(str(path), vocab_size=_UINT16_VOCAB, cache_dir=cache_dir)  # any uint16 id
    top = data_mod._max_token(path, corpus.tokens, cache_dir)
    _check_ids(model_dir, str(path), top, vocab_size, "the file holds")
    return Corpus(corpus.tokens, vocab_size, corpus.source, corpus.digest)


def _check_ids(model_dir: str, spec: str, top: int, vocab_size: int, where: str) -> None:
    if top >= vocab_size:
        raise ValueError(
            f"model directory {model_dir}: data {spec!r}: {where} token id {top}, but the model's vocab_size is "
            f"{vocab_size}; use the model's own tokenizer, or set vocab_size >= {top + 1} in [model]"
        )


def _identity(spec: str, base: Corpus) -> str:
    """What names the text: the digest of the prepared bytes, else the file's path, size, mtime."""
    if base.digest:
        return "sha256:" + base.digest
    path = Path(spec).expanduser().resolve()
    st = path.stat()
    return f"file:{path}:{st.st_size}:{st.st_mtime_ns}"


def _tokenized(model_dir: str, tokenizer_json: Path, spec: str, vocab_size: int, cache_dir: str | None) -> Corpus:
    base = data_mod.load_corpus(spec, cache_dir=cache_dir)  # text as bytes: builtin and dirs cached there
    recipe = tokenizer_json.read_bytes()
    h = hashlib.sha256(f"{TOKENIZED_FORMAT}:{CHUNK_BYTES}\0".encode())
    h.update(hashlib.sha256(recipe).digest())
    h.update(_identity(spec, base).encode())
    key = "tok-" + h.hexdigest()[:24]
    root = data_mod.cache_root(cache_dir)
    hit = _open_cached(root, key)
    if hit is None:
        hit = _prepare(root, key, tokenizer_json, base, model_dir)
    tokens, info = hit
    _check_ids(
        model_dir,
        spec,
        int(info["max_token"]),
        vocab_size,
        f"its tokenizer.json ({info['tokenizer_vocab']} tokens) gives",
    )
    return Corpus(tokens, vocab_size, f"{base.source}, tokenized with {tokenizer_json}", str(info["sha256"]))


def _open_cached(root: Path, key: str) -> tuple[np.ndarray, dict[str, Any]] | None:
    """The memory-mapped tokens of `key` if its sidecar exists and agrees with them, else None."""
    try:
        info = json.loads((root / f"{key}.json").read_text())
        dtype = np.dtype(info["dtype"])
        raw = root / f"{key}.{_suffix(dtype)}"
        if info.get("format") != TOKENIZED_FORMAT or not info["tokens"]:
            return None
        if raw.stat().st_size != int(info["tokens"]) * dtype.itemsize:
            return None
        return np.memmap(raw, dtype=dtype, mode="r"), info
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _suffix(dtype: np.dtype[Any]) -> str:
    return "u16" if dtype == np.uint16 else "u32"


def _prepare(
    root: Path, key: str, tokenizer_json: Path, base: Corpus, model_dir: str
) -> tuple[np.ndarray, dict[str, Any]]:
    """Tokenize `base` into the cache (tokens, then the sidecar); from memory if it cannot be written."""
    tokenizer = _tokenizer(tokenizer_json, model_dir)
    dtype = np.dtype(token_dtype(int(tokenizer.get_vocab_size(with_added_tokens=True))))
    raw = root / f"{key}.{_suffix(dtype)}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with atomic_file(raw, data_mod.SHARED_MODE) as fh:
            info = _tokenize(tokenizer, base, dtype, fh.write)
        info = {**info, "format": TOKENIZED_FORMAT, "tokenizer": str(tokenizer_json), "source": base.source}
        atomic_write(root / f"{key}.json", json.dumps(info, indent=1), data_mod.SHARED_MODE)  # commits it
        return np.memmap(raw, dtype=dtype, mode="r"), info
    except OSError as exc:  # a read-only or full cache: still train, tokenized in memory
        print(f"dldctl: cannot cache the tokenized corpus in {root} ({exc}); tokenizing in memory", file=sys.stderr)
    parts: list[bytes] = []
    info = _tokenize(tokenizer, base, dtype, parts.append)
    return np.frombuffer(b"".join(parts), dtype=dtype), info


def _tokenizer(tokenizer_json: Path, model_dir: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        from workload.hf import needs

        raise needs(model_dir, "tokenizers") from None
    try:
        return Tokenizer.from_file(str(tokenizer_json))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        first = str(exc).strip().split("\n")[0][:200]
        raise ValueError(f"{tokenizer_json}: not a tokenizers tokenizer.json ({first})") from None


def _tokenize(tokenizer: Any, base: Corpus, dtype: np.dtype[Any], write: Callable[[bytes], Any]) -> dict[str, Any]:
    """Encode `base` chunk by chunk, writing the ids as `dtype`; the sidecar's facts about them."""
    h = hashlib.sha256()
    count = top = 0
    limit = np.iinfo(dtype).max
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # fast: no offsets
    for texts in _batched(_chunks(base.tokens, CHUNK_BYTES), CHUNKS_PER_BATCH):
        for encoding in encode(texts, add_special_tokens=False):
            ids = np.asarray(encoding.ids, dtype=np.int64)
            if not len(ids):
                continue
            top = max(top, int(ids.max()))
            if top > limit:
                raise ValueError(
                    f"{base.source}: token id {top} does not fit {dtype} (the tokenizer's vocab is larger)"
                )
            blob = ids.astype(dtype).tobytes()
            h.update(blob)
            write(blob)
            count += len(ids)
    if not count:
        raise ValueError(f"{base.source}: tokenizes to no tokens at all")
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    return {"tokens": count, "max_token": top, "dtype": dtype.name, "sha256": h.hexdigest(), "tokenizer_vocab": vocab}


def _chunks(text: np.ndarray, size: int) -> Iterator[str]:
    """`text` (uint8) as strings of about `size` bytes, each cut after its last newline (else at a
    UTF-8 character boundary); invalid UTF-8 becomes U+FFFD, the same way every time."""
    n, start = len(text), 0
    while start < n:
        stop = min(start + size, n)
        piece = bytes(text[start:stop])
        if stop < n:
            cut = piece.rfind(b"\n") + 1
            if cut == 0:  # one long line: back off to the start of a UTF-8 character
                cut = len(piece)
                while cut > 1 and piece[cut - 1] & 0xC0 == 0x80:
                    cut -= 1
                cut = cut - 1 if cut > 1 and piece[cut - 1] >= 0xC0 else cut
            piece = piece[:cut]
        start += len(piece)
        yield piece.decode("utf-8", errors="replace")


def _batched(items: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch
