"""`dldctl export` of a sharded run that has no final_model.pt: the global model assembled from
every shard's newest valid checkpoint.

Each shard of a sharded syncer (`[syncer] shards`, dldctl/shards.py) checkpoints only the
fragments it owns, in its own directory. `dldctl down` has shard 0 assemble them
(syncer/shardmodel.py); a run stopped without `down` (a crash), or a live one, is assembled here
the same way, with the shared `syncer.wire.shards.assemble` (each shard's vectors scattered
into the parameters by that shard's fragment plan). torch is imported only when a conversion
needs it.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dldctl import shards
from dldctl.errors import RunError
from dldctl.rundir import RunDir
from syncer.common import jsonlread, modelexport

if TYPE_CHECKING:
    import torch

Loaded = tuple[dict[str, "torch.Tensor"], int, int | None, float | None]  # as export.py: tensors, outer, tokens, loss


def read_checkpoint(path: Path) -> dict[str, Any]:
    """One checkpoint file's state (weights_only: tensors, never code); ExportError for a bad frame."""
    import torch

    body = modelexport.checkpoint_body(path.read_bytes(), path.name)
    state: dict[str, Any] = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    return state


def checkpoint_files(directory: Path) -> list[Path]:
    """A shard's checkpoint files, newest first (the syncer's own order: epoch, outer step, time)."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.glob("ckpt-*.pt") if p.is_file()), key=lambda p: p.name, reverse=True)


def newest(directory: Path, shard: int, count: int, run_id: str) -> tuple[Path, dict[str, Any]]:
    """Shard `shard`'s newest checkpoint that reads and is of this run and shard; RunError naming
    the shard, its directory and what was wrong with each file when none is."""
    problems = []
    for path in checkpoint_files(directory):
        try:
            state = read_checkpoint(path)
        except (modelexport.ExportError, OSError) as exc:
            problems.append(str(exc))
            continue
        except Exception as exc:  # torch.load of a bad body
            problems.append(f"{path.name}: unreadable ({type(exc).__name__}: {str(exc)[:160]})")
            continue
        if state.get("run_id") != run_id or list(state.get("shard", (0, 1))) != [shard, count]:
            problems.append(f"{path.name}: not shard {shard} of {count} of run {run_id}")
            continue
        return path, state
    raise RunError(
        f"syncer shard {shard} has no valid checkpoint in {directory}: {'; '.join(problems) or 'no checkpoint file'}",
        hint="every shard's checkpoint is needed to assemble the model; restore one there",
    )


def assemble(run: RunDir, count: int, run_id: str) -> tuple[str, Loaded]:
    """(where it came from, the model) of every shard's newest valid checkpoint: tensors, the
    outer steps of all shards together, shard 0's merged tokens (each shard counts its fragments
    as the whole model), and the held-out loss shard 0 scored for exactly these checkpoints (None
    if it scored none: syncer/shardscore.py)."""
    from syncer.wire import shards as wire_shards

    found = [newest(shards.local_dir(run.path, s) / "checkpoints", s, count, run_id) for s in range(count)]
    states = [saved for _, saved in found]  # checkpoint states (not the run's state.json)
    try:
        tensors, _ = wire_shards.assemble(states, len(states))
    except ValueError as exc:
        raise RunError(f"run {run.name}: {exc}", hint="restore each shard's own checkpoints") from None
    outer = sum(int(saved["outer_steps"]) for saved in states)
    merged = int((states[0].get("fleet") or {}).get("merged_tokens", 0))
    names = [f"{shards.subdir(s) or '.'}/checkpoints/{path.name}" for s, (path, _) in enumerate(found)]
    labels = [wire_shards.checkpoint_label(s, saved) for s, saved in enumerate(states)]
    loss = scored_loss(run, lambda record: record.get("sources") == labels)
    return f"the newest checkpoints of {count} syncer shards ({', '.join(names)})", (tensors, outer, merged, loss)


def scored_loss(run: RunDir, matches: Callable[[dict[str, Any]], bool]) -> float | None:
    """The syncer's last held-out score of the global model (a `global_eval` record of
    metrics.jsonl) that `matches`: one of exactly the exported state; None if it made none."""
    loss = None
    for record in jsonlread.read(run.metrics):
        if record.get("kind") == "global_eval" and matches(record):
            loss = record.get("loss")
    return float(loss) if isinstance(loss, (int, float)) else None
