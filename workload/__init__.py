"""The seam between the training loop and what it trains: a `Workload`.

The training loop knows nothing about GPTs or corpora. It asks `build_workload(ctx)` for a
model (already on the device), a way to get the next training batch, the loss of a batch, the
exact token count of a batch, fixed eval batches, and which parameters are embedding tables
(merged by a plain mean instead of RDA). The run's `model` setting picks the factory:

    "gpt-tiny" | "gpt-small" | "gpt-medium" | "gpt2-124m"   -> gpt_workload (the built-in)
    "hf:DIR"                                                 -> hf.hf_workload: a transformers causal
                                                                LM from DIR's config.json (workload/hf.py)
    "package.module:factory"                                 -> a user's own, see docs/custom-model.md

Contract every factory keeps (the syncer and the merge depend on it):
- deterministic init: the same `settings["seed"]` gives bitwise-identical parameters on every
  learner (`build_workload` seeds torch first; build on the CPU, then move to the device);
- tokens are counted exactly (they weight the merge and feed goodput);
- `eval_batches` are identical on every learner, whatever its index, seed, batch size or device.

Importing this package needs no torch (only calling into it does): the operator's machine reads
`workload.presets` to validate an inventory and may have no torch at all (`pip install dldctl`
without the `train` extra). torch, `workload.data` and `workload.gpt` are imported where used.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workload.presets import PRESETS

if TYPE_CHECKING:
    import torch

    from workload.units import UnitFeed


@dataclass
class WorkloadContext:
    """What a factory is given: the run settings and this learner's place in the fleet."""

    settings: dict[str, Any]  # the resolved run settings: model, data, seed, seq_len, lr, batch_size, ...
    learner_index: int  # 0-based; picks the train shard
    shards: int  # how many train shards the corpus is cut into
    batch_size: int  # this learner's batch size (a host may override the run's default)
    device: torch.device
    seed: int  # seeds this learner's random batches: the run's seed, moved by its island rank and restarts
    model_args: dict[str, Any] = field(default_factory=dict)  # the inventory's [model] table, free-form
    model_dir: str | None = None  # an `hf:` model's directory on this host (the run's copy); None: as named
    units: UnitFeed | None = None  # the data ledger's units to train (None: data_order = "shards"); docs/data.md


@dataclass
class Workload:
    """What the training loop trains: the model and everything it needs to feed it."""

    model: torch.nn.Module  # already on ctx.device
    next_batch: Callable[[], Any]  # next training batch, on the device
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]  # scalar training loss of a batch
    tokens: Callable[[Any], int]  # exact tokens in a batch
    eval_batches: list[Any]  # fixed held-out batches (same on every learner)
    embedding_names: set[str] = field(default_factory=set)  # params merged by a plain mean
    state_dict: Callable[[], Any] | None = None  # a loader of its own: its state, saved with the learner's
    load_state_dict: Callable[[Any], None] | None = None  # ... and handed back after a restart


def batch_seed(seed: int, learner_index: int) -> int:
    """A well-mixed 63-bit seed for (seed, learner_index): different learners, unrelated streams."""
    import numpy as np  # here: the operator's commands read workload.presets without numpy

    state = np.random.SeedSequence([int(seed) & (2**63 - 1), int(learner_index)]).generate_state(2)
    return int(state[0]) << 31 ^ int(state[1])


def gpt_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy of (x, y)."""
    loss: torch.Tensor  # given targets, GPT.forward's loss is a tensor (Module.__call__ is typed Any)
    _, loss = model(batch[0], batch[1])
    return loss


def batch_tokens(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Tokens trained on in (x, y): every position of x predicts one target."""
    return int(batch[0].numel())


def shard_batches(
    ctx: WorkloadContext, corpus: Any, seq_len: int, device: torch.device
) -> tuple[Callable[[], Any], list[Any]]:
    """This learner's training batches (the work units the syncer hands it, `ctx.units`; with
    data_order = "shards", or while it holds none, random windows of its shard of `corpus`, a
    `data.Corpus`) and the fleet's held-out batches (the eval tail, at the run's batch size so every learner,
    whatever its own, scores the same text): what the built-in and `hf:` workloads train on."""
    from workload import data as data_mod
    from workload.units import ledger_batches

    shards, (ev0, ev1) = data_mod.split(corpus, shards=ctx.shards)
    start, stop = shards[ctx.learner_index]
    seed = batch_seed(ctx.seed, ctx.learner_index)
    batches = data_mod.Batches(
        corpus.tokens, start, stop, batch_size=ctx.batch_size, seq_len=seq_len, seed=seed, device=device
    )
    next_batch = batches.next if ctx.units is None else ledger_batches(ctx, corpus.tokens, ev0, seq_len, batches.next)
    run_batch = int(ctx.settings.get("batch_size", ctx.batch_size))
    count = int(ctx.settings.get("eval_batches", 4))
    held_out = data_mod.eval_batches(
        corpus.tokens, ev0, ev1, batch_size=run_batch, seq_len=seq_len, count=count, device=device
    )
    return next_batch, held_out


