"""The data people have (docs/data.md): token files with a metadata file, directories of them read
as one array without copying, and text, JSONL and Parquet tokenized once with a real tokenizer
(tests/hfmodels.py trains a tiny one); every bad input refused in one line naming the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")  # tests/hfmodels.py saves the tokenizer with it

from tests.hfmodels import EOS, sample_text, train_tokenizer
from workload import WorkloadContext, build_workload, datasets, tokenfiles, tokenized
from workload import data as D


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("DLDCTL_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json of a byte-level BPE (384 tokens, <|endoftext|> among them)."""
    root = tmp_path_factory.mktemp("tok")
    train_tokenizer(sample_text(root / "sample.txt", size=40_000), root / "t", vocab_size=384)
    return root / "t" / "tokenizer.json"


def encode(tok: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(tok)).encode(text, add_special_tokens=False).ids)


def eos_of(tok: Path) -> int:
    from tokenizers import Tokenizer

    found = Tokenizer.from_file(str(tok)).token_to_id(EOS)
    assert found is not None
    return int(found)


def token_file(path: Path, ids: np.ndarray, **meta: object) -> Path:
    ids.tofile(path)
    if meta:
        tokenfiles.metadata_path(path).write_text(json.dumps(meta))
    return path


DOCS = ["def add(a, b):\n    return a + b\n", "", "héllo wörld, the second document\n", "print(add(2, 3))"]


# -- token files --------------------------------------------------------------------------------------
def test_uint16_and_uint32_token_files_with_metadata(tmp_path: Path) -> None:
    small = token_file(tmp_path / "a.u16", np.arange(2000, dtype=np.uint16), dtype="uint16", vocab_size=2048, eos=7)
    corpus = D.load_corpus(str(small))
    assert corpus.tokens.dtype == np.uint16 and corpus.vocab_size == 2048 and corpus.eos == 7
    big = np.arange(3000, dtype=np.uint32) + 125_000  # ids above 65535 survive
    path = token_file(tmp_path / "b.bin", big, dtype="uint32", vocab_size=128256, eos=128001)
    corpus = D.load_corpus(str(path))
    assert corpus.tokens.dtype == np.uint32 and corpus.vocab_size == 128256 and corpus.eos == 128001
    assert np.array_equal(corpus.tokens, big) and len(corpus.digest) == 64
    x, y = D.Batches(corpus.tokens, 0, 3000, batch_size=2, seq_len=8, seed=0).next()
    assert int(x.min()) >= 125_000 and torch.equal(x[:, 1:], y[:, :-1])
    assert D.load_corpus(str(path), vocab_size=130_000).vocab_size == 130_000  # a larger embedding is fine
    bare = token_file(tmp_path / "c.u32", np.array([5, 70_000], dtype=np.uint32))  # no metadata: the suffix says
    assert D.load_corpus(str(bare)).vocab_size == 70_016  # largest id + 1, rounded up to 64


def test_the_largest_id_is_scanned_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = token_file(tmp_path / "a.u32", np.arange(100, dtype=np.uint32), dtype="uint32", vocab_size=100)
    first = D.load_corpus(str(path))
    monkeypatch.setattr(tokenfiles, "SCAN_CHUNK", 0)  # a second scan would fail (range step 0)
    assert D.load_corpus(str(path)).digest == first.digest


def test_a_directory_of_shards_reads_as_their_concatenation(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 100_000, size=n, dtype=np.uint32) for n in (50, 7, 1, 120)]
    for i, part in enumerate(parts):
        token_file(shards / f"part-{i:03d}.u32", part, dtype="uint32", vocab_size=100_000, eos=3)
    (shards / "val").mkdir()  # subdirectories are not read
    whole = np.concatenate(parts)
    corpus = D.load_corpus(str(shards))
    tokens = corpus.tokens
    assert isinstance(tokens, tokenfiles.TokenShards) and len(tokens) == len(whole) == 178
    assert tokens.dtype == np.uint32 and corpus.vocab_size == 100_000 and corpus.eos == 3
    assert int(tokens[49]) == whole[49] and int(tokens[50]) == whole[50] and int(tokens[-1]) == whole[-1]
    for key in (slice(45, 60), slice(0, 178), slice(56, 59), slice(170, 400), slice(10, 5), slice(3, 170, 7)):
        assert np.array_equal(tokens[key], whole[key]), key
    starts = np.array([0, 45, 55, 56, 160])
    idx = starts[:, None] + np.arange(17)[None, :]  # windows across every boundary, as _windows gathers
    assert np.array_equal(tokens[idx], whole[idx]) and tokens[idx].shape == (5, 17)
    with pytest.raises(IndexError):
        tokens[np.array([178])]
    got = D.eval_batches(tokens, 100, 178, batch_size=2, seq_len=8, count=2)
    want = D.eval_batches(whole, 100, 178, batch_size=2, seq_len=8, count=2)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))


