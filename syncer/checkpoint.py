"""Syncer checkpoints: the global model, versions, outer-optimizer state and counters.

File format: MAGIC | sha256(body) | body, where body is `torch.save` of a plain dict. Written
atomically (temp file in the same directory, fsync, rename, fsync the directory), so a crash
mid-write leaves the previous checkpoint intact. Loading verifies the checksum and falls back to
the next older file, reporting every file it had to skip.

Lost history is never silent. Every checkpoint also rewrites `history.json` next to it: the run's
counters (outer steps, versions, the fleet's token and time accounting, bytes) without tensors.
When no checkpoint can be resumed, `lost_history` tells a brand-new run (no checkpoint file and
no history: the first learner's weights initialize the global model) from a run that had
merged and lost it (files that all fail, or a history with no file left). For the latter the
run's `on_no_checkpoint` decides: "refuse" (the default; `HistoryLostError` with one line
naming the directory, what was wrong with each file and what to do) or "from-learner" (a new
global model from a learner's weights, `continue_counters` carrying the counters on and a
lasting warning in the status).
"""

from __future__ import annotations

import copy as copylib
import hashlib
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch

from syncer.common import faultpoints, modelexport, strictjson
from syncer.common.atomic import atomic_file, atomic_write
from syncer.common.ckptname import NAME  # epoch, outer step: readable even when the body is not
from syncer.core import SyncerCore
from syncer.globalmodel import GlobalModel
from syncer.wire import fragments

MAGIC = b"DLDCKPT1"
PREFIX = "ckpt-"
HISTORY = "history.json"  # the run's counters, rewritten with every checkpoint
_VECTORS = ("theta", "versions", "momentum", "residual")  # a snapshot lends these instead of copying
REFUSED = "syncer.refused"  # in the run directory: the syncer refused to start (the supervisor reads it)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or no valid one could be read."""


class HistoryLostError(CheckpointError):
    """The run had merged before, no checkpoint is valid, and the run does not allow a new model."""


def state_dict(core: SyncerCore, wall: float, copy: bool = False) -> dict[str, Any]:
    """Everything needed to resume the run's global state (`copy`: a snapshot that never changes,
    so it can be held or written by another thread while merges go on: the three vectors lent
    copy-on-write (`GlobalModel.snapshot`: a merge copies only the fragment it writes), the
    counters copied)."""
    m = core.model
    assert m is not None
    if copy:
        theta, momentum, residual = m.snapshot()
        state = copylib.deepcopy({k: v for k, v in state_dict(core, wall).items() if k not in _VECTORS})
        return {**state, "versions": list(m.versions), "theta": theta, "momentum": momentum, "residual": residual}
    return {
        "format": 1,
        "run_id": core.run_id,
        "epoch": core.epoch,
        "saved_at": wall,
        "manifest": fragments.manifest_to_json(m.manifest),
        "fragments": core.s.fragments,
        "shard": [core.shard, core.shards],  # this shard's fragments: `owned` (all, unsharded)
        "owned": list(core.owned),
        "theta": m.theta,
        "versions": m.versions,
        "momentum": m.momentum,
        "residual": m.residual,
        "outer_steps": core.outer_steps,
        "fleet": core.fleet.state_dict(),
        "bytes_up": core.bytes_up,
        "bytes_down": core.bytes_down,
        # a restarted syncer judges scores and clips norms against the history it had, not
        # against the first stale contributions after an outage
        "guard": core.guard.state_dict(),
        "norm_history": {p: list(d) for p, d in core.outer.norm_history.items()},
        "screen": core.screen.state_dict(wall),  # the judge's history, who is quarantined (syncer/screening.py)
        "warnings": list(core.warnings),
        "data": core.data.ledger.state_dict() if core.data.on else None,
        "pushes": core.receipts.state_dict(),  # which pushes this state holds (syncer/receipts.py)
    }


