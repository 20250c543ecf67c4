"""`[run] init_from`: the model file a new run starts from, on the operator's side.

    check     first thing at `up`, before any host or run directory: the file exists and is a
              model file (syncer/common/modelfile.py: a state dict of tensors, `dldctl down`'s
              final_model.pt, a .safetensors file, or a Hugging Face save_pretrained directory);
              anything else is one ConfigError naming the file and why
    copy      into the new run directory as `init_model.pt` (a torch file) or
              `init_model.safetensors` (a safetensors source; shards merged into one file),
              with config.json (plan.write)
    push      with the run files, to `<remote run>/<that name>` on a remote host
    describe  the line `up --dry-run` prints

A safetensors source is checked and copied by its headers alone: the operator needs no torch for
it (a torch file is read with torch, as before).

config.json names the copy relative to itself (`init_model`, syncer/common/resolved.py), so it
is the run directory's copy on whichever host reads it; every learner loads it into the model it
built (learner/initmodel.py). Only a brand-new run uses it: a resumed run, and any learner that
joins a run with a global model, takes the syncer's state as always.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dldctl.errors import ConfigError, OperationError
from dldctl.hosts import Host
from dldctl.inventory import Inventory
from dldctl.rundir import RunDir
from syncer.common import modelfile
from syncer.common.atomic import atomic_file
from syncer.common.resolved import ResolvedConfig

KEY = "run.init_from"
FIX = (
    "point init_from at a final_model.pt of `dldctl down`, a torch.save(model.state_dict(), path) file, "
    "a .safetensors file or a save_pretrained directory"
)


def check(inv: Inventory) -> modelfile.ModelFile | modelfile.Safetensors | None:
    """The model file `[run] init_from` names, read and checked; None when it names none."""
    if not inv.run.init_from:
        return None
    path = Path(inv.run.init_from).expanduser()
    if modelfile.is_safetensors(path):
        try:
            return modelfile.scan(path)  # headers only: no torch here
        except modelfile.ModelFileError as exc:
            raise ConfigError(inv.path, KEY, str(exc), FIX) from None
    if not path.is_file():  # a directory is read as safetensors, above
        raise ConfigError(inv.path, KEY, f"{path}: no such file", FIX)
    try:
        return modelfile.read(path)
    except modelfile.ModelFileError as exc:
        raise ConfigError(inv.path, KEY, str(exc), FIX) from None


def copy(inv: Inventory, run: RunDir) -> None:
    """The init model (if the inventory names one; `check` has read it) into the run directory."""
    if not inv.run.init_from:
        return
    source = Path(inv.run.init_from).expanduser()
    copy = run.path / modelfile.copy_name(source)
    try:
        if modelfile.is_safetensors(source):
            scanned = modelfile.scan(source)  # again: the source may have changed since `check`
            with atomic_file(copy, 0o600) as dst:
                modelfile.write_single(scanned, dst)
            return
        with open(source, "rb") as src, atomic_file(copy, 0o600) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except modelfile.ModelFileError as exc:
        raise ConfigError(inv.path, KEY, str(exc), FIX) from None
    except OSError as exc:
        raise OperationError(f"cannot copy {source} to {copy}: {exc.strerror or exc}") from None


def push(host: Host, run: RunDir, remote_run: str, config: ResolvedConfig) -> None:
    """The run's init model to a remote run directory (0600), unless a copy of its size is there."""
    if config.init_model is None:
        return
    local = config.init_model_path(run.path)
    assert local is not None
    remote = f"{remote_run}/{config.init_model}"
    if host.size(remote) != local.stat().st_size:
        host.put_file(local, remote, 0o600)


def describe(inv: Inventory) -> list[str]:
    """What `up --dry-run` says about init_from (nothing when it is not set)."""
    if not inv.run.init_from:
        return []
    return [
        f"init_from {inv.run.init_from}: a new run's learners start from it (copied into the run "
        f"directory as {modelfile.copy_name(inv.run.init_from)}; checked at up)"
    ]