# -- text through the user's tokenizer ------------------------------------------------------------------
def test_text_jsonl_and_parquet_are_tokenized_with_the_eos_between_documents(tmp_path: Path, tok: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    eos = eos_of(tok)
    want: list[int] = []
    for doc in (d for d in DOCS if d):
        want += ([eos] if want else []) + encode(tok, doc)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "content": d}) + "\n" for i, d in enumerate(DOCS)) + "\n")
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": [*DOCS, None]}), parquet)
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, doc in enumerate(DOCS):
        (texts / f"{i}.txt").write_text(doc)
    for spec in (f"{jsonl}#content", str(parquet), str(texts)):
        corpus = D.load_corpus(spec, tokenizer=str(tok))
        assert corpus.tokens.tolist() == want, spec
        assert corpus.eos == eos and corpus.vocab_size == 384 and corpus.tokens.dtype == np.uint16
    single = tmp_path / "one.txt"
    single.write_text(DOCS[0] * 20)
    assert D.load_corpus(str(single), tokenizer=str(tok)).tokens.tolist() == encode(tok, DOCS[0] * 20)


def test_the_tokenized_corpus_is_cached(
    tmp_path: Path, tok: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    first = D.load_corpus(str(jsonl), tokenizer=str(tok.parent))  # a directory holding tokenizer.json
    (cached,) = cache.glob("tok-*.u16")
    stamp = cached.stat().st_mtime_ns

    def no_second_time(*_: object) -> None:
        raise AssertionError("tokenized again")

    monkeypatch.setattr(tokenized, "_tokenize", no_second_time)
    again = D.load_corpus(str(jsonl), tokenizer=str(tok))
    assert isinstance(again.tokens, np.memmap) and cached.stat().st_mtime_ns == stamp
    assert again.digest == first.digest and again.eos == first.eos
    jsonl.write_text(json.dumps({"text": "changed"}) + "\n")  # a new mtime and size: a new key
    with pytest.raises(AssertionError, match="tokenized again"):
        D.load_corpus(str(jsonl), tokenizer=str(tok))


def test_without_a_tokenizer_documents_are_bytes(tmp_path: Path) -> None:
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    corpus = D.load_corpus(str(jsonl))
    assert bytes(corpus.tokens) == "".join(d + "\n" for d in DOCS).encode() and corpus.vocab_size == 256


def test_both_workloads_take_every_format(tmp_path: Path, tok: Path) -> None:
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d * 30}) + "\n" for d in DOCS))
    s = {"model": "gpt-tiny", "data": str(jsonl), "tokenizer": str(tok), "seed": 0, "seq_len": 16, "batch_size": 2}
    ctx = WorkloadContext(settings=s, learner_index=0, shards=1, batch_size=2, device=torch.device("cpu"), seed=0)
    workload = build_workload(ctx)
    assert workload.model.transformer.wte.weight.shape[0] == 384  # the tokenizer's vocabulary
    assert int(workload.next_batch()[0].max()) < 384
    hf_corpus = tokenized.load(str(tok.parent), str(jsonl), 384)  # an hf: model dir with this tokenizer
    assert hf_corpus.eos == eos_of(tok) and int(hf_corpus.tokens.max()) < 384
    ids = token_file(tmp_path / "t.u32", np.arange(500, dtype=np.uint32), dtype="uint32", vocab_size=500)
    assert tokenized.load(str(tok.parent), str(ids), 512).vocab_size == 512
    with pytest.raises(ValueError, match=r"the file holds token id 499, but the model's vocab_size is 384"):
        tokenized.load(str(tok.parent), str(ids), 384)


# -- every bad input: one line naming the file -----------------------------------------------------------
def refused(spec: Path | str, pattern: str, **kw: Any) -> str:
    with pytest.raises((ValueError, FileNotFoundError, ImportError), match=pattern) as err:
        D.load_corpus(str(spec), **kw)
    line = str(err.value)
    assert "\n" not in line
    return line


