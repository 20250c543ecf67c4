"""The optional dependencies (pip extras) and what on this machine needs them, checked early.

    pip install dldctl              the operator: every command that drives remote hosts, no torch
    pip install 'dldctl[train]'     + torch: learners or the syncer on this machine (the built-in default)
    pip install 'dldctl[plot]'      + matplotlib: `dldctl report`, `dldctl simulate goodput --plot`
    pip install 'dldctl[tensorboard]' / '[prometheus]' / '[wandb]'   the [metrics] sinks

torch is a range in the `train` extra (`torch>=2.1,<3`), so a CUDA torch installed first is kept.
A command that needs an extra this Python lacks fails before it touches anything, with one line
naming what is missing and the fix; nothing here imports torch or matplotlib (a find_spec only).
"""

from __future__ import annotations

import importlib.util
import sys

from dldctl import shards
from dldctl.errors import UsageError
from dldctl.inventory import Inventory
from syncer.common import modelfile

# module -> the extra that installs it
EXTRAS = {
    "torch": "train",
    "matplotlib": "plot",
    "tensorboard": "tensorboard",
    "prometheus_client": "prometheus",
    "wandb": "wandb",
    "transformers": "hf",  # `dldctl export RUN --format hf`
    "tokenizers": "data",  # text data tokenized with [run] tokenizer (docs/data.md); also in `hf`
    "pyarrow": "data",  # Parquet data
}


def installed(module: str) -> bool:
    """Whether this Python can import `module` (looked up, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or a blocker on sys.meta_path
        return False


def fix(module: str) -> str:
    """The command that installs `module` as dldctl's extra."""
    return f"pip install 'dldctl[{EXTRAS[module]}]'"


def require(module: str, needed_by: str) -> None:
    """UsageError (exit 2) naming what needs `module` and the fix, unless this Python has it."""
    if installed(module):
        return
    hint = fix(module) + (", which keeps a CUDA torch installed first" if module == "torch" else "")
    raise UsageError(f"{needed_by} {module}, and this Python ({sys.executable}) has none", hint=hint)


def syncer_here(inv: Inventory) -> bool:
    """Whether the run's syncer, or any of its shards, runs on this machine ("local", or a host
    whose address is local)."""
    where = shards.hosts_of(inv.syncer.host, inv.syncer.shard_hosts, inv.syncer.shards)
    return any(h == "local" or inv.host(h).local for h in where)


def torch_users(inv: Inventory) -> list[str]:
    """What of `inv` runs in this machine's Python and imports torch there."""
    users = ["the syncer"] if syncer_here(inv) else []
    local = [h.name for h in inv.hosts if h.local and h.learners > 0]
    if local:
        users.append(f"the learners on {', '.join(local)}")
    if inv.run.init_from and not modelfile.is_safetensors(inv.run.init_from):  # safetensors: headers, no torch
        users.append("the check of [run] init_from")
    return users


def require_for_run(inv: Inventory) -> None:
    """Before `up` touches a host: torch here if anything of the run needs it here."""
    users = torch_users(inv)
    if users:
        require("torch", f"this machine runs {' and '.join(users)}, which need")
    here = [u for u in users if not u.startswith("the check")]
    if here and inv.run.model.startswith("hf:"):  # modelspec.HF: the learners and syncer build it with transformers
        require("transformers", f"model {inv.run.model!r} is built by {' and '.join(here)} on this machine, which need")
    for module, key in data_modules(inv) if here else []:
        require(
            module,
            f"[run] {key} = {getattr(inv.run, key)!r} is read by {' and '.join(here)} on this machine, which need",
        )
    for module, key in exporter_modules(inv):
        require(module, f"[metrics] {key} in {inv.path} needs")


def data_modules(inv: Inventory) -> list[tuple[str, str]]:
    """(module, [run] key) the run's data needs where it is read: a tokenizer, Parquet."""
    wanted = [("tokenizers", "tokenizer", bool(inv.run.tokenizer)), ("pyarrow", "data", ".parquet" in inv.run.data)]
    return [(module, key) for module, key, on in wanted if on]


def exporter_modules(inv: Inventory) -> list[tuple[str, str]]:
    """(module, [metrics] key) of each sink the run turns on (the supervisor, here, runs them)."""
    m = inv.metrics
    wanted = [
        ("tensorboard", "tensorboard", m.tensorboard),
        ("prometheus_client", "prometheus_port", m.prometheus_port > 0),
    ]
    wanted.append(("wandb", "wandb", m.wandb))
    return [(module, key) for module, key, on in wanted if on]
