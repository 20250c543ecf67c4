"""A new run's model from a file (`[run] init_from`): every learner loads the run's copy of it
(config.json's `init_model`) into the model it built from the seed, before anything is uploaded
or trained. So the learner that initializes the global model uploads these weights, and every
replica agrees. A learner of a run that has a global model already (a resumed run, a rejoining
or late learner) then fetches it from the syncer as always: the syncer's state wins.

The matching rules (`match`: names and shapes only, pure):
- every tensor of the file is one of the model's state dict, with the same name and shape;
- a name of the model that the file lacks is allowed only if it is tied to (shares storage
  with) a name the file has (GPT's `lm_head.weight`, tied to `transformer.wte.weight`), or, in
  a file `dldctl down` exported (parameters only), if it is a buffer: buffers are never merged,
  so it keeps its value from the seed, as in any run.
Anything else fails the learner with one line naming the file, the tensor and the shapes.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from syncer.common import modelfile
from syncer.common.settings import suggest

Shape = tuple[int, ...]


class InitModelError(RuntimeError):
    """The init model file does not fit the model (or cannot be read): one line for the log."""


@dataclass(frozen=True)
class Slot:
    """One name of the model's state dict: its shape, what it shares storage with, its kind."""

    shape: Shape
    storage: Hashable  # equal for tied names
    parameter: bool = True


def _shape(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def match(tensors: Mapping[str, Shape], model: Mapping[str, Slot], exported: bool = False) -> list[str]:
    """What keeps the file's `tensors` (name -> shape) from initializing `model`, one line each
    (empty: it fits). `exported`: the file is `dldctl down`'s (parameters only)."""
    problems: list[str] = []
    for name, shape in tensors.items():
        slot = model.get(name)
        if slot is None:
            close = suggest(name, list(model))
            hint = f" (did you mean {close!r}?)" if close else ""
            problems.append(f"tensor {name!r} {_shape(shape)} of the file is not in the model{hint}")
        elif tuple(shape) != slot.shape:
            problems.append(f"tensor {name!r} is {_shape(shape)} in the file but {_shape(slot.shape)} in the model")
    held = {model[n].storage for n in tensors if n in model}  # grows: a tie missing is named once
    for name, slot in model.items():
        if name in tensors or slot.storage in held or (exported and not slot.parameter):
            continue
        held.add(slot.storage)
        kind = "parameter" if slot.parameter else "buffer"
        problems.append(
            f"the model's {kind} {name!r} {_shape(slot.shape)} is not in the file (nor tied to a tensor that is)"
        )
    return problems


def _storage(t: torch.Tensor) -> Hashable:
    """Equal for two names of one tensor (tied weights); a tensor without storage is its own."""
    ptr = t.untyped_storage().data_ptr() if t.numel() else 0
    if not ptr:
        return ("id", id(t))
    return (t.device.type, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def slots(module: torch.nn.Module) -> dict[str, Slot]:
    """The model's state dict as slots (tied names included, each under its own name)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return {
        name: Slot(tuple(t.shape), _storage(t), name in params) for name, t in module.state_dict(keep_vars=True).items()
    }


def load(module: torch.nn.Module, path: Path, source: str = "") -> str:
    """Copy the file's tensors into `module` (in place, on its device and dtype); returns the
    log line. InitModelError, naming the file (and `source`, the inventory's init_from)."""
    label = f"{path} (init_from {source})" if source else str(path)
    try:
        file = modelfile.read(path)
    except modelfile.ModelFileError as exc:
        raise InitModelError(f"init model {exc}{f' (init_from {source})' if source else ''}") from None
    problems = match({n: tuple(t.shape) for n, t in file.tensors.items()}, slots(module), file.exported)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InitModelError(f"init model {label}: {problems[0]}{more}; init_from must hold this run's model")
    targets = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in file.tensors.items():
            targets[name].copy_(tensor)
    return f"initialized from {Path(path).name} ({len(file.tensors)} tensors, {file.origin()})"
