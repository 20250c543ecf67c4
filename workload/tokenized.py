"""Text tokenized with a tokenizer.json, once per host, cached and memory-mapped; and the data of
an `hf:` model (its directory's tokenizer.json), which reads every format the built-in does.

    `tokenize(tokenizer_json, text, cache_dir)`  any `Text` (documents from workload/datasets.py:
                                                 a text file, a directory, JSONL, Parquet, builtin)
    `load(model_dir, spec, vocab_size)`          an `hf:` model's data: token files and directories
                                                 used as they are; text tokenized with the model's
                                                 tokenizer.json, or read as bytes without one

Documents (files of a directory, JSONL lines, Parquet rows) are separated by the tokenizer's
end-of-document token when its vocabulary has one (`EOS_NAMES`, the first found); it becomes
`Corpus.eos`. Every token id must be < the model's vocab_size (a tokenizer larger than the
model's embedding table would index past it): a ValueError names the model directory and data.

The cache (`data.cache_root()`: $DLDCTL_CACHE or ~/.cache/dldctl) holds `tok-<key>.u16|u32` and
a JSON sidecar; key = sha256(format, tokenizer.json, the text's identity: the sha256 of the
prepared bytes for builtin, path + size + mtime of every file otherwise, and the JSONL field or
Parquet column). Changing any of them tokenizes again. The tokens are written to a temporary
file and renamed into place, then the sidecar (which commits the entry), so learners starting
together on a host may race and both write the same bytes. Tokenizing runs in ~1 MB pieces cut
after a newline (`encode_batch`, no special tokens), which makes it deterministic and bounded in
memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from syncer.common.atomic import atomic_file, atomic_write
from workload.data import SHARED_MODE, Corpus, cache_root

TOKENIZED_FORMAT = 2  # bump when the cached layout, the chunking or the document separation changes
CHUNK_BYTES = 1 << 20  # text per encode; cut after the last newline inside it
BATCH_CHARS = 8 << 20  # text per encode_batch (tokenizers runs its pieces on its own threads)
BATCH_PIECES = 4096  # ... or this many pieces (many short documents)
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")  # the end-of-document token, if any
_UINT16_VOCAB = 1 << 16

Document = str | np.ndarray  # a document's text: a str, or its UTF-8 bytes as uint8 (a memmap)


@dataclass(frozen=True)
class Text:
    """Text to tokenize: what names it in the cache key, what to call it, and its documents."""

    identity: str
    source: str
    documents: Callable[[], Iterable[Document]]


def token_dtype(vocab_size: int) -> type[np.unsignedinteger[Any]]:
    """The narrowest dtype that holds ids 0..vocab_size-1: uint16 up to 65536, else uint32."""
    return np.uint16 if vocab_size <= _UINT16_VOCAB else np.uint32


# --------------------------------------------------------------------------- an hf: model's data


def load(model_dir: str, spec: str, vocab_size: int, cache_dir: str | None = None) -> Corpus:
    """The corpus `spec` for the model in `model_dir` (config vocab `vocab_size`), as token ids."""
    from workload import datasets  # it imports this module

    tokenizer_json = Path(model_dir) / "tokenizer.json"
    src = datasets.source(spec)
    if src.tokens:
        data = datasets.open_tokens(src, cache_dir)
        where = "the file holds" if data.top_file == src.path else f"its file {data.top_file.name} holds"
        _check_ids(model_dir, spec, data.top, vocab_size, where)
        return Corpus(data.tokens, vocab_size, data.source, data.digest, data.meta.eos)
    if not tokenizer_json.is_file():
        if vocab_size < 256:
            raise ValueError(
                f"model directory {model_dir} has no tokenizer.json, so data {spec!r} is read as bytes "
                f"(ids 0..255), but its vocab_size is {vocab_size}; add the model's tokenizer.json or set "
                "vocab_size >= 256 in [model]"
            )
        return datasets.bytes_corpus(src, vocab_size, cache_dir)
    corpus, info = tokenize(tokenizer_json, datasets.text_of(src, cache_dir), cache_dir, model_dir)
    where = f"its tokenizer.json ({info['tokenizer_vocab']} tokens) gives"
    _check_ids(model_dir, spec, int(info["max_token"]), vocab_size, where)
    return dataclasses.replace(corpus, vocab_size=vocab_size)


def _check_ids(model_dir: str, spec: str, top: int, vocab_size: int, where: str) -> None:
    if top >= vocab_size:
        raise ValueError(
            f"model directory {model_dir}: data {spec!r}: {where} token id {top}, but the model's vocab_size is "
            f"{vocab_size}; use the model's own tokenizer, or set vocab_size >= {top + 1} in [model]"
        )


# --------------------------------------------------------------------------- tokenize once, cached


def tokenize(
    tokenizer_json: Path, text: Text, cache_dir: str | None = None, model_dir: str | None = None
) -> tuple[Corpus, dict[str, Any]]:
    """`text` tokenized with `tokenizer_json` (from the cache when it is there) as a Corpus with the
    tokenizer's vocabulary and eos, and the cache sidecar's facts (max_token, tokenizer_vocab)."""
    h = hashlib.sha256(f"{TOKENIZED_FORMAT}:{CHUNK_BYTES}\0".encode())
    h.update(hashlib.sha256(tokenizer_json.read_bytes()).digest())
    h.update(text.identity.encode())
    key = "tok-" + h.hexdigest()[:24]
    root = cache_root(cache_dir)
    hit = _open_cached(root, key)
    if hit is None:
        hit = _prepare(root, key, tokenizer_json, text, model_dir)
    tokens, info = hit
    eos = None if info.get("eos") is None else int(info["eos"])
    source = f"{text.source}, tokenized with {tokenizer_json}"
    return Corpus(tokens, int(info["tokenizer_vocab"]), source, str(info["sha256"]), eos), info


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
    root: Path, key: str, tokenizer_json: Path, text: Text, model_dir: str | None
) -> tuple[np.ndarray, dict[str, Any]]:
    """Tokenize `text` into the cache (tokens, then the sidecar); from memory if it cannot be written."""
    tokenizer = load_tokenizer(tokenizer_json, model_dir)
    dtype = np.dtype(token_dtype(int(tokenizer.get_vocab_size(with_added_tokens=True))))
    raw = root / f"{key}.{_suffix(dtype)}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with atomic_file(raw, SHARED_MODE) as fh:
            info = _tokenize(tokenizer, text, dtype, fh.write)
        info = {**info, "format": TOKENIZED_FORMAT, "tokenizer": str(tokenizer_json), "source": text.source}
        atomic_write(root / f"{key}.json", json.dumps(info, indent=1), SHARED_MODE)  # commits it
        return np.memmap(raw, dtype=dtype, mode="r"), info
    except OSError as exc:  # a read-only or full cache: still train, tokenized in memory
        print(f"dldctl: cannot cache the tokenized corpus in {root} ({exc}); tokenizing in memory", file=sys.stderr)
    parts: list[bytes] = []
    info = _tokenize(tokenizer, text, dtype, parts.append)
    return np.frombuffer(b"".join(parts), dtype=dtype), info


def load_tokenizer(tokenizer_json: Path, model_dir: str | None = None) -> Any:
    """`tokenizers.Tokenizer.from_file`, with one-line errors (not installed, not a tokenizer)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        if model_dir is not None:
            from workload.hf import needs

            raise needs(model_dir, "tokenizers") from None
        raise ImportError(
            f"tokenizer {tokenizer_json} needs the tokenizers package on this host: pip install 'dldctl[data]'"
        ) from None
    try:
        return Tokenizer.from_file(str(tokenizer_json))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        first = str(exc).strip().split("\n")[0][:200]
        raise ValueError(f"{tokenizer_json}: not a tokenizers tokenizer.json ({first})") from None


