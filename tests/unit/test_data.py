"""Corpora (builtin, text, dir, .bin), the on-disk cache, shards, eval slice and batches."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from workload import data as D


@pytest.fixture(scope="module")
def builtin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cold build of the builtin corpus for this module."""
    root = tmp_path_factory.mktemp("cache")
    D.load_corpus("builtin", cache_dir=str(root))
    return root


def test_builtin_loads_as_bytes(builtin_cache: Path) -> None:
    corpus = D.load_corpus("builtin", cache_dir=str(builtin_cache))
    assert corpus.vocab_size == 256
    assert corpus.tokens.dtype == np.uint8
    assert 1_000_000 < len(corpus.tokens) <= D.BUILTIN_MAX_BYTES
    assert isinstance(corpus.tokens, np.memmap)
    assert b"def " in bytes(corpus.tokens[:200_000])
    assert len(corpus.digest) == 64


def test_builtin_second_load_hits_the_cache(builtin_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (sidecar,) = builtin_cache.glob("builtin-*.json")
    info = json.loads(sidecar.read_text())
    assert info["bytes"] == (builtin_cache / (sidecar.stem + ".u8")).stat().st_size
    assert not list(builtin_cache.glob(".*tmp"))  # no temporary files left behind

    def fail(*_a: object, **_k: object) -> None:
        raise AssertionError("re-read the stdlib on a warm cache")

    monkeypatch.setattr(D, "stdlib_sources", fail)
    monkeypatch.setattr(D, "_read_builtin", fail)
    corpus = D.load_corpus("builtin", cache_dir=str(builtin_cache))
    assert corpus.digest == info["sha256"] and len(corpus.tokens) == info["bytes"]


def test_env_var_picks_the_cache_dir(builtin_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLDCTL_CACHE", str(builtin_cache))
    assert D.cache_root() == builtin_cache
    monkeypatch.setattr(D, "_read_builtin", lambda: pytest.fail("cache missed"))
    D.load_corpus("builtin")


def test_stdlib_sources_sorted_without_site_packages() -> None:
    paths = D.stdlib_sources()
    assert paths and all("site-packages" not in p.parts and "test" not in p.parts for p in paths)
    assert all(p.suffix == ".py" for p in paths)


def test_corrupt_cache_entry_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "_read_builtin", lambda: (b"x = 1\n" * 1000, {}))
    first = D.load_corpus("builtin", cache_dir=str(tmp_path))
    (raw,) = tmp_path.glob("builtin-*.u8")
    raw.write_bytes(b"truncated")
    again = D.load_corpus("builtin", cache_dir=str(tmp_path))
    assert len(again.tokens) == len(first.tokens) == 6000


def test_split_shards_disjoint_cover_train_and_eval_apart() -> None:
    corpus = D.Corpus(np.zeros(10_007, np.uint8), 256, "zeros")
    for shards in (1, 3, 4):
        train, (e0, e1) = D.split(corpus, shards=shards)
        assert train[0][0] == 0 and train[-1][1] == e0 and e1 == 10_007
        assert all(a[1] == b[0] for a, b in itertools.pairwise(train))  # contiguous, disjoint, no gap
        assert all(stop > start for start, stop in train)
        assert (e0, e1) == D.split(corpus, shards=1)[1]  # eval slice independent of the fleet
    assert D.split(corpus, shards=2, eval_fraction=0.5, max_eval_tokens=100)[1] == (9_907, 10_007)
    with pytest.raises(ValueError, match="shards"):
        D.split(corpus, shards=0)


def _tokens(n: int = 5000) -> np.ndarray:
    return np.arange(n, dtype=np.uint16)  # token value = its position


def test_batches_deterministic_exact_and_inside_the_shard() -> None:
    toks = _tokens()
    a = D.Batches(toks, 1000, 2000, batch_size=8, seq_len=16, seed=3)
    b = D.Batches(toks, 1000, 2000, batch_size=8, seq_len=16, seed=3)
    c = D.Batches(toks, 1000, 2000, batch_size=8, seq_len=16, seed=4)
    assert a.tokens_per_batch == 8 * 16
    for _ in range(20):
        (xa, ya), (xb, yb) = a.next(), next(b)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.shape == ya.shape == (8, 16) and xa.dtype == torch.int64 and xa.is_contiguous()
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # y is x shifted by one
        assert xa.numel() == a.tokens_per_batch
        assert int(xa.min()) >= 1000 and int(ya.max()) <= 1999  # inside the shard [1000, 2000)
        assert torch.equal(xa, xa[:, :1] + torch.arange(16))  # contiguous windows
    assert not torch.equal(a.next()[0], c.next()[0])


def test_batches_never_leave_the_shard() -> None:
    toks = np.zeros(3000, np.uint8)
    toks[1000:1100] = 7
    batches = D.Batches(toks, 1000, 1100, batch_size=64, seq_len=99, seed=0)
    for _ in range(10):
        x, y = batches.next()
        assert bool((x == 7).all()) and bool((y == 7).all())
    with pytest.raises(ValueError, match="fewer than seq_len"):
        D.Batches(toks, 1000, 1100, batch_size=1, seq_len=100, seed=0)


def test_eval_batches_fixed_and_inside_the_slice() -> None:
    toks = _tokens()
    a = D.eval_batches(toks, 4000, 5000, batch_size=4, seq_len=32, count=3, device="cpu")
    b = D.eval_batches(toks, 4000, 5000, batch_size=4, seq_len=32, count=3, device=torch.device("cpu"))
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and xa.shape == (4, 32)
    assert int(a[0][0][0, 0]) == toks[4000] and int(a[-1][1][-1, -1]) == toks[4999]


def test_text_file_and_directory(tmp_path: Path) -> None:
    text = tmp_path / "book.txt"
    text.write_bytes("héllo world\n".encode() * 100)
    corpus = D.load_corpus(str(text))
    assert corpus.vocab_size == 256 and bytes(corpus.tokens[:6]) == "héllo".encode()
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "b.md").write_text("bbbb")
    (docs / "a.txt").write_text("aaaa")
    (docs / "sub" / "c.txt").write_text("cccc")
    (docs / ".hidden").write_text("secret")
    (docs / "blob.dat").write_bytes(b"\0\1\2")
    corpus = D.load_corpus(str(docs), cache_dir=str(tmp_path / "cache"))
    assert bytes(corpus.tokens) == b"aaaa\nbbbb\ncccc\n"
    (docs / "a.txt").write_text("AAAAA")  # changed: the cache key changes
    assert bytes(D.load_corpus(str(docs), cache_dir=str(tmp_path / "cache")).tokens).startswith(b"AAAAA\n")


