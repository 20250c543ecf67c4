"""Build the run's workload once, as a learner or the syncer's evaluator would on this host, and say
what came out: `python -m workload.probe` reads a JSON spec on stdin and prints one JSON line.

    spec    {"settings": {run settings}, "model_args": {...}, "model_dir": str | null,
             "shards": int (learners in the fleet), "role": "learner" | "syncer"}
    answer  {"ok": true, "tensors": int, "params": int, "manifest": sha256 of the (name, shape,
             kind) list, "embeddings": [...], "loss": the factory's loss of the first eval batch,
             "python", "torch", "transformers"}
            {"ok": false, "stage": "import" | "build" | "data" | "loss" | "missing", "error": one line}

`dldctl check`, `up --dry-run` and `up` run it on every host that runs a learner or the syncer
(dldctl/lifecycle/modelprobe.py), so a factory that cannot be imported, a model whose manifest
differs between hosts, a loss that shifts the targets a second time, or data that does not load
there (a missing, truncated or unreadable token file, a tokenizer that does not load) is one line
before any process starts, not a crash loop after. "missing" is a dependency `up` itself installs
(numpy, pyzmq): the probe could not run yet, which is not the model's fault. "data" is a failure
whose message names the run's `data` or `tokenizer` path. A built-in preset is probed for its data
only: its loss is not computed (a large preset's forward pass on the CPU would slow `check` down).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from workload.presets import PRESETS

PROVIDED_BY_UP = {"numpy", "zmq", "zstandard"}  # dldctl's set-up installs these into the host's site dir
SHIFT_FIX = (
    "batches are (x, y) with y already x shifted by one, so `model(input_ids=x, labels=y).loss` shifts "
    "again and trains on the token after next; use workload.hf.causal_lm_loss(model, batch) "
    "(cross_entropy of model(input_ids=x).logits against y)"
)


def manifest_digest(rows: list[tuple[str, tuple[int, ...], str]]) -> str:
    """A short sha256 of the (name, shape, kind) manifest: equal on every host, or the run breaks."""
    return hashlib.sha256(json.dumps([[n, list(s), k] for n, s, k in rows]).encode()).hexdigest()[:16]


def double_shift(theirs: float, right: float, twice: float) -> bool:
    """Whether a factory's loss is the twice-shifted one: equal to it, and the two differ. Pure."""
    scale = max(1.0, abs(twice))
    return abs(theirs - twice) <= 1e-6 * scale and abs(right - twice) > 1e-5 * scale


def _shift_check(model: Any, loss_fn: Any, batch: Any) -> str | None:
    """For a model whose output has `.logits` (transformers): the double shift, named."""
    import torch
    import torch.nn.functional as F

    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor)):
        return None
    x, y = batch
    with torch.no_grad():
        logits = getattr(model(x), "logits", None)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or y.shape != x.shape:
            return None
        vocab = logits.size(-1)
        right = float(F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1)))
        twice = float(F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), y[:, 1:].reshape(-1)))
        theirs = float(loss_fn(model, batch))
    return (
        f"the model's loss shifts the targets a second time: {SHIFT_FIX}"
        if double_shift(theirs, right, twice)
        else None
    )


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the workload the spec describes on the CPU and describe it (see the module docstring)."""
    import dataclasses

    import torch

    from workload import build_workload, scoring_context

    s = {"batch_size": 16, "seed": 0, **spec["settings"]}
    ctx = scoring_context(s, spec.get("model_args"), spec.get("model_dir"))
    if spec.get("role") != "syncer":  # a learner's view: its shard of the fleet's
        ctx = dataclasses.replace(ctx, shards=max(1, int(spec.get("shards", 1))))
    try:
        wl = build_workload(ctx)
    except ImportError as exc:
        return {"ok": False, "stage": _stage(exc), "error": _line(exc)}
    except Exception as exc:  # the data (anything may go wrong reading a user's files) or the factory
        if not about_data(exc, s):
            raise
        return {"ok": False, "stage": "data", "error": _line(exc)}
    wl.model.eval()  # as the evaluators score it: no dropout, so equal losses compare equal
    rows = [
        (n, tuple(p.shape), "embedding" if n in wl.embedding_names else "dense") for n, p in wl.model.named_parameters()
    ]
    out: dict[str, Any] = {
        "ok": True,
        "tensors": len(rows),
        "params": sum(math.prod(shape) for _, shape, _ in rows),
        "manifest": manifest_digest(rows),
        "embeddings": sorted(wl.embedding_names),
    }
    if wl.eval_batches and str(s["model"]) not in PRESETS:
        try:
            with torch.no_grad():
                out["loss"] = float(wl.loss(wl.model, wl.eval_batches[0]))
            problem = _shift_check(wl.model, wl.loss, wl.eval_batches[0])
        except Exception as exc:  # the user's loss on the user's batch: anything may go wrong
            return {"ok": False, "stage": "loss", "error": _line(exc)}
        if problem:
            return {"ok": False, "stage": "loss", "error": problem}
    return out


def data_paths(settings: dict[str, Any]) -> list[str]:
    """The run's data and tokenizer paths as written and with `~` expanded ("builtin" is none)."""
    out: list[str] = []
    for key in ("data", "tokenizer"):
        value = str(settings.get(key) or "").rstrip("/")
        if value and value != "builtin":
            out += [value, str(Path(value).expanduser())]
    return out


def about_data(exc: BaseException, settings: dict[str, Any]) -> bool:
    """Whether a failure is the data's: its message (or the file it failed on) names the run's
    data or tokenizer path (workload/data.py's and workload/tokenized.py's errors all do). Pure."""
    text = f"{exc} {getattr(exc, 'filename', None) or ''}"
    return any(path in text for path in data_paths(settings))


def _stage(exc: BaseException) -> str:
    """ "missing" when what could not be imported is a dependency of dldctl's own (set-up installs
    it; the probe ran too early), else "import" (the user's code or its dependencies)."""
    for cause in (exc, exc.__cause__):
        if isinstance(cause, ModuleNotFoundError) and (cause.name or "").split(".")[0] in PROVIDED_BY_UP | {"torch"}:
            return "missing"
    return "import"


def _line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:600]


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers"):
        module = sys.modules.get(name)
        out[name] = getattr(module, "__version__", None) if module is not None else None
    return out


def main() -> int:
    """Read the spec, probe, print the answer; exit 0 whenever an answer was printed."""
    try:
        spec = json.loads(sys.stdin.read())
        answer = probe(spec)
    except ImportError as exc:
        answer = {"ok": False, "stage": _stage(exc), "error": _line(exc)}
    except Exception as exc:  # a factory may raise anything; the operator shows it as one line
        answer = {"ok": False, "stage": "build", "error": _line(exc)}
    print(json.dumps({**answer, **_versions()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