def eos_id(tokenizer: Any) -> int | None:
    """The id of the tokenizer's end-of-document token (the first of `EOS_NAMES` it knows), or None."""
    for name in EOS_NAMES:
        found = tokenizer.token_to_id(name)
        if found is not None:
            return int(found)
    return None


def _tokenize(tokenizer: Any, text: Text, dtype: np.dtype[Any], write: Callable[[bytes], Any]) -> dict[str, Any]:
    """Encode `text` piece by piece, the eos between documents, writing the ids as `dtype`; the
    sidecar's facts about them."""
    h = hashlib.sha256()
    count = top = 0
    eos = eos_id(tokenizer)
    boundary = np.array([] if eos is None else [eos], dtype=np.int64)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # fast: no offsets
    for batch in _batched(_pieces(text.documents()), BATCH_CHARS, BATCH_PIECES):
        encoded = iter(encode([p for p in batch if p is not None], add_special_tokens=False))
        ids = np.concatenate([boundary if p is None else np.asarray(next(encoded).ids, dtype=np.int64) for p in batch])
        if not len(ids):
            continue
        top = max(top, int(ids.max()))
        if top > np.iinfo(dtype).max:
            raise ValueError(f"{text.source}: token id {top} does not fit {dtype} (the tokenizer's vocab is larger)")
        blob = ids.astype(dtype).tobytes()
        h.update(blob)
        write(blob)
        count += len(ids)
    if not count:
        raise ValueError(f"{text.source}: tokenizes to no tokens at all; is the text empty?")
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    return {
        "tokens": count,
        "max_token": top,
        "dtype": dtype.name,
        "sha256": h.hexdigest(),
        "tokenizer_vocab": vocab,
        "eos": eos,
    }


def _pieces(documents: Iterable[Document]) -> Iterator[str | None]:
    """Each document's text in pieces of about CHUNK_BYTES, and None between two documents (where
    the eos goes); empty documents are skipped, so two boundaries never meet."""
    started = False
    for doc in documents:
        first = True
        for piece in _doc_pieces(doc):
            if not piece:
                continue
            if first and started:
                yield None
            first, started = False, True
            yield piece


def _doc_pieces(doc: Document) -> Iterator[str]:
    if isinstance(doc, str):
        if len(doc) <= CHUNK_BYTES // 4:  # at most 4 UTF-8 bytes a character: one piece
            yield doc
            return
        doc = np.frombuffer(doc.encode("utf-8", errors="replace"), dtype=np.uint8)
    yield from _chunks(doc, CHUNK_BYTES)


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


def _batched(items: Iterator[str | None], max_chars: int, max_items: int) -> Iterator[list[str | None]]:
    """`items` in lists of up to `max_chars` characters or `max_items` items."""
    batch: list[str | None] = []
    size = 0
    for item in items:
        batch.append(item)
        size += len(item) if item else 0
        if size >= max_chars or len(batch) >= max_items:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