def test_uint16_bin(tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    np.array([1, 2, 50000, 3], dtype=np.uint16).tofile(path)
    corpus = D.load_corpus(str(path), cache_dir=str(tmp_path / "c"))
    assert corpus.vocab_size == 50304 and corpus.tokens.dtype == np.uint16
    assert corpus.tokens.tolist() == [1, 2, 50000, 3]
    with pytest.raises(ValueError, match=r"train\.bin.*50000.*vocab_size 1000"):
        D.load_corpus(str(path), vocab_size=1000, cache_dir=str(tmp_path / "c"))
    x, _y = D.Batches(corpus.tokens, 0, 4, batch_size=2, seq_len=3, seed=0).next()
    assert x.dtype == torch.int64 and x.tolist()[0] == [1, 2, 50000]


def test_bad_inputs_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(FileNotFoundError, match=r"nowhere.txt"):
        D.load_corpus(str(missing))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.txt.*empty"):
        D.load_corpus(str(empty))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\1\2\3")
    with pytest.raises(ValueError, match=r"odd.bin.*odd"):
        D.load_corpus(str(odd))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="emptydir"):
        D.load_corpus(str(tmp_path / "emptydir"), cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="vocab_size must be >= 256"):
        D.load_corpus("builtin", vocab_size=100)
