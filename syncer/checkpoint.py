"""Syncer checkpoints: the global model, versions, outer-optimizer state and counters.

File format: MAGIC | sha256(body) | body, where body is `torch.save` of a plain dict. Written
atomically (temp file in the same directory, fsync, rename, fsync the directory), so a crash
mid-write leaves the previous checkpoint intact. Loading verifies the checksum and falls back to
the next older file, reporting every file it had to skip.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from pathlib import Path
from typing import Any

import torch

from syncer import faultpoints, fragments
from syncer.core import GlobalModel, SyncerCore

MAGIC = b"DLDCKPT1"
PREFIX = "ckpt-"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or no valid one could be read."""


def state_dict(core: SyncerCore, wall: float) -> dict[str, Any]:
    """Everything needed to resume the run's global state."""
    m = core.model
    assert m is not None
    return {
        "format": 1, "run_id": core.run_id, "epoch": core.epoch, "saved_at": wall,
        "manifest": fragments.manifest_to_json(m.manifest), "fragments": m.plan.count,
        "theta": m.theta, "versions": m.versions, "momentum": m.momentum, "residual": m.residual,
        "outer_steps": core.outer_steps, "fleet": core.fleet.state_dict(),
        "bytes_up": core.bytes_up, "bytes_down": core.bytes_down,
    }


def restore(core: SyncerCore, state: dict[str, Any], now: float) -> None:
    """Load a checkpoint's state into a fresh core (its epoch is already the new one)."""
    if state.get("run_id") != core.run_id:
        raise CheckpointError(f"checkpoint belongs to run {state.get('run_id')!r}, not {core.run_id!r}")
    if state["fragments"] != core.s.fragments:
        raise CheckpointError(f"checkpoint has {state['fragments']} fragments, settings say {core.s.fragments}")
    manifest = fragments.manifest_from_json(state["manifest"])
    plan = fragments.plan(manifest, state["fragments"])
    core.model = GlobalModel(manifest, plan, list(state["theta"]), list(state["versions"]),
                             list(state["momentum"]), list(state["residual"]))
    if [t.numel() for t in core.model.theta] != plan.sizes():
        raise CheckpointError("checkpoint tensors do not match its own fragment plan")
    core.outer_steps = int(state["outer_steps"])
    core.checkpoint_outer_step = core.outer_steps
    core.bytes_up, core.bytes_down = int(state["bytes_up"]), int(state["bytes_down"])
    core.fleet.load_state_dict(state["fleet"], now, float(state["saved_at"]))


def save(directory: Path, state: dict[str, Any], keep: int = 3) -> Path:
    """Write a checkpoint atomically; prune all but the newest `keep`. Raises CheckpointError."""
    buf = io.BytesIO()
    torch.save(state, buf)
    body = buf.getvalue()
    name = f"{PREFIX}{state['epoch']:04d}-{state['outer_steps']:09d}-{int(time.time() * 1000)}.pt"
    final = directory / name
    tmp = directory / f".{name}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            fh.write(MAGIC + hashlib.sha256(body).digest() + body[: len(body) // 2])
            faultpoints.hit("checkpoint")  # a crash here must leave the previous checkpoint valid
            fh.write(body[len(body) // 2 :])
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(directory)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the directory itself is the problem
        raise CheckpointError(f"cannot write checkpoint in {directory}: {exc.strerror or exc}") from exc
    for old in list_checkpoints(directory)[keep:]:
        try:
            old.unlink(missing_ok=True)
        except OSError:
            pass
    return final


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, newest first (by epoch, outer step, time in the name)."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.glob(f"{PREFIX}*.pt") if p.is_file()), key=lambda p: p.name, reverse=True)


def read(path: Path) -> dict[str, Any]:
    """Read and verify one checkpoint file."""
    data = path.read_bytes()
    head = len(MAGIC) + 32
    if len(data) < head or data[: len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path.name}: not a checkpoint (bad magic or truncated)")
    if hashlib.sha256(data[head:]).digest() != data[len(MAGIC) : head]:
        raise CheckpointError(f"{path.name}: checksum mismatch (truncated or corrupt)")
    try:
        return torch.load(io.BytesIO(data[head:]), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad pickle
        raise CheckpointError(f"{path.name}: unreadable ({exc})") from exc


def load_latest(directory: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """(newest valid state or None, problems with newer files that had to be skipped)."""
    problems: list[str] = []
    for path in list_checkpoints(directory):
        try:
            return read(path), problems
        except (CheckpointError, OSError) as exc:
            problems.append(str(exc))
    return None, problems


def export_model(core: SyncerCore, path: Path) -> None:
    """The global model as a plain `{parameter name: tensor}` state dict (atomic write)."""
    m = core.model
    assert m is not None
    tensors = {spec.name: torch.zeros(spec.shape, dtype=torch.float32) for spec in m.manifest}
    for p in range(m.plan.count):
        m.plan.scatter(p, m.theta[p], tensors)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"state_dict": tensors, "outer_steps": core.outer_steps, "versions": list(m.versions),
                "run_id": core.run_id}, tmp)
    os.replace(tmp, path)
