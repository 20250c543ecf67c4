"""`model = "hf:DIR"`: a transformers causal LM built from a config directory (workload/hf.py)
and trained on text tokenized with its tokenizer (workload/tokenized.py). Real transformers and
tokenizers on tiny models (tests/hfmodels.py); nothing is mocked, nothing touches the hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tests.hfmodels import sample_text, tiny_gpt2_dir, tiny_llama_dir
from workload import WorkloadContext, build_workload, hf, resolve, tokenized
from workload import data as data_mod


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private corpus cache per test (the tokenized corpus lands there)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("DLDCTL_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sample_text(tmp_path_factory.mktemp("text") / "sample.txt", size=120_000)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory, text: Path) -> Path:
    """A tiny Llama config directory with a byte-level BPE tokenizer (384 tokens), no weights."""
    return tiny_llama_dir(tmp_path_factory.mktemp("llama"), tokenizer_text=text)


def ctx_for(directory: Path, data: Path | str, **settings: Any) -> WorkloadContext:
    model_args = settings.pop("model_args", {})
    index, shards, batch = settings.pop("learner_index", 0), settings.pop("shards", 2), settings.pop("batch", 4)
    s = {"model": f"hf:{directory}", "data": str(data), "seed": 0, "seq_len": 32, "batch_size": 4}
    s.update(eval_batches=2, **settings)
    return WorkloadContext(
        settings=s,
        learner_index=index,
        shards=shards,
        batch_size=batch,
        device=torch.device("cpu"),
        seed=0,
        model_args=model_args,
    )


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- the model: deterministic, float32, tied once, embeddings named --------------------------------
def test_two_builds_under_one_seed_are_bitwise_equal_and_another_seed_differs(llama: Path) -> None:
    builds = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        builds.append(params(hf.build_model(str(llama), {})))
    a, b, c = builds
    assert list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert all(t.dtype == torch.float32 for t in a.values())
    assert any(not torch.equal(a[n], c[n]) for n in a)


def test_float32_master_weights_whatever_the_config_says(tmp_path: Path) -> None:
    directory = tiny_llama_dir(tmp_path / "m")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    model = hf.build_model(str(directory), {})
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_llama_tied_head_is_listed_once_under_the_embedding(llama: Path) -> None:
    model = hf.build_model(str(llama), {})
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert hf.embedding_names(model) == {"model.embed_tokens.weight"}


def test_an_untied_head_is_not_an_embedding_and_model_overrides_reach_the_model(llama: Path) -> None:
    model = hf.build_model(str(llama), {"tie_word_embeddings": False, "num_hidden_layers": 3})
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" in names and len(model.model.layers) == 3
    assert hf.embedding_names(model) == {"model.embed_tokens.weight"}


def test_gpt2_token_and_position_tables_are_embeddings(tmp_path: Path) -> None:
    model = hf.build_model(str(tiny_gpt2_dir(tmp_path / "g")), {})
    assert hf.embedding_names(model) == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert "lm_head.weight" not in dict(model.named_parameters())
    untied = hf.build_model(str(tiny_gpt2_dir(tmp_path / "u", tie_word_embeddings=False)), {})
    assert "lm_head.weight" in dict(untied.named_parameters())
    assert hf.embedding_names(untied) == {"transformer.wte.weight", "transformer.wpe.weight"}


# -- the loss: y is already shifted ------------------------------------------------------------------
def test_causal_lm_loss_is_cross_entropy_against_y_not_a_second_shift(llama: Path) -> None:
    torch.manual_seed(0)
    model = hf.build_model(str(llama), {})
    seq = torch.randint(0, 384, (2, 17))
    x, y = seq[:, :-1], seq[:, 1:]
    loss = hf.causal_lm_loss(model, (x, y))
    with torch.no_grad():
        logits = model(input_ids=x).logits
    by_hand = F.cross_entropy(logits.reshape(-1, 384), y.reshape(-1))
    torch.testing.assert_close(loss, by_hand)
    double_shift = model(input_ids=x, labels=y).loss  # transformers shifts labels again
    assert abs(loss.item() - double_shift.item()) > 1e-3


# -- data: tokenized once per host, cached, every id inside the vocabulary -----------------------
def test_text_is_tokenized_once_then_memory_mapped(
    llama: Path, text: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = tokenized.load(str(llama), str(text), 384)
    assert first.tokens.dtype == np.uint16 and first.vocab_size == 384
    assert int(first.tokens.max()) < 384 and len(first.tokens) > 20_000
    assert len(list(cache.glob("tok-*.u16"))) == 1 and len(list(cache.glob("tok-*.json"))) == 1

    def no_second_time(*_: object) -> None:
        raise AssertionError("the corpus was tokenized again")

    monkeypatch.setattr(tokenized, "_tokenize", no_second_time)
    again = tokenized.load(str(llama), str(text), 384)
    assert isinstance(again.tokens, np.memmap) and np.array_equal(again.tokens, first.tokens)
    assert again.digest == first.digest


def test_tokenizing_is_deterministic_and_matches_the_tokenizer(llama: Path, text: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    small = tmp_path / "small.txt"
    small.write_text("def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n")
    corpus = tokenized.load(str(llama), str(small), 384)
    expected = Tokenizer.from_file(str(llama / "tokenizer.json")).encode(small.read_text(), add_special_tokens=False)
    assert corpus.tokens.tolist() == expected.ids
    other = tokenized.load(str(llama), str(small), 384, cache_dir=str(tmp_path / "other-cache"))
    assert np.array_equal(other.tokens, corpus.tokens) and other.digest == corpus.digest


def test_a_directory_of_text_files_is_tokenized(llama: Path, tmp_path: Path) -> None:
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("hello world\n" * 200)
    (texts / "b.md").write_text("# notes\n\nsome more text, and numbers 12345\n" * 100)
    corpus = tokenized.load(str(llama), str(texts), 384)
    assert 0 < int(corpus.tokens.max()) < 384 and "tokenized with" in corpus.source


def test_chunks_cut_at_newlines_and_never_inside_a_character() -> None:
    text = ("héllo wörld — ünïcode\n" * 50) + "x" * 100 + "€" * 300  # a last line longer than a chunk
    raw = np.frombuffer(text.encode(), dtype=np.uint8)
    pieces = list(tokenized._chunks(raw, 64))
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert all(p.endswith("\n") for p in pieces[:20]) and len(pieces) > 30  # 2 lines a chunk, then the long one


def test_without_a_tokenizer_the_text_is_bytes(tmp_path: Path, text: Path) -> None:
    corpus = tokenized.load(str(tiny_gpt2_dir(tmp_path / "g")), str(text), 384)
    assert corpus.tokens.dtype == np.uint8 and corpus.vocab_size == 384


def test_a_token_file_is_used_as_is(tmp_path: Path) -> None:
    ids = (np.arange(5000) % 300).astype(np.uint16)
    path = tmp_path / "train.bin"
    ids.tofile(path)
    corpus = tokenized.load(str(tiny_gpt2_dir(tmp_path / "g")), str(path), 384)
    assert corpus.vocab_size == 384 and np.array_equal(corpus.tokens, ids)
    with pytest.raises(ValueError, match=r"holds token id 299, but the model's vocab_size is 200"):
        tokenized.load(str(tmp_path / "g"), str(path), 200)


def test_uint32_tokens_batch_like_uint16(tmp_path: Path) -> None:
    assert tokenized.token_dtype(65536) is np.uint16 and tokenized.token_dtype(65537) is np.uint32
    path = tmp_path / "big.u32"
    (np.arange(4000, dtype=np.uint32) + 100_000).tofile(path)
    tokens = np.memmap(path, dtype=np.uint32, mode="r")
    corpus = data_mod.Corpus(tokens, 200_000, "uint32 test")
    shards, (ev0, ev1) = data_mod.split(corpus, shards=2, eval_fraction=0.1)
    x, y = data_mod.Batches(tokens, *shards[1], batch_size=3, seq_len=8, seed=1).next()
    assert x.dtype == torch.int64 and int(x.min()) >= 100_000 and torch.equal(x[:, 1:], y[:, :-1])
    (ex, ey), *_ = data_mod.eval_batches(tokens, ev0, ev1, batch_size=2, seq_len=8, count=1)
    assert int(ex[0, 0]) == 100_000 + ev0 and torch.equal(ey, ex + 1)


# -- errors: one line naming the directory, the key or the data -----------------------------------
def test_an_unknown_model_key_names_the_field_to_use(llama: Path) -> None:
    with pytest.raises(ValueError) as err:
        hf.load_config(str(llama), {"num_layer": 4})
    assert str(err.value) == "[model] num_layer: LlamaConfig has no such field (did you mean 'num_hidden_layers'?)"
    with pytest.raises(ValueError, match=r"\[model\] torch_dtype: dldctl trains float32"):
        hf.load_config(str(llama), {"torch_dtype": "bfloat16"})
    assert hf.load_config(str(llama), {"num_hidden_layers": 4}).num_hidden_layers == 4


def test_a_model_vocab_smaller_than_the_tokenizer_is_refused(llama: Path, text: Path) -> None:
    with pytest.raises(ValueError) as err:
        tokenized.load(str(llama), str(text), 300)
    line = str(err.value)
    assert line.startswith(f"model directory {llama}: data {str(text)!r}: its tokenizer.json (384 tokens) gives")
    assert "the model's vocab_size is 300" in line and "\n" not in line


def test_bytes_need_256_tokens(tmp_path: Path, text: Path) -> None:
    directory = tiny_llama_dir(tmp_path / "m", vocab_size=128)
    with pytest.raises(ValueError, match=r"has no tokenizer.json, so data .* is read as bytes .* vocab_size is 128"):
        tokenized.load(str(directory), str(text), 128)


def test_a_seq_len_past_the_positions_is_refused(llama: Path, text: Path) -> None:
    with pytest.raises(ValueError, match=r"seq_len 256 is longer than the model's 128 positions"):
        build_workload(ctx_for(llama, text, seq_len=256))


@pytest.mark.parametrize("case", ["missing", "no-config", "remote-code", "not-causal", "unknown-type"])
def test_directories_dldctl_cannot_build_say_why(tmp_path: Path, case: str) -> None:
    directory = tmp_path / "m"
    expect = {
        "missing": "no such directory",
        "no-config": "has no config.json",
        "remote-code": "needs remote code",
        "not-causal": "is not a causal language model",
        "unknown-type": "transformers cannot read config.json",
    }[case]
    if case != "missing":
        directory.mkdir()
    if case == "remote-code":
        tiny_llama_dir(directory)
        raw = json.loads((directory / "config.json").read_text())
        raw["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MyModel"}
        (directory / "config.json").write_text(json.dumps(raw))
    elif case == "not-causal":
        from transformers import T5Config

        T5Config(d_model=32, num_layers=1).save_pretrained(str(directory))
    elif case == "unknown-type":
        (directory / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ValueError) as err:
        hf.load_config(str(directory), {})
    assert str(directory) in str(err.value) and expect in str(err.value) and "\n" not in str(err.value)


# -- the seam: resolve, the model's directory, build_workload end to end -----------------------------
def test_resolve_and_where_the_directory_is(llama: Path, text: Path) -> None:
    assert resolve(f"hf:{llama}") is hf.hf_workload
    assert hf.is_hf("hf:/x") and not hf.is_hf("gpt-tiny") and hf.spec_path("hf:/a/b") == "/a/b"
    with pytest.raises(ValueError, match="names no directory"):
        resolve("hf:")
    ctx = ctx_for(Path("/operator/only/path"), text)
    assert hf.model_dir(ctx) == "/operator/only/path"
    ctx.model_dir = str(llama)  # the run's copy on this host wins over the operator's path
    assert hf.model_dir(ctx) == str(llama)
    assert build_workload(ctx).model is not None


def test_build_workload_trains_an_hf_model(llama: Path, text: Path) -> None:
    w = build_workload(ctx_for(llama, text, learner_index=1, shards=2, batch=8))
    x, y = w.next_batch()
    assert x.shape == y.shape == (8, 32) and x.dtype == torch.int64 and w.tokens((x, y)) == 256
    assert w.embedding_names == {"model.embed_tokens.weight"}

    def eval_loss() -> float:
        with torch.no_grad():
            return sum(w.loss(w.model, b).item() for b in w.eval_batches) / len(w.eval_batches)

    before = eval_loss()
    opt = torch.optim.AdamW(w.model.parameters(), lr=3e-3)
    for _ in range(30):
        loss = w.loss(w.model, w.next_batch())
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = eval_loss()
    assert after < before - 0.5, (before, after)


def test_every_learner_starts_equal_and_scores_the_same_eval_batches(llama: Path, text: Path) -> None:
    a = build_workload(ctx_for(llama, text, learner_index=0, batch=2))
    b = build_workload(ctx_for(llama, text, learner_index=1, batch=6))
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))
    assert all(torch.equal(u[0], v[0]) for u, v in zip(a.eval_batches, b.eval_batches, strict=True))
    assert not torch.equal(a.next_batch()[0][0], b.next_batch()[0][0])
