"""Which data a `data` setting names, and reading it into a `Corpus` (docs/data.md is the user's page).

    data                                   with a tokenizer               without one
    "builtin"                              tokenized, one document        bytes (workload/data.py)
    X.bin | X.u16 | X.u32 (+ X.json)       used as they are (workload/tokenfiles.py)
    a directory of token files             one array over them, not copied
    a text file (any name)                 tokenized                      bytes, mapped in place
    X.jsonl[#field], X.parquet[#column]    one document a line / row      UTF-8 bytes, "\\n" after each
    a directory of text, JSONL, Parquet    every file's documents         bytes, "\\n" after each

A directory holds token files (directly inside it) or text (read recursively: every non-hidden
file without a NUL byte in its head, sorted by relative path; .jsonl and .parquet files by their
format), never both. JSONL and Parquet keep their text in the field / column "text" unless the
spec names another after a '#': "corpus.jsonl#content", "shards/#body" (a directory: all of its
JSONL and Parquet files). Parquet needs pyarrow (`pip install 'dldctl[data]'`), imported only
when Parquet data is read.

Tokenizing is workload/tokenized.py's (cached once per host); a byte corpus made of several
files or documents is cached by `data.cached_bytes`. Every bad input is one ValueError (or
FileNotFoundError) line naming the file and what to do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workload import tokenfiles, tokenized
from workload.data import (
    DEFAULT_BIN_VOCAB,
    SEPARATOR,
    Corpus,
    builtin_corpus,
    cached_bytes,
    check_byte_vocab,
)

TEXT_FIELD = "text"  # where JSONL and Parquet keep the text unless the spec says '#field'
DOCUMENT_SUFFIXES = (".jsonl", ".parquet")
PARQUET_BATCH = 1024  # rows per read
NEEDS_PYARROW = "pip install 'dldctl[data]'"


@dataclass(frozen=True)
class Source:
    """What a data spec names: its path (None: the built-in corpus), shape and text field."""

    spec: str
    path: Path | None
    shape: str  # "builtin" | "tokens" | "token-dir" | "text" | "jsonl" | "parquet" | "text-dir"
    field: str = TEXT_FIELD

    @property
    def tokens(self) -> bool:
        """Already token ids: read as they are, whatever the tokenizer."""
        return self.shape in ("tokens", "token-dir")


def source(spec: str) -> Source:
    """Resolve `spec`: FileNotFoundError when it is not there, ValueError when it cannot be data."""
    if spec == "builtin":
        return Source(spec, None, "builtin")
    path, field, named = _split_field(spec)
    if not path.exists():
        raise FileNotFoundError(
            f'data {spec!r}: no such file or directory ({path.resolve()}); use "builtin", token files, '
            "a directory of them, or text, JSONL or Parquet (docs/data.md)"
        )
    if path.is_dir():
        shape = "token-dir" if tokenfiles.shard_files(path) else "text-dir"
    elif not path.is_file():
        raise ValueError(f"data {str(path)!r}: not a regular file or directory")
    elif path.stat().st_size == 0:
        raise ValueError(f"data {str(path)!r}: the file is empty")
    elif tokenfiles.is_token_file(path):
        shape = "tokens"
    else:
        shape = {".jsonl": "jsonl", ".parquet": "parquet"}.get(path.suffix, "text")
    if named and shape not in ("jsonl", "parquet", "text-dir"):
        raise ValueError(
            f"data {spec!r}: a '#field' suffix names the text field of JSONL or Parquet data, "
            f"but {path.name} is {shape.replace('-', ' ')} data; drop the suffix"
        )
    return Source(spec, path, shape, field)


def _split_field(spec: str) -> tuple[Path, str, bool]:
    """'data.jsonl#content' -> (data.jsonl, "content", True); a path that exists as written wins."""
    path = Path(spec).expanduser()
    if "#" not in spec or path.exists():
        return path, TEXT_FIELD, False
    head, _, field = spec.rpartition("#")
    base = Path(head).expanduser()
    if not head or not (base.suffix in DOCUMENT_SUFFIXES or base.exists()):
        return path, TEXT_FIELD, False
    if not field.strip():
        raise ValueError(f"data {spec!r}: nothing after '#'; write {head}#FIELD, the field that holds the text")
    return base, field, True


# --------------------------------------------------------------------------- the built-in GPT's entry


def load(
    spec: str, *, vocab_size: int | None = None, cache_dir: str | None = None, tokenizer: str | None = None
) -> Corpus:
    """`data.load_corpus`: the corpus `spec` for a model whose vocabulary follows the data unless
    `vocab_size` is given (then every id must be below it)."""
    src = source(spec)
    if src.tokens:
        return _fit_tokens(open_tokens(src, cache_dir), vocab_size)
    if tokenizer:
        tokenizer_json = tokenizer_path(tokenizer)
        corpus, info = tokenized.tokenize(tokenizer_json, text_of(src, cache_dir), cache_dir)
        top = int(info["max_token"])
        if vocab_size is not None and top >= vocab_size:
            raise ValueError(
                f"data {spec!r}: tokenizer {tokenizer_json} gives token id {top}, not < vocab_size {vocab_size}; "
                f"set vocab_size to at least {top + 1}, or leave it out (the tokenizer's: {corpus.vocab_size})"
            )
        return dataclasses.replace(corpus, vocab_size=corpus.vocab_size if vocab_size is None else vocab_size)
    check_byte_vocab(vocab_size, spec)
    return bytes_corpus(src, vocab_size, cache_dir)


def tokenizer_path(setting: str) -> Path:
    """The tokenizer.json a `tokenizer` setting names (the file, or a directory holding it)."""
    path = Path(setting).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer {setting!r}: no such file ({path.resolve()}); set tokenizer to a tokenizers "
            'tokenizer.json (or a directory holding one), or to "" to read text as bytes'
        )
    return path


def open_tokens(src: Source, cache_dir: str | None) -> tokenfiles.TokenData:
    assert src.path is not None
    if src.shape == "token-dir":
        return tokenfiles.open_dir(src.path, cache_dir)
    return tokenfiles.open_file(src.path, cache_dir)


def _fit_tokens(data: tokenfiles.TokenData, vocab_size: int | None) -> Corpus:
    """A model vocabulary for token files: `vocab_size` if given, else the metadata's, else 50304 for
    a bare .bin (nanoGPT's), else the largest id + 1 rounded up to a multiple of 64."""
    meta, name = data.meta, str(data.top_file)
    bare = meta.metadata is None and data.top_file.suffix == ".bin"
    if vocab_size is not None and bare and not 2 <= vocab_size <= 65536:
        raise ValueError(f"data {name!r}: vocab_size must be in 2..65536 for uint16 tokens, got {vocab_size}")
    if vocab_size is not None:
        vocab, fix = vocab_size, f"set vocab_size to at least {data.top + 1}"
    elif meta.vocab_size is not None:
        vocab, fix = meta.vocab_size, ""  # tokenfiles checked it already
    elif bare:
        vocab, meta_name = DEFAULT_BIN_VOCAB, tokenfiles.metadata_path(data.top_file).name
        fix = f'write its vocab_size in a metadata file {meta_name}: {{"dtype": "uint16", "vocab_size": N}}'
    else:
        vocab, fix = -(-(data.top + 1) // 64) * 64, ""
    if data.top >= vocab:
        raise ValueError(f"data {name!r}: holds token id {data.top}, not < vocab_size {vocab}; {fix}")
    return Corpus(data.tokens, vocab, data.source, data.digest, meta.eos)


# --------------------------------------------------------------------------- text: documents and bytes


def bytes_corpus(src: Source, vocab_size: int | None, cache_dir: str | None) -> Corpus:
    """Text as bytes (vocabulary 256): a file mapped in place; several files or documents joined,
    each followed by a newline, and cached."""
    if src.shape == "builtin":
        return builtin_corpus(vocab_size, cache_dir)
    assert src.path is not None
    if src.shape == "text":
        return Corpus(np.memmap(src.path, dtype=np.uint8, mode="r"), vocab_size or 256, f"text file {src.path}")
    key = f"{src.shape}-" + hashlib.sha256(identity(src).encode()).hexdigest()[:16]

    def read() -> tuple[bytes, dict[str, Any]]:
        parts = [(d.encode() if isinstance(d, str) else bytes(d)) + SEPARATOR for d in documents(src)]
        if not parts:
            what = "no non-empty text files" if src.shape == "text-dir" else f"no documents with a {src.field!r}"
            raise ValueError(f"data {str(src.path)!r}: holds {what}")
        return b"".join(parts), {"documents": len(parts), "field": src.field}

    return cached_bytes(key, describe(src), read, vocab_size, cache_dir)


def text_of(src: Source, cache_dir: str | None) -> tokenized.Text:
    """`src` as text for the tokenizer: its identity for the cache key, and its documents."""
    if src.shape == "builtin":
        base = builtin_corpus(cache_dir=cache_dir)  # bytes, cached: its digest names it
        return tokenized.Text("sha256:" + base.digest, base.source, lambda: [np.asarray(base.tokens)])
    return tokenized.Text(identity(src), describe(src), lambda: documents(src))


def describe(src: Source) -> str:
    field = f" ({src.field!r})" if src.shape in ("jsonl", "parquet") or src.field != TEXT_FIELD else ""
    kind = {"text": "text file", "jsonl": "JSONL", "parquet": "Parquet", "text-dir": "text directory"}
    return f"{kind.get(src.shape, src.shape)} {src.path}{field}"


def identity(src: Source) -> str:
    """What names the text in a cache key: every file's path, size and mtime, and the field."""
    assert src.path is not None
    if src.shape == "text-dir":
        return f"dir:{_dir_key(src.path)}#{src.field}"
    st = src.path.stat()
    return f"file:{src.path.resolve()}:{st.st_size}:{st.st_mtime_ns}#{src.field}"


def _dir_key(root: Path) -> str:
    """A key that changes when any file under `root` is added, removed or modified."""
    h = hashlib.sha256(str(root.resolve()).encode())
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue  # a dangling link: not read either
            h.update(f"{dirpath}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def documents(src: Source) -> Iterator[tokenized.Document]:
    """The documents of text data: a whole file, a JSONL line's field, a Parquet row's column."""
    assert src.path is not None
    if src.shape == "text-dir":
        for path in text_files(src.path):
            yield from _file_documents(path, src.field)
    else:
        yield from _file_documents(src.path, src.field)


def _file_documents(path: Path, field: str) -> Iterator[tokenized.Document]:
    if path.suffix == ".jsonl":
        yield from jsonl_documents(path, field)
    elif path.suffix == ".parquet":
        yield from parquet_documents(path, field)
    else:
        try:
            size = path.stat().st_size
            yield np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        except OSError:
            return  # unreadable (permissions, a dangling link): skipped, deterministically


def text_files(root: Path) -> list[Path]:
    """Non-hidden regular files under `root`, sorted by relative path: .jsonl and .parquet files,
    and others whose first 8 KiB hold no NUL byte."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            path = Path(dirpath) / name
            if name.startswith(".") or not path.is_file():
                continue
            if path.suffix in DOCUMENT_SUFFIXES:
                found.append(path)
                continue
            try:
                with open(path, "rb") as fh:
                    if b"\0" not in fh.read(8192):
                        found.append(path)
            except OSError:
                continue  # unreadable: skipped, like a binary file
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def jsonl_documents(path: Path, field: str) -> Iterator[str]:
    """The string `field` of each line's JSON object (blank lines and null values skipped)."""
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"data {str(path)!r}, line {n}"
            try:
                record = json.loads(line)
            except ValueError as exc:
                first = str(exc).split("\n")[0][:120]
                raise ValueError(f"{where}: not JSON ({first}); JSONL holds one JSON object a line") from None
            if not isinstance(record, dict) or field not in record:
                has = ", ".join(map(repr, list(record)[:8])) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{where}: no field {field!r} (it has {has}); name the field that holds the text: {path}#FIELD"
                )
            value = record[field]
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"{where}: field {field!r} is a {type(value).__name__}, not text")
            yield value


def parquet_documents(path: Path, column: str) -> Iterator[str]:
    """The string `column` of each row (nulls skipped), read a batch of rows at a time."""
    pq = _pyarrow_parquet(path)
    try:
        parquet = pq.ParquetFile(str(path))
    except Exception as exc:  # pyarrow.ArrowInvalid and friends
        first = str(exc).split("\n")[0][:120]
        raise ValueError(f"data {str(path)!r}: not a Parquet file ({first})") from None
    schema = parquet.schema_arrow
    if column not in schema.names:
        has = ", ".join(map(repr, schema.names[:8]))
        raise ValueError(
            f"data {str(path)!r}: no column {column!r} (it has {has}); name the column that holds the text: "
            f"{path}#COLUMN"
        )
    kind = str(schema.field(column).type)
    if kind not in ("string", "large_string", "string_view"):
        raise ValueError(f"data {str(path)!r}: column {column!r} holds {kind}, not text")
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH, columns=[column]):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield value


def _pyarrow_parquet(path: Path) -> Any:
    try:
        return importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise ImportError(f"data {str(path)!r} is Parquet, which needs pyarrow: {NEEDS_PYARROW}") from None
