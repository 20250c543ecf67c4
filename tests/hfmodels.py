"""Tiny Hugging Face model directories and tokenizers for tests (real transformers, built fast).

Tests of `model = "hf:DIR"`, `init_from = DIR` and the Hugging Face export build their inputs
here, on the spot, in a tmp_path: a config.json (no weights, like a team's config directory),
optionally a byte-level BPE tokenizer trained on a small local text. Nothing touches the hub.

- `sample_text(path)`: deterministic English-ish/code text (the Python stdlib's own sources).
- `train_tokenizer(text, out_dir)`: tokenizer.json + the files `AutoTokenizer` loads.
- `tiny_llama_dir(path)` / `tiny_gpt2_dir(path)`: a 2-layer, 64-wide model's config directory.

transformers and tokenizers are imported inside the functions, so importing this module (and
collecting tests that skip without them) needs neither.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

EOS = "<|endoftext|>"  # the one special token of the test tokenizers

# stdlib modules with plenty of prose (docstrings) and code; read in this order, always the same
_SAMPLE_MODULES = ("textwrap.py", "argparse.py", "difflib.py", "inspect.py", "typing.py", "pathlib.py")


def sample_text(path: Path, size: int = 200_000) -> Path:
    """Write `size` bytes of deterministic text (stdlib sources, repeated if short) to `path`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    for name in _SAMPLE_MODULES:
        candidate = root / name
        if not candidate.is_file():  # pathlib is a package on 3.13+: fall back to its __init__
            candidate = root / name.removesuffix(".py") / "__init__.py"
        if candidate.is_file():
            parts.append(candidate.read_bytes())
    blob = b"\n".join(parts) or b"the quick brown fox jumps over the lazy dog\n"
    while len(blob) < size:  # small stdlibs: repeat rather than vary, so it stays deterministic
        blob += b"\n" + blob
    # cut at a line boundary just past `size` so the text stays valid UTF-8
    cut = blob.find(b"\n", size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob if cut < 0 else blob[: cut + 1])
    return path


def train_tokenizer(text_file: Path, out_dir: Path, vocab_size: int = 384) -> None:
    """A byte-level BPE trained on `text_file`, saved in out_dir (tokenizer.json + AutoTokenizer files)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown tokens
        show_progress=False,
    )
    tok.train([str(text_file)], trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    fast.save_pretrained(str(out_dir))
    if not (out_dir / "tokenizer.json").is_file():  # save_pretrained writes it; make sure regardless
        tok.save(str(out_dir / "tokenizer.json"))


def _eos_id(path: Path) -> int | None:
    from tokenizers import Tokenizer

    tokenizer_json = path / "tokenizer.json"
    return Tokenizer.from_file(str(tokenizer_json)).token_to_id(EOS) if tokenizer_json.is_file() else None


def tiny_llama_dir(path: Path, vocab_size: int = 384, tokenizer_text: Path | None = None) -> Path:
    """A tiny LlamaConfig (64 wide, 2 layers, GQA 4/2 heads, tied embeddings) saved in `path`, no weights."""
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_text is not None:
        train_tokenizer(tokenizer_text, path, vocab_size=vocab_size)
    eos = _eos_id(path)
    LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
    ).save_pretrained(str(path))
    return path


def tiny_gpt2_dir(
    path: Path, vocab_size: int = 384, tokenizer_text: Path | None = None, tie_word_embeddings: bool = True
) -> Path:
    """A tiny GPT2Config (64 wide, 2 layers, 2 heads, 128 positions) saved in `path`, no weights."""
    from transformers import GPT2Config

    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_text is not None:
        train_tokenizer(tokenizer_text, path, vocab_size=vocab_size)
    eos = _eos_id(path)
    GPT2Config(
        vocab_size=vocab_size,
        n_embd=64,
        n_layer=2,
        n_head=2,
        n_positions=128,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos if eos is not None else 0,
        eos_token_id=eos if eos is not None else 0,
    ).save_pretrained(str(path))
    return path
