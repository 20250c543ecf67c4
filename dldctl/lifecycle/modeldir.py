"""An `hf:` model's directory, on the operator's side: the run keeps its own copy, without weights.

    copy      into the new run directory as `hf_model/` (config.json, tokenizer files, generation
              config...; weight files left out: a run starts from the seed, or from `[run]
              init_from`), named in config.json relative to it (`model_dir`)
    push      with the run files, to `<remote run>/hf_model/` on each remote host
    describe  the lines `up --dry-run` prints

So every learner and syncer process builds the model from the run's copy on its own host, the
export (`dldctl export --format hf`) reads its class and tokenizer from the same files, and the
user's directory may change or go away after `up`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dldctl import modelspec
from dldctl.errors import ConfigError, OperationError
from dldctl.hosts import Host
from dldctl.inventory import Inventory
from dldctl.rundir import RunDir
from syncer.common.resolved import ResolvedConfig

COPY = "hf_model"  # in the run directory, on every host


def files(model: str) -> list[Path]:
    """The files of an `hf:` model's directory that travel: every regular file at its top level
    but the weights (sorted)."""
    root = Path(modelspec.hf_path(model))
    return sorted(
        p for p in root.iterdir() if p.is_file() and not p.name.endswith(modelspec.WEIGHT_SUFFIXES) and p.name[0] != "."
    )


def weights(model: str) -> list[str]:
    """The weight files the copy leaves out (what `up --dry-run` mentions)."""
    root = Path(modelspec.hf_path(model))
    return sorted(p.name for p in root.iterdir() if p.is_file() and p.name.endswith(modelspec.WEIGHT_SUFFIXES))


def check(inv: Inventory) -> None:
    """Before anything starts: the directory's travelling files are within HF_COPY_MAX_MB."""
    if modelspec.kind(inv.run.model) != "hf":
        return
    size = sum(p.stat().st_size for p in files(inv.run.model))
    if size > modelspec.HF_COPY_MAX_MB * (1 << 20):
        raise ConfigError(
            inv.path,
            "run.model",
            f"{modelspec.hf_path(inv.run.model)} holds {size / (1 << 20):.0f} MB besides its weights",
            "keep only config.json and the tokenizer files there",
        )


def copy(inv: Inventory, run: RunDir) -> str | None:
    """The run's copy (COPY, relative to config.json); None for a model that is not `hf:`."""
    if modelspec.kind(inv.run.model) != "hf":
        return None
    dest = run.path / COPY
    try:
        dest.mkdir(mode=0o700, exist_ok=True)
        for source in files(inv.run.model):
            shutil.copyfile(source, dest / source.name)
    except OSError as exc:
        raise OperationError(
            f"cannot copy {modelspec.hf_path(inv.run.model)} to {dest}: {exc.strerror or exc}"
        ) from None
    return COPY


def push(host: Host, run: RunDir, remote_run: str, config: ResolvedConfig) -> None:
    """The run's copy to a remote run directory (a file of the same size there is kept)."""
    local = config.model_dir_path(run.path)
    if local is None or config.model_dir is None:
        return
    remote = f"{remote_run}/{config.model_dir}"
    host.mkdir(remote, 0o700)
    for source in sorted(p for p in local.iterdir() if p.is_file()):
        if host.size(f"{remote}/{source.name}") != source.stat().st_size:
            host.put_file(source, f"{remote}/{source.name}", 0o600)


def describe(inv: Inventory) -> list[str]:
    """What `up --dry-run` says about an `hf:` model (nothing for another kind)."""
    if modelspec.kind(inv.run.model) != "hf":
        return []
    travel = ", ".join(p.name for p in files(inv.run.model))
    lines = [f"hf model {modelspec.hf_path(inv.run.model)}: {travel} copied into the run ({COPY}/) and to every host"]
    left = weights(inv.run.model)
    if left and not inv.run.init_from:
        lines.append(
            f"  its weights ({', '.join(left)}) are not used: the run starts from the seed's init; "
            "set [run] init_from to that directory to continue pre-training from them"
        )
    if inv.model_args:
        lines.append("  [model] overrides: " + ", ".join(f"{k} = {v!r}" for k, v in inv.model_args.items()))
    return lines