def test_a_truncated_file_says_how_many_bytes_are_over(tmp_path: Path) -> None:
    path = tmp_path / "cut.u32"
    path.write_bytes(np.arange(10, dtype=np.uint32).tobytes() + b"\1\2\3")
    line = refused(path, r"3 bytes over")
    assert line.startswith(f"data {str(path)!r}: 43 bytes is not a whole number of uint32 tokens")
    (tmp_path / "empty.u16").write_bytes(b"")
    refused(tmp_path / "empty.u16", r"empty\.u16'?: the file is empty")


def test_a_token_above_the_vocabulary_names_the_id_and_the_file(tmp_path: Path) -> None:
    path = token_file(tmp_path / "a.u32", np.array([1, 2, 128_300], dtype=np.uint32), dtype="uint32", vocab_size=128256)
    refused(path, r"a\.u32'?: holds token id 128300, not < vocab_size 128256 \(its metadata file a\.json\)")
    ok = token_file(tmp_path / "b.u32", np.array([1, 900], dtype=np.uint32), dtype="uint32", vocab_size=1000)
    refused(ok, r"b\.u32'?: holds token id 900, not < vocab_size 512; set vocab_size to at least 901", vocab_size=512)


@pytest.mark.parametrize(
    ("meta", "pattern"),
    [
        ("{not json", r"metadata file x\.json is not JSON"),
        ('{"vocab_size": 10}', r'x\.json: no dtype; write "dtype": "uint16" or "uint32"'),
        ('{"dtype": "int8"}', r"x\.json: dtype 'int8'; write"),
        ('{"dtype": "uint16", "vocab": 10}', r"x\.json: unknown key 'vocab'"),
        ('{"dtype": "uint32"}', r"x\.json: dtype 'uint32' contradicts the file's suffix \.u16"),
        ('{"dtype": "uint16", "vocab_size": 100000}', r"does not fit uint16 ids"),
        ('{"dtype": "uint16", "vocab_size": 10, "eos": 10}', r"eos 10 is not < vocab_size 10"),
    ],
)
def test_a_bad_metadata_file_is_refused(tmp_path: Path, meta: str, pattern: str) -> None:
    path = tmp_path / "x.u16"
    np.arange(5, dtype=np.uint16).tofile(path)
    (tmp_path / "x.json").write_text(meta)
    assert refused(path, pattern).startswith(f"data {str(path)!r}")


def test_a_directory_mixing_dtypes_or_text_names_both_files(tmp_path: Path) -> None:
    token_file(tmp_path / "a.u16", np.arange(5, dtype=np.uint16), dtype="uint16")
    token_file(tmp_path / "b.u32", np.arange(5, dtype=np.uint32), dtype="uint32")
    refused(tmp_path, r"a\.u16 is uint16, vocab_size None, eos None but b\.u32 is uint32")
    (tmp_path / "b.u32").unlink()
    (tmp_path / "b.json").unlink()
    (tmp_path / "notes.txt").write_text("hello")
    refused(tmp_path, r"holds token file a\.u16 and notes\.txt, which is not one")


def test_text_formats_refuse_what_they_cannot_read(tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "a"}\n{"body": "b"}\n')
    refused(jsonl, r"d\.jsonl'?, line 2: no field 'text' \(it has 'body'\); name the field .*d\.jsonl#FIELD")
    jsonl.write_text('{"text": "a"}\n{oops\n')
    refused(jsonl, r"d\.jsonl'?, line 2: not JSON", tokenizer=str(tok))
    text = tmp_path / "t.txt"
    text.write_text("hello")
    refused(f"{text}#body", r"a '#field' suffix names the text field of JSONL or Parquet data")
    refused(text, r"tokenizer '.*nowhere\.json': no such file", tokenizer=str(tmp_path / "nowhere.json"))
    parquet = tmp_path / "p.parquet"
    parquet.write_bytes(b"PAR1 not really")
    refused(parquet, r"p\.parquet'?: not a Parquet file")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    refused(parquet, r"p\.parquet'? is Parquet, which needs pyarrow: pip install 'dldctl\[data\]'")


def test_a_spec_splits_its_field_only_for_documents(tmp_path: Path) -> None:
    (tmp_path / "a#b.txt").write_text("x")
    assert datasets.source(str(tmp_path / "a#b.txt")).shape == "text"  # a path that exists wins
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"t": "x"}\n')
    src = datasets.source(f"{jsonl}#t")
    assert (src.path, src.field, src.shape) == (jsonl, "t", "jsonl")
    with pytest.raises(FileNotFoundError, match=r"gone\.jsonl"):
        datasets.source(str(tmp_path / "gone.jsonl#t"))