def restore(core: SyncerCore, state: dict[str, Any], now: float) -> None:
    """Load a checkpoint's state into a fresh core (its epoch is already the new one). Everything
    is checked before anything is set, so a CheckpointError leaves the core as it was."""
    if state.get("run_id") != core.run_id:
        raise CheckpointError(f"checkpoint belongs to run {state.get('run_id')!r}, not {core.run_id!r}")
    if state["fragments"] != core.s.fragments:
        raise CheckpointError(f"checkpoint has {state['fragments']} fragments, settings say {core.s.fragments}")
    shard = tuple(state.get("shard", (0, 1)))
    if shard != (core.shard, core.shards):
        raise CheckpointError(
            f"checkpoint is of syncer shard {shard[0]} of {shard[1]}, this is shard {core.shard} of {core.shards}"
        )
    manifest = fragments.manifest_from_json(state["manifest"])
    owned = core.owned
    plan = core.plan_for(manifest)
    model = GlobalModel(
        manifest, plan, list(state["theta"]), list(state["versions"]), list(state["momentum"]), list(state["residual"])
    )
    problem = None
    if list(state.get("owned", core.owned)) != list(core.owned):
        problem = "checkpoint's fragments are not the ones this shard owns"
    elif [t.numel() for t in model.theta] != plan.sizes():
        problem = "checkpoint tensors do not match its own fragment plan"
    if problem:
        core.owned = owned  # nothing set
        raise CheckpointError(problem)
    outer_steps, bytes_up, bytes_down = int(state["outer_steps"]), int(state["bytes_up"]), int(state["bytes_down"])
    core.fleet.load_state_dict(state["fleet"], now, float(state["saved_at"]), closed=bool(state.get("closed")))
    core.model = model
    core.outer_steps = core.checkpoint_outer_step = outer_steps
    core.bytes_up, core.bytes_down = bytes_up, bytes_down
    core.guard.load_state_dict(state.get("guard", {}))
    for p, norms in state.get("norm_history", {}).items():
        core.outer.norm_history[int(p)].extend(float(x) for x in norms)
    core.screen.load_state_dict(state.get("screen") or {}, now)
    core.warnings = [str(w) for w in state.get("warnings", [])]
    core.receipts.load_state_dict(state.get("pushes"))
    if core.data.on and state.get("data"):
        core.data.restored(state["data"], now, set(core.fleet.learners))


def resume(core: SyncerCore, directory: Path, now: float) -> tuple[bool, list[str]]:
    """Restore the newest checkpoint that reads and fits this run: (restored, one problem per
    newer file skipped, or per file when none fits)."""
    problems: list[str] = []
    for path in list_checkpoints(directory):
        try:
            restore(core, read(path), now)
            return True, problems
        except (CheckpointError, OSError) as exc:
            problems.append(str(exc))
        except (KeyError, ValueError, TypeError) as exc:
            problems.append(f"{path.name}: cannot resume ({type(exc).__name__}: {exc})")
    return False, problems


def save(directory: Path, state: dict[str, Any], keep: int = 3) -> Path:
    """Write a checkpoint atomically; prune all but the newest `keep`. Raises CheckpointError.
    The body is serialized straight into the file, hashed on its way (no copy of the state in
    memory: a 7B model's would be 84 GB); the hash goes into the header last."""
    name = f"{PREFIX}{state['epoch']:04d}-{state['outer_steps']:09d}-{int(time.time() * 1000)}.pt"
    final = directory / name
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # both files are written before either is renamed (the inner one first): a full disk fails both
        with atomic_file(directory / HISTORY) as history, atomic_file(final) as fh:
            history.write(_history(state, name))
            fh.write(MAGIC + bytes(32))  # the hash's place
            body = _Hashing(fh)
            torch.save(state, cast("IO[bytes]", body))  # a file as far as torch.save goes
            faultpoints.hit("checkpoint")  # a crash here must leave the previous checkpoint valid
            fh.seek(len(MAGIC))
            fh.write(body.sha.digest())
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint in {directory}: {exc.strerror or exc}") from exc
    for old in list_checkpoints(directory)[keep:]:
        try:
            old.unlink(missing_ok=True)
        except OSError:
            pass
    return final


class _Hashing(io.RawIOBase):
    """A write-only file that hashes what passes through it into another (torch.save's target)."""

    def __init__(self, fh: Any) -> None:
        super().__init__()
        self.fh, self.sha = fh, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.sha.update(data)
        return int(self.fh.write(data))


