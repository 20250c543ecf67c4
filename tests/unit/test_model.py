"""The nanoGPT-style model: presets, manifest, shapes, causality, deterministic init, learning."""

from __future__ import annotations

import math

import pytest
import torch

from workload import gpt as M
from workload import presets


def _count(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(s) for _, s in shapes)


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small"])
def test_presets_build_and_match_param_shapes(name: str) -> None:
    torch.manual_seed(0)
    model = M.build(name, block_size=32)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert real == M.param_shapes(name, block_size=32)
    assert model.config.block_size == 32


@pytest.mark.parametrize(
    ("name", "vocab", "low", "high"),
    [
        ("gpt-tiny", 256, 50_000, 200_000),
        ("gpt-small", 256, 600_000, 1_100_000),
        ("gpt-medium", 256, 8_000_000, 14_000_000),
        ("gpt2-124m", 50304, 120_000_000, 130_000_000),
    ],
)
def test_param_counts_sane(name: str, vocab: int, low: int, high: int) -> None:
    assert low <= _count(M.param_shapes(name, vocab_size=vocab)) <= high


@pytest.mark.parametrize("name", list(presets.PRESETS))
@pytest.mark.parametrize("vocab, block", [(256, None), (50304, 16)])
def test_the_torch_free_table_matches_the_real_model(name: str, vocab: int, block: int | None) -> None:
    """dldctl validates inventories from workload/presets.py without torch: it must agree with the model."""
    assert presets.param_shapes(name, vocab_size=vocab, block_size=block) == M.param_shapes(
        name, vocab_size=vocab, block_size=block
    )


def test_param_shapes_is_cheap_and_leaves_the_rng_alone() -> None:
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    shapes = M.param_shapes("gpt2-124m", vocab_size=50304)  # 124M params: only possible on meta
    assert torch.equal(torch.rand(4), expected)
    assert shapes[0] == ("transformer.wte.weight", (50304, 768))
    assert ("transformer.wpe.weight", (1024, 768)) in shapes
    assert not any(n.startswith("lm_head") for n, _ in shapes)  # tied: listed once


def test_unknown_preset_and_bad_block_size() -> None:
    with pytest.raises(ValueError, match=r"gpt-tiny.*gpt-small"):
        M.build("gpt-huge")
    with pytest.raises(ValueError, match="block_size 4096"):
        M.build("gpt-tiny", block_size=4096)
    with pytest.raises(ValueError, match="block_size 0"):
        M.param_shapes("gpt-small", block_size=0)


def _tiny(seed: int = 0) -> M.GPT:
    torch.manual_seed(seed)
    return M.build("gpt-tiny", block_size=32)


def test_forward_shapes_and_initial_loss() -> None:
    model = _tiny()
    idx = torch.randint(0, 256, (3, 32))
    logits, loss = model(idx, torch.randint(0, 256, (3, 32)))
    assert logits.shape == (3, 32, 256)
    assert loss is not None and loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.2
    logits, none = model(idx[:, :7])
    assert logits.shape == (3, 7, 256) and none is None
    with pytest.raises(ValueError, match="block_size 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_causal() -> None:
    model = _tiny().eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_same_seed_same_init_bitwise() -> None:
    a, b, c = _tiny(7), _tiny(7), _tiny(8)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(a.transformer.h[0].attn.c_attn.weight, c.transformer.h[0].attn.c_attn.weight)


def test_tied_head_and_embedding_names() -> None:
    model = _tiny()
    assert model.lm_head.weight is model.transformer.wte.weight
    names = {n for n, _ in model.named_parameters()}
    assert model.embedding_names() == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert model.embedding_names() <= names
    assert model.num_params() == _count(M.param_shapes("gpt-tiny", block_size=32))


def test_adamw_steps_lower_the_loss() -> None:
    model = _tiny()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 32), generator=g)
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(15):
        _, loss = model(x, y)
        first = loss.item() if first is None else first
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert model(x, y)[1].item() < first - 0.5


def test_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    model = M.GPT(M.GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, dropout=0.5)).eval()
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], model(idx)[0], rtol=0, atol=0)
