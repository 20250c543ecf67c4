"""What goes into a run and what comes out, written and read without dldctl: an inventory's TOML
(`inventory_text`, `local_host`), a run's `config.json` and keys for processes started by hand
(`local_config`), and the JSON-lines records a run wrote (`read_jsonl`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dldctl.ports import free_port
from syncer.common import jsonlread, keys


def toml_value(value: Any) -> str:
    """One TOML value: str, bool, int, float, a list of those, or a flat dict as an inline table."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def inventory_text(
    run: Mapping[str, Any],
    hosts: list[dict[str, Any]] | None = None,
    syncer: Mapping[str, Any] | None = None,
    tables: Mapping[str, Mapping[str, Any]] | None = None,
) -> str:
    """An inventory: the `[run]` table, a `[syncer]` table if given, other tables (`[ssh]`,
    `[model]`, ...) from `tables`, one `[[hosts]]` table per host."""
    lines = ["[run]"] + [f"{k} = {toml_value(v)}" for k, v in run.items()]
    if syncer:
        lines += ["", "[syncer]"] + [f"{k} = {toml_value(v)}" for k, v in syncer.items()]
    for name, table in (tables or {}).items():
        lines += ["", f"[{name}]"] + [f"{k} = {toml_value(v)}" for k, v in table.items()]
    for host in hosts or []:
        lines += ["", "[[hosts]]"] + [f"{k} = {toml_value(v)}" for k, v in host.items()]
    return "\n".join(lines) + "\n"


def local_host(name: str, learners: int, **extra: Any) -> dict[str, Any]:
    """A `[[hosts]]` entry on this machine: one torch thread per learner unless `extra` says otherwise."""
    return {"name": name, "address": "local", "learners": learners, "threads": 1, **extra}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON record of a file (a torn last line is skipped); [] if it is missing."""
    return list(jsonlread.read(path))


def local_config(directory: Path, run: Mapping[str, Any], entries: list[dict[str, Any]], run_id: str) -> Path:
    """What `dldctl up` writes for a run on this machine, without dldctl: `config.json` (the syncer
    on 127.0.0.1, free ports) and, unless `run` is insecure, CURVE keys for the syncer, the operator
    and every learner entry."""
    directory.mkdir(parents=True, exist_ok=True)
    if not run.get("insecure", False):
        for name in ["syncer", "operator", *(e["id"] for e in entries)]:
            keys.create(directory / "keys", name)
    syncer = {"host": "local", "bind_host": "127.0.0.1", "port": free_port(), "control_port": free_port()}
    cfg = {
        "version": 1,
        "run_id": run_id,
        "run": dict(run),
        "syncer": {**syncer, "advertise": "127.0.0.1", "dir": str(directory)},
        "learners": entries,
        "keys": {"dir": "keys"},
    }
    path = directory / "config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path