class _Reader(io.RawIOBase):
    """A read-only, seekable file over a memoryview (torch.load reads it without a copy)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        chunk = self.view[self.pos : self.pos + len(buffer)]
        memoryview(buffer).cast("B")[: len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, offset + (0, self.pos, len(self.view))[whence])
        return self.pos

    def tell(self) -> int:
        return self.pos


def _history(state: dict[str, Any], name: str) -> bytes:
    """The counters of checkpoint `name` as JSON (history.json: what survives losing every checkpoint)."""
    record: dict[str, Any] = {
        k: state[k]
        for k in (
            "run_id",
            "epoch",
            "saved_at",
            "closed",
            "outer_steps",
            "fragments",
            "fleet",
            "bytes_up",
            "bytes_down",
            "warnings",
            "data",
        )
        if k in state
    }
    record.update(format=1, checkpoint=name, versions=[int(v) for v in state["versions"]])
    # informational: never fail a checkpoint over a field's type (default=str)
    return strictjson.dumps(record, default=str).encode()


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, newest first (by epoch, outer step, time in the name)."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.glob(f"{PREFIX}*.pt") if p.is_file()), key=lambda p: p.name, reverse=True)


def read(path: Path) -> dict[str, Any]:
    """Read and verify one checkpoint file (the body held once: hashed from a view of it)."""
    data = path.read_bytes()
    head = len(MAGIC) + 32
    if len(data) < head or data[: len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path.name}: not a checkpoint (bad magic or truncated)")
    body = memoryview(data)[head:]
    if hashlib.sha256(body).digest() != data[len(MAGIC) : head]:
        raise CheckpointError(f"{path.name}: checksum mismatch (truncated or corrupt)")
    try:
        state: dict[str, Any] = torch.load(cast("IO[bytes]", _Reader(body)), map_location="cpu", weights_only=True)
        return state
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


# -- lost history ----------------------------------------------------------------------------
def read_history(directory: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the history record, a problem with it): (None, None) when there is no history file."""
    path = directory / HISTORY
    try:
        record = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):  # no history (or no checkpoint directory at all)
        return None, None
    except (OSError, ValueError) as exc:
        return None, f"{HISTORY}: unreadable ({exc})"
    if not isinstance(record, dict) or not isinstance(record.get("outer_steps"), int):
        return None, f"{HISTORY}: not a history record"
    return record, None


def newest_name(directory: Path) -> tuple[int, int]:
    """(epoch, outer step) of the newest checkpoint file by its name, readable or not; (0, 0) if none."""
    best = (0, 0)
    for path in list_checkpoints(directory):
        match = NAME.fullmatch(path.name)
        if match:
            best = max(best, (int(match.group(1)), int(match.group(2))))
    return best


@dataclass(frozen=True)
class LostHistory:
    """A run that had merged, with no checkpoint left to resume: what is known of what was lost."""

    directory: Path
    problems: tuple[str, ...]  # what was wrong with each checkpoint file (and the history)
    history: dict[str, Any] | None  # the newest readable history record
    epoch: int  # the newest epoch known
    outer_steps: int  # the newest outer step known

    @property
    def merged_tokens(self) -> int | None:
        fleet = (self.history or {}).get("fleet")
        return int(fleet["merged_tokens"]) if isinstance(fleet, dict) and "merged_tokens" in fleet else None

    def what(self) -> str:
        """'outer step 3251, 6,300,000 tokens merged, last checkpoint ckpt-...'."""
        parts = [f"outer step {self.outer_steps}"]
        if self.merged_tokens is not None:
            parts.append(f"{self.merged_tokens:,} tokens merged")
        if self.history and self.history.get("checkpoint"):
            parts.append(f"last checkpoint {self.history['checkpoint']}")
        return ", ".join(parts)

    def why(self) -> str:
        return "; ".join(self.problems) or "no checkpoint file is left"

    def refusal(self) -> str:
        """The one-line error of a syncer that refuses to start a new global model."""
        return (
            f"no valid checkpoint in {self.directory}, but this run had merged ({self.what()}): {self.why()}; "
            f"refusing to start a new global model. Restore a checkpoint into {self.directory}, or set "
            f'on_no_checkpoint = "from-learner" in the run\'s settings to start a new global model from a '
            f"learner's weights (the counters continue)"
        )

    def warning(self) -> str:
        """The lasting status warning of a run that went on with a new global model."""
        return (
            f"history lost at outer step {self.outer_steps} (epoch {self.epoch}): no valid checkpoint in "
            f"{self.directory}; a new global model was started from a learner's weights "
            f'(on_no_checkpoint = "from-learner"); the counters continue, the training before does not'
        )