def scoring_context(
    settings: dict[str, Any], model_args: dict[str, Any] | None = None, model_dir: str | None = None
) -> WorkloadContext:
    """The context the syncer's evaluator builds the run's workload in (learner 0 of 1 shard, the
    run's batch size and seed, on the CPU): its `eval_batches` are the held-out batches every
    score of the global model is taken on (the export's check and the benchmarks use it too)."""
    import torch

    return WorkloadContext(
        settings=settings,
        learner_index=0,
        shards=1,
        batch_size=int(settings["batch_size"]),
        device=torch.device("cpu"),
        seed=int(settings["seed"]),
        model_args=dict(model_args or {}),
        model_dir=model_dir,
    )


def gpt_workload(ctx: WorkloadContext) -> Workload:
    """The built-in: a GPT preset on the corpus named by settings["data"], one shard per learner."""
    import torch

    from workload import data as data_mod
    from workload import gpt as model_mod

    s = ctx.settings
    seq_len = int(s.get("seq_len", 128))
    if not 0 <= ctx.learner_index < ctx.shards:
        raise ValueError(f"learner_index {ctx.learner_index} is outside 0..{ctx.shards - 1} (shards={ctx.shards})")
    corpus = data_mod.load_corpus(
        str(s.get("data", "builtin")), vocab_size=s.get("vocab_size"), tokenizer=s.get("tokenizer") or None
    )
    # init on the CPU (CPU and CUDA generators draw differently), then move: same weights everywhere
    model = model_mod.build(str(s["model"]), vocab_size=corpus.vocab_size, block_size=seq_len)
    device = torch.device(ctx.device)
    model.to(device)
    next_batch, held_out = shard_batches(ctx, corpus, seq_len, device)
    return Workload(
        model=model,
        next_batch=next_batch,
        loss=gpt_loss,
        tokens=batch_tokens,
        eval_batches=held_out,
        embedding_names=model.embedding_names(),
    )


def resolve(model: str) -> Callable[[WorkloadContext], Workload]:
    """The factory for a model setting: a GPT preset, "hf:DIR", or "package.module:factory" imported."""
    if model.startswith("hf:"):  # before the ':' split below; transformers is imported only when built
        from workload import hf

        hf.spec_path(model)  # "hf:" with no directory fails here, naming the setting
        return hf.hf_workload
    if ":" not in model:
        if model in PRESETS:
            return gpt_workload
        raise ValueError(
            f"model {model!r} is neither a built-in preset ({', '.join(PRESETS)}), 'hf:DIR' nor "
            "'package.module:factory'; set model to one of those"
        )
    module_name, _, attr = model.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"model {model!r} is malformed: write it as 'package.module:factory'")
    module = _import(model, module_name)
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ImportError(
                f"model {model!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
                f"has no attribute {attr!r}; define factory(ctx) -> Workload there"
            )
        target = getattr(target, part)
    if not callable(target) or isinstance(target, type(os)):
        raise ValueError(
            f"model {model!r}: {module_name}.{attr} is a {type(target).__name__}, not a "
            "callable factory(ctx) -> Workload"
        )
    factory: Callable[[WorkloadContext], Workload] = target  # the user's; only callable() is checked
    return factory


def _import(spec: str, module_name: str) -> Any:
    """importlib.import_module with a message that says what is missing and what to do."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ImportError(
                f"model {spec!r}: cannot import module {module_name!r} ({exc}); put its package in the "
                "run's [run] workdir (shipped to every learner and syncer host and first on their import "
                "path) or install it into this host's Python"
            ) from exc
        raise ImportError(
            f"model {spec!r}: importing {module_name!r} failed: it needs {missing!r}, "
            f"which is not installed in this host's Python ({exc}); install it there"
        ) from exc
    except ImportError as exc:
        raise ImportError(f"model {spec!r}: importing {module_name!r} failed: {exc}") from exc


def build_workload(ctx: WorkloadContext) -> Workload:
    """resolve(settings["model"])(ctx), with torch seeded first so every learner starts equal."""
    import torch

    spec = str(ctx.settings["model"])
    factory = resolve(spec)
    torch.manual_seed(int(ctx.settings.get("seed", 0)))
    workload = factory(ctx)
    _check(spec, workload)
    return workload


def _check(spec: str, w: Any) -> None:
    """Fail early, naming the factory, when it returned something the training loop cannot use."""
    import torch

    if not isinstance(w, Workload):
        raise ValueError(f"model {spec!r}: the factory returned {type(w).__name__}, not workload.Workload")
    if not isinstance(w.model, torch.nn.Module):
        raise ValueError(f"model {spec!r}: Workload.model is a {type(w.model).__name__}, not a torch.nn.Module")
    for name in ("next_batch", "loss", "tokens"):
        if not callable(getattr(w, name)):
            raise ValueError(f"model {spec!r}: Workload.{name} must be callable")
    if not isinstance(w.eval_batches, list):
        raise ValueError(f"model {spec!r}: Workload.eval_batches must be a list of batches")
    unknown = set(w.embedding_names) - {n for n, _ in w.model.named_parameters()}
    if unknown:
        raise ValueError(f"model {spec!r}: embedding_names {sorted(unknown)} are not parameters of the model")
