"""The workload seam: the built-in GPT workload, resolving model specs, the example factory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import workload as W

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small text corpus (fast to load): the repo's own learner sources, repeated."""
    text = b"".join(p.read_bytes() for p in sorted((REPO / "learner").glob("*.py"))) * 4
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(text)
    return str(path)


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))


def _ctx(
    data: str, index: int = 0, *, model: str = "gpt-tiny", seed: int = 0, batch_size: int = 4, data_seed: int = 0
) -> W.WorkloadContext:
    settings = {
        "model": model,
        "data": data,
        "seed": seed,
        "seq_len": 32,
        "batch_size": 8,
        "eval_batches": 2,
        "lr": 3e-3,
    }
    return W.WorkloadContext(
        settings=settings,
        learner_index=index,
        shards=2,
        batch_size=batch_size,
        device=torch.device("cpu"),
        seed=data_seed,
    )


def test_gpt_workload_builds_on_cpu(corpus_file: str) -> None:
    w = W.build_workload(_ctx(corpus_file))
    assert isinstance(w.model, torch.nn.Module)
    assert next(w.model.parameters()).device.type == "cpu"
    batch = w.next_batch()
    assert batch[0].shape == (4, 32) and w.tokens(batch) == 4 * 32
    loss = w.loss(w.model, batch)
    assert loss.dim() == 0 and loss.requires_grad
    assert len(w.eval_batches) == 2 and w.eval_batches[0][0].shape == (8, 32)  # the run's batch size
    assert w.embedding_names == {"transformer.wte.weight", "transformer.wpe.weight"}


def test_two_learners_same_init_different_batches(corpus_file: str) -> None:
    a = W.build_workload(_ctx(corpus_file, 0, batch_size=4))
    b = W.build_workload(_ctx(corpus_file, 1, batch_size=2))  # another host, another batch size
    for (na, pa), (nb, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(a.next_batch()[0][:2], b.next_batch()[0])
    for (xa, ya), (xb, yb) in zip(a.eval_batches, b.eval_batches):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    c = W.build_workload(_ctx(corpus_file, 0, seed=1))
    assert not torch.equal(a.model.transformer.wte.weight, c.model.transformer.wte.weight)


def test_data_seed_changes_the_batch_order(corpus_file: str) -> None:
    a = W.build_workload(_ctx(corpus_file, 0, data_seed=0)).next_batch()[0]
    b = W.build_workload(_ctx(corpus_file, 0, data_seed=0)).next_batch()[0]
    c = W.build_workload(_ctx(corpus_file, 0, data_seed=1)).next_batch()[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert W.batch_seed(0, 0) != W.batch_seed(0, 1) != W.batch_seed(1, 0)


def test_resolve_presets_and_the_example() -> None:
    assert W.resolve("gpt-small") is W.gpt_workload
    factory = W.resolve("examples.custom_model:factory")
    assert callable(factory) and factory.__name__ == "factory"


def test_example_factory_trains(corpus_file: str) -> None:
    ctx = _ctx(corpus_file, 1, model="examples.custom_model:factory")
    w = W.build_workload(ctx)
    w2 = W.build_workload(ctx)
    for pa, pb in zip(w.model.parameters(), w2.model.parameters()):
        assert torch.equal(pa, pb)
    opt = torch.optim.AdamW(w.model.parameters(), lr=1e-2)
    batch = w.next_batch()
    first = w.loss(w.model, batch).item()
    for _ in range(10):
        opt.zero_grad(set_to_none=True)
        w.loss(w.model, batch).backward()
        opt.step()
    assert w.loss(w.model, batch).item() < first
    assert w.tokens(batch) == batch[0].numel() and w.embedding_names == {"embed.weight"}


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("nope", ValueError, r"'nope'.*gpt-tiny.*package\.module:factory"),
        ("gpt-huge", ValueError, r"'gpt-huge'.*gpt-small"),
        ("x.y:z", ImportError, r"'x\.y:z'.*cannot import module 'x\.y'.*\[run\] workdir"),
        ("os:path", ValueError, r"'os:path'.*module, not a callable factory"),
        ("os:nothing_here", ImportError, r"has no attribute 'nothing_here'"),
        ("os:", ValueError, r"malformed"),
        (":f", ValueError, r"malformed"),
    ],
)
def test_bad_specs_say_what_to_fix(spec: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        W.resolve(spec)


def test_factory_returning_the_wrong_thing(corpus_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = type(sys)("bad_factory_mod")
    module.factory = lambda ctx: torch.nn.Linear(2, 2)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "bad_factory_mod", module)
    with pytest.raises(ValueError, match=r"bad_factory_mod:factory.*returned Linear"):
        W.build_workload(_ctx(corpus_file, model="bad_factory_mod:factory"))


def test_learner_index_outside_the_shards(corpus_file: str) -> None:
    with pytest.raises(ValueError, match="learner_index 2"):
        W.build_workload(_ctx(corpus_file, 2))
