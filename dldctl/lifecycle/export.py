"""`dldctl export RUN`: a run's global model as `model.safetensors` + `config.json` others can load.

Where the tensors come from, first that exists (the result's `source` says which):

1. `<run>/export/` as the syncer wrote it when `dldctl down` stopped it: reused (no torch needed);
2. `<run>/final_model.pt` (the syncer's torch export): converted, needs torch (`dldctl[train]`);
3. the newest valid checkpoint in `<run>/checkpoints/` (a run whose syncer never exported, or a
   live run: its newest checkpoint, not the state of this second): converted, needs torch. A
   sharded syncer's model is assembled from every shard's newest valid checkpoint (each in its
   own directory, dldctl/lifecycle/shardexport.py).

`complete` (pure) adds the built-in preset's full GPT shape to a config (n_head is in the preset
table, not in the tensor shapes; workload/presets.py is torch-free); `finish` applies it to the
export the syncer wrote. torch and safetensors are imported only where a conversion needs them,
so `dldctl` stays importable without torch. The layout is docs/model.md.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dldctl import extras
from dldctl.errors import OperationError, RunError
from dldctl.lifecycle import shardexport
from dldctl.observe.runs import unscored_reason
from dldctl.rundir import RunDir
from syncer.common import modelexport, modelfile
from syncer.common.modelexport import CONFIG, EXPORT_DIR, WEIGHTS
from workload.presets import PRESETS, config_for

if TYPE_CHECKING:
    import torch

SCHEMA = "dldctl.export/1"
Loaded = tuple[dict[str, "torch.Tensor"], int, int | None, float | None]  # tensors, outer step, tokens, loss


def complete(described: dict[str, Any]) -> dict[str, Any]:
    """`described` with "gpt": the GPTConfig fields that build the model (None: not a built-in preset).
    Pure; ValueError when the tensors do not have the preset's shape."""
    shape, model = described.get("shape"), str(described.get("model", ""))
    if model not in PRESETS or not isinstance(shape, dict):
        return {**described, "gpt": None}
    gpt = asdict(config_for(model, vocab_size=int(shape["vocab_size"]), block_size=int(shape["block_size"])))
    wrong = [k for k in ("n_layer", "n_embd", "bias") if gpt[k] != shape.get(k)]
    if wrong:
        raise ValueError(f"the tensors do not have preset {model!r}'s shape ({', '.join(wrong)} differ)")
    return {**described, "gpt": gpt}


def files(directory: Path) -> dict[str, str] | None:
    """{"dir", "weights", "config"} of an export in `directory`, None when it has none."""
    weights, config = directory / WEIGHTS, directory / CONFIG
    if not (weights.is_file() and config.is_file()):
        return None
    return {"dir": str(directory), "weights": str(weights), "config": str(config)}


def summary_files(directory: Path) -> dict[str, str | None]:
    """What `down`'s summary names: the export's model.safetensors and config.json (None: not written)."""
    found = files(directory)
    if found is None:
        return {"model_safetensors": None, "model_config": None}
    return {"model_safetensors": found["weights"], "model_config": found["config"]}


def finish(directory: Path) -> str | None:
    """Complete the config.json the syncer wrote in `directory`; the problem, or None when fine."""
    path = directory / CONFIG
    if not path.exists():  # the syncer could not write it; its event says why
        return None
    try:
        config = modelexport.read_config(path)
        done = complete(config)
        if done != config:
            modelexport.write_config(path, done)
    except (modelexport.ExportError, ValueError) as exc:
        return str(exc) if str(path) in str(exc) else f"{path}: {exc}"
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    return None


def export(run: RunDir, out: Path | None = None) -> dict[str, Any]:
    """Write (or reuse) the run's export in `out` (default `<run>/export`); the dldctl.export/1 doc."""
    dest = (out or run.path / EXPORT_DIR).expanduser().resolve()
    own = run.path / EXPORT_DIR
    live = run.live()
    if not live and files(own) is not None and _readable(own):
        source = f"{own} (from {modelexport.read_config(own / CONFIG).get('source')})"
        if dest != own.resolve():
            _copy(own, dest)
        problem = finish(dest)
        if problem:
            raise OperationError(problem, hint=f"run `dldctl export {run.name}` again after fixing it")
    else:
        source = _convert(run, dest, live)
    config = modelexport.read_config(dest / CONFIG)
    return {
        "schema": SCHEMA,
        "run": run.name,
        "source": source,
        **(files(dest) or {}),
        **{k: config.get(k) for k in ("model", "params", "outer_step", "tokens_merged", "held_out_loss")},
        "held_out_loss_missing": _missing(run, config),
    }


def _missing(run: RunDir, described: dict[str, Any]) -> str | None:
    """Why the export has no held-out loss (None: it has one): why the run's global model was not
    scored, else what the export's config.json (`described`) says."""
    if described.get("held_out_loss") is not None:
        return None
    return unscored_reason(run) or described.get("held_out_loss_missing") or "not scored"


def _unscored(run: RunDir, outer: int) -> str:
    return unscored_reason(run) or f"no good score of outer step {outer} in the run's metrics"