def lost_history(directory: Path, problems: list[str]) -> LostHistory | None:
    """After `resume` found nothing: None for a brand-new run (no checkpoint file, no history),
    else what the run had and lost (`problems`: what `resume` said about each file)."""
    history, trouble = read_history(directory)
    if not problems and history is None and trouble is None:
        return None
    epoch, outer = newest_name(directory)
    if history is not None:
        epoch, outer = max(epoch, int(history.get("epoch", 0))), max(outer, int(history["outer_steps"]))
    if not problems:
        problems = [
            f"no checkpoint file left ({HISTORY} says the run reached outer step {outer})"
            if history
            else "no checkpoint file left"
        ]
    return LostHistory(directory, tuple(problems + ([trouble] if trouble else [])), history, epoch, outer)


def start_decision(lost: LostHistory | None, on_no_checkpoint: str) -> str:
    """With no checkpoint to resume: "fresh" (a brand-new run), "refuse" or "from-learner"."""
    if lost is None:
        return "fresh"
    return "from-learner" if on_no_checkpoint == "from-learner" else "refuse"


def continue_counters(core: SyncerCore, lost: LostHistory, now: float) -> list[str]:
    """Carry the lost run's counters on into a core that starts a new global model; returns
    what could not be carried (empty when the history had everything)."""
    h = lost.history or {}
    missing: list[str] = []
    core.outer_steps = lost.outer_steps
    core.bytes_up, core.bytes_down = int(h.get("bytes_up", 0)), int(h.get("bytes_down", 0))
    try:
        core.fleet.load_state_dict(h["fleet"], now, float(h.get("saved_at", now)), closed=bool(h.get("closed")))
    except (KeyError, TypeError, ValueError):
        missing.append("token and time accounting (no readable history)")
    if not h:
        missing.append("bytes")
    if core.data.on and h.get("data"):  # the data cursor goes on: the epoch is not started again
        core.data.restored(h["data"], now, set(core.fleet.learners))
    core.warnings = [*(str(w) for w in h.get("warnings", [])), lost.warning()]
    return missing


def export_model(core: SyncerCore, path: Path, run: str = "") -> tuple[Path, str | None]:
    """The global model as `final_model.pt` (a plain `{parameter name: tensor}` state dict, what
    `init_from` reads) and as `export/model.safetensors` + `export/config.json` beside it (what
    others load, syncer/common/modelexport.py). Each write is atomic. Returns (the export
    directory, None) or (it, why the safetensors export failed): final_model.pt is written anyway."""
    m = core.model
    assert m is not None
    tensors = {spec.name: torch.zeros(spec.shape, dtype=torch.float32) for spec in m.manifest}
    for p in range(m.plan.count):
        m.plan.scatter(p, m.theta[p], tensors)
    loss = modelexport.final_loss(core.guard.last, core.outer_steps)
    merged = int(core.fleet.merged_tokens)
    with atomic_file(path) as fh:
        torch.save(
            {
                "state_dict": tensors,
                "outer_steps": core.outer_steps,
                "versions": list(m.versions),
                "run_id": core.run_id,
                "tokens_merged": merged,
                "held_out_loss": loss,
            },
            fh,
        )
    config = modelexport.model_config(
        run=run or core.run_id,
        settings=core.s.to_dict(),
        shapes={n: tuple(t.shape) for n, t in tensors.items()},
        outer_step=core.outer_steps,
        tokens_merged=merged,
        held_out_loss=loss,
        source="the syncer's global model at shutdown",
        created=time.time(),
        held_out_loss_missing=core.guard.off or modelexport.no_final_loss(core.guard.last, core.outer_steps),
    )
    directory = path.parent / modelexport.EXPORT_DIR
    try:
        modelexport.write(directory, tensors, {**config, "run_id": core.run_id})
    except ImportError as exc:
        return directory, f"safetensors is not installed for the syncer ({exc}); `dldctl export` converts {path.name}"
    except OSError as exc:
        return directory, f"cannot write {directory}: {exc.strerror or exc}"
    return directory, None


def next_epoch(path: Path, at_least: int = 1) -> int:
    """Each start of the syncer is a new epoch (learners resync when it changes); never one a
    checkpoint already names, even if the epoch file was lost (`at_least`)."""
    try:
        epoch = int(path.read_text().strip()) + 1
    except (OSError, ValueError):
        epoch = 1
    epoch = max(epoch, at_least)
    atomic_write(path, str(epoch))
    return epoch
