"""Model files a new run can start from (`[run] init_from`), as `dldctl up` checks them and the
learners read them (a leaf: torch is imported only by `read`).

Two layouts are accepted:

    final_model.pt   what `dldctl down` exports (syncer/checkpoint.py `export_model`):
                     {"state_dict": {parameter name: fp32 tensor}, "outer_steps", "versions", "run_id",
                     "tokens_merged", "held_out_loss" (the last two since the safetensors export)};
                     parameters only (no buffers), a tied weight once (GPT: no `lm_head.weight`)
    a state dict     {name: tensor}, e.g. `torch.save(model.state_dict(), path)`

`unwrap` (pure) tells them apart and checks that what it holds is tensors; `read` is the one
`torch.load` (`weights_only=True`: a file can hold tensors, never code). The run directory of
every host holds its copy as `INIT_MODEL`, named in config.json relative to that file.
`dldctl export` reads final_model.pt through `read` too, to write the safetensors export
(syncer/common/modelexport.py) of a run whose syncer could not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INIT_MODEL = "init_model.pt"  # the copy in the run directory, on every host
STATE_DICT = "state_dict"  # the key of the tensors in a file `dldctl down` exported


class ModelFileError(ValueError):
    """A model file that cannot start a run; the message says why (the caller adds the path)."""


@dataclass(frozen=True)
class ModelFile:
    """The tensors of a model file, and where they came from when `dldctl down` wrote it."""

    tensors: dict[str, Any]  # name -> torch.Tensor (on the CPU)
    exported: bool = False  # `dldctl down`'s layout: parameters only
    run_id: str | None = None
    outer_steps: int | None = None
    tokens_merged: int | None = None
    held_out_loss: float | None = None  # the syncer's evaluation of these weights, when it had one

    def origin(self) -> str:
        """'from run X at outer step S', or what the file is when no run wrote it."""
        if not self.exported:
            return "a plain state dict"
        run = self.run_id if self.run_id is not None else "?"
        step = self.outer_steps if self.outer_steps is not None else "?"
        return f"from run {run} at outer step {step}"


def unwrap(obj: Any, is_tensor: Callable[[Any], bool]) -> ModelFile:
    """The tensors of a loaded file (either layout); ModelFileError says what is wrong. Pure."""
    if not isinstance(obj, dict):
        raise ModelFileError(f"holds a {type(obj).__name__}, not a state dict ({{name: tensor}})")
    exported = isinstance(obj.get(STATE_DICT), dict)
    tensors = obj[STATE_DICT] if exported else obj
    where = f"its {STATE_DICT!r}" if exported else "it"
    if not tensors:
        raise ModelFileError(f"{where} holds no tensors")
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise ModelFileError(f"{where} has a key {name!r} that is not a tensor name")
        if not is_tensor(value):
            raise ModelFileError(f"{where} maps {name!r} to a {type(value).__name__}, not a tensor")
    if not exported:
        return ModelFile(dict(tensors))
    run_id, steps, merged, loss = (obj.get(k) for k in ("run_id", "outer_steps", "tokens_merged", "held_out_loss"))
    return ModelFile(
        dict(tensors),
        exported=True,
        run_id=run_id if isinstance(run_id, str) else None,
        outer_steps=_int(steps),
        tokens_merged=_int(merged),
        held_out_loss=float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None,
    )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read(path: Path | str) -> ModelFile:
    """Load a model file on the CPU, tensors only; ModelFileError (one line, naming the file)."""
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ModelFileError(f"{path}: is a directory, not a model file") from None
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except Exception as exc:  # torch.load of arbitrary bytes raises nearly anything
        raise ModelFileError(f"{path}: {load_failure(exc)}") from None
    try:
        return unwrap(obj, lambda v: isinstance(v, torch.Tensor))
    except ModelFileError as exc:
        raise ModelFileError(f"{path}: {exc}") from None


def load_failure(exc: BaseException) -> str:
    """Why torch.load(weights_only=True) failed, in one line (its own message is a page)."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        cause = text.split(marker, 1)[1].strip().split("\n")[0].split(". ")[0].strip()
        if cause.startswith("Unsupported global"):
            return (
                f"holds pickled objects, not only tensors ({cause[:160]}); "
                "save a state dict: torch.save(model.state_dict(), path)"
            )
        return f"not a torch file (unpickling failed: {cause[:160]})"
    if isinstance(exc, EOFError):
        return "not a torch file (it ends early: empty or cut off)"
    first = text.strip().split("\n")[0][:160]
    return f"not a torch file ({type(exc).__name__}{': ' + first if first else ''})"