def _readable(directory: Path) -> bool:
    try:
        modelexport.read_config(directory / CONFIG)
    except modelexport.ExportError:
        return False
    return True


def _copy(src: Path, dest: Path) -> None:
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for name in (WEIGHTS, CONFIG):
            shutil.copyfile(src / name, dest / name)
    except OSError as exc:
        raise OperationError(f"cannot write the export to {dest}: {exc.strerror or exc}") from None


def _convert(run: RunDir, dest: Path, live: bool) -> str:
    """Read the tensors from final_model.pt or the newest valid checkpoint (of a sharded syncer:
    every shard's, assembled), write the export; the source."""
    final = run.final_model
    use_final = not live and final.is_file()
    config = run.read_config()
    sharded = config.syncer.shards > 1
    candidates = [] if use_final else _checkpoint_files(run)
    if not use_final and not candidates:
        raise RunError(
            f"run {run.name} has no final model ({final}) and no checkpoint in {run.checkpoints}",
            hint=f"`dldctl down --run {run.name}` exports the model while its syncer runs; "
            "a run that never merged has none to export",
        )
    what = final.name if use_final else "its newest checkpoint" + (" of every syncer shard" if sharded else "")
    extras.require("torch", f"`dldctl export {run.name}` converts {what} to safetensors and needs")
    if use_final:
        loaded, source = _from_final(final), str(final)
    elif sharded:
        source, loaded = shardexport.assemble(run, config.syncer.shards, config.run_id)
    else:
        path, loaded = _from_checkpoints(run, candidates)
        source = f"checkpoint {path}"
    source += " (the run is live: its newest checkpoint)" if live and not use_final else ""
    tensors, outer, merged, loss = loaded
    if loss is None:
        loss = _reported_loss(run, outer)
    _write(run, dest, tensors, outer, merged, loss, source)
    return source


def _checkpoint_files(run: RunDir) -> list[Path]:
    """Checkpoint files (shard 0's, of a sharded syncer), newest first (the syncer's own order:
    epoch, outer step, time in the name)."""
    return shardexport.checkpoint_files(run.checkpoints)


def _from_final(path: Path) -> Loaded:
    try:
        model = modelfile.read(path)
    except modelfile.ModelFileError as exc:
        raise OperationError(str(exc), hint="export the newest checkpoint instead: move the file away") from None
    return model.tensors, model.outer_steps or 0, model.tokens_merged, model.held_out_loss


def _from_checkpoints(run: RunDir, paths: list[Path]) -> tuple[Path, Loaded]:
    """The newest checkpoint that reads; RunError naming what was wrong with each when none does."""
    problems = []
    for path in paths:
        try:
            return path, _from_checkpoint(path)
        except (modelexport.ExportError, OSError) as exc:
            problems.append(str(exc))
        except Exception as exc:  # torch.load of a bad body, or a state of another shape
            problems.append(f"{path.name}: unreadable ({type(exc).__name__}: {str(exc)[:160]})")
    raise RunError(
        f"run {run.name} has no final model and no valid checkpoint in {run.checkpoints}: {'; '.join(problems)}",
        hint="restore a checkpoint there, or export from a copy of the run that has one",
    )


def _from_checkpoint(path: Path) -> Loaded:
    """The global model of one checkpoint file (weights_only: tensors, never code)."""
    import torch

    from syncer.wire import fragments

    saved = shardexport.read_checkpoint(path)
    manifest = fragments.manifest_from_json(saved["manifest"])
    plan = fragments.plan(manifest, int(saved["fragments"]))
    tensors = {spec.name: torch.zeros(spec.shape, dtype=torch.float32) for spec in manifest}
    for p, theta in enumerate(saved["theta"]):
        plan.scatter(p, theta, tensors)
    fleet = saved.get("fleet") or {}
    merged = int(fleet["merged_tokens"]) if "merged_tokens" in fleet else None
    return tensors, int(saved["outer_steps"]), merged, None


def _reported_loss(run: RunDir, outer_step: int) -> float | None:
    """The syncer's last good held-out score of the global model at `outer_step` (metrics.jsonl)."""
    return shardexport.scored_loss(run, lambda r: r.get("outer_step") == outer_step and bool(r.get("good")))


def _write(
    run: RunDir,
    dest: Path,
    tensors: dict[str, torch.Tensor],
    outer: int,
    merged: int | None,
    loss: float | None,
    source: str,
) -> None:
    config = modelexport.model_config(
        run=run.name,
        settings=run.read_config().run.to_dict(),
        shapes={n: tuple(t.shape) for n, t in tensors.items()},
        outer_step=outer,
        tokens_merged=merged,
        held_out_loss=loss,
        source=source,
        created=time.time(),
        held_out_loss_missing=None if loss is not None else _unscored(run, outer),
    )
    try:
        modelexport.write(dest, tensors, complete(config))
    except ValueError as exc:
        raise OperationError(f"{source}: {exc}", hint="was the run's config.json changed after the run?") from None
    except OSError as exc:
        raise OperationError(f"cannot write the export to {dest}: {exc.strerror or exc}") from None
