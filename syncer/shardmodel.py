"""The whole global model of a sharded syncer, from each shard's newest valid checkpoint.

Every shard checkpoints its own fragments on its own (syncer/checkpoint.py, in its directory:
syncer/config.py `shard_dir`). `dldctl down` (after every shard wrote its final checkpoint) and
`dldctl export` assemble the model here: each shard's vectors scattered into the parameters by
that shard's plan (syncer/wire/shards.py). The versions and checkpoint of every shard are
recorded with the model, so a state mixed from shards that stopped at different points is
visible, never silent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from syncer import checkpoint
from syncer.common import modelexport
from syncer.common.atomic import atomic_file
from syncer.config import SyncerConfig, shard_dir
from syncer.core import SyncerCore
from syncer.records import Records
from syncer.wire import shards


@dataclass(frozen=True)
class ShardSource:
    """Where one shard's part of the assembled model came from."""

    shard: int
    checkpoint: str
    epoch: int
    outer_steps: int
    fragments: tuple[int, ...]  # the global fragments it owns
    versions: tuple[int, ...]  # their versions, in the same order
    merged_tokens: int  # the run's, as this shard accounts it


@dataclass(frozen=True)
class Assembled:
    """The global model of every shard's newest valid checkpoint."""

    run_id: str
    tensors: dict[str, torch.Tensor]
    versions: list[int]  # per global fragment
    sources: list[ShardSource]

    @property
    def outer_steps(self) -> int:
        return sum(s.outer_steps for s in self.sources)

    @property
    def merged_tokens(self) -> int:
        """Shard 0's: each shard counts its fragments as the whole model (syncer/outerstep.py)."""
        return self.sources[0].merged_tokens


def assemble(run_dir: Path, count: int, into: dict[str, torch.Tensor] | None = None) -> Assembled:
    """The model of `count` shards' newest valid checkpoints under `run_dir` (into `into`'s
    tensors, else new ones), read one shard at a time; CheckpointError names the shard, its
    directory and why when one has none, or when they are of different runs."""
    sources: list[ShardSource] = []
    run_id: list[str] = []

    def states() -> Iterator[dict[str, Any]]:
        for s in range(count):
            directory = shard_dir(run_dir, s) / "checkpoints"
            state, problems = checkpoint.load_latest(directory)
            if state is None:
                why = "; ".join(problems) or "no checkpoint file"
                raise checkpoint.CheckpointError(f"syncer shard {s}: no valid checkpoint in {directory} ({why})")
            sources.append(_source(s, state))
            run_id[:] = run_id or [str(state["run_id"])]
            yield state

    try:
        tensors, versions = shards.assemble(states(), count, into)
    except ValueError as exc:
        raise checkpoint.CheckpointError(f"{run_dir}: {exc}") from None
    return Assembled(run_id[0], tensors, versions, sources)


def newest(run_dir: Path, count: int) -> tuple[str, ...] | None:
    """The file name of each shard's newest checkpoint (None: a shard has none yet)."""
    names = []
    for s in range(count):
        files = checkpoint.list_checkpoints(shard_dir(run_dir, s) / "checkpoints")
        if not files:
            return None
        names.append(files[0].name)
    return tuple(names)


def _source(s: int, state: dict[str, Any]) -> ShardSource:
    fleet = state.get("fleet") or {}
    name = shards.checkpoint_label(s, state).partition(": ")[2]
    return ShardSource(
        s,
        name,
        int(state["epoch"]),
        int(state["outer_steps"]),
        tuple(int(p) for p in state["owned"]),
        tuple(int(v) for v in state["versions"]),
        int(fleet.get("merged_tokens", 0)),
    )


def write_final(
    model: Assembled, path: Path, settings: dict[str, Any], run: str, held_out_loss: float | None = None
) -> str | None:
    """final_model.pt (what `init_from` reads, with each shard's source and the model's held-out
    loss where shard 0 scored it) and the safetensors export beside it; None, or why the
    safetensors export failed (final_model.pt is written)."""
    with atomic_file(path) as fh:
        torch.save(
            {
                "state_dict": model.tensors,
                "outer_steps": model.outer_steps,
                "versions": model.versions,
                "run_id": model.run_id,
                "tokens_merged": model.merged_tokens,
                "held_out_loss": held_out_loss,
                "shards": [asdict(s) for s in model.sources],
            },
            fh,
        )
    config = modelexport.model_config(
        run=run,
        settings=settings,
        shapes={n: tuple(t.shape) for n, t in model.tensors.items()},
        outer_step=model.outer_steps,
        tokens_merged=model.merged_tokens,
        held_out_loss=held_out_loss,
        source=f"the newest checkpoints of {len(model.sources)} syncer shards",
        created=time.time(),
    )
    try:
        modelexport.write(path.parent / modelexport.EXPORT_DIR, model.tensors, {**config, "run_id": model.run_id})
    except ImportError as exc:
        return f"safetensors is not installed ({exc}); `dldctl export` converts {path.name}"
    except OSError as exc:
        return f"cannot write the export: {exc.strerror or exc}"
    return None


def export(
    core: SyncerCore, cfg: SyncerConfig, target: Path, score: Callable[[dict[str, torch.Tensor]], float | None]
) -> tuple[Path, str | None]:
    """`dldctl down`'s final model: this syncer's (`checkpoint.export_model`), or, on shard 0 of
    a sharded one, every shard's newest checkpoint assembled (the others wrote their final ones
    before: `down` stops them first) and scored by `score` (None: not scored). (the export
    directory, why the safetensors export failed)."""
    if cfg.shards == 1:
        return checkpoint.export_model(core, target, cfg.run_dir.name)
    model = assemble(cfg.run_dir, cfg.shards)
    loss = score(model.tensors)
    problem = write_final(model, target, cfg.settings.to_dict(), cfg.run_dir.name, loss)
    return target.parent / modelexport.EXPORT_DIR, problem


def export_path(run_dir: Path, name: Any) -> Path:
    """Where the final model goes: `name` in the run directory (a bare file name), else final_model.pt."""
    return run_dir / (name if isinstance(name, str) and "/" not in name and name else "final_model.pt")


def export_final(
    core: SyncerCore,
    cfg: SyncerConfig,
    name: Any,
    score: Callable[[dict[str, torch.Tensor]], float | None],
    records: Records,
) -> Path | None:
    """`dldctl down`'s export at shutdown (`export`), said as an event; None where none is
    written (no model, a shard other than 0, a full disk: the checkpoints still hold the model)."""
    if core.model is None or cfg.shard != 0:  # shard 0 assembles a sharded model
        return None
    target = export_path(cfg.run_dir, name)
    try:
        directory, problem = export(core, cfg, target, score)
    except (OSError, checkpoint.CheckpointError) as exc:
        records.event("export_failed", "syncer", f"cannot write {target}: {getattr(exc, 'strerror', None) or exc}")
        return None
    also = f"no safetensors export: {problem}" if problem else f"{directory}/ (model.safetensors, config.json)"
    records.event("export", "syncer", f"final model written to {target}; {also}, at outer step {core.outer_steps}")
    return target
