"""From an inventory to a resolved run: learner ids, ports, addresses, keys, config.json.

Pure where it can be (`learner_entries`, `describe`); `write` creates the keys (0600) and the
resolved configuration that `python -m syncer` and `python -m learner` read.
"""

from __future__ import annotations

import json
import secrets
import socket
from dataclasses import dataclass
from typing import Any

from dldctl.inventory import HostSpec, Inventory
from dldctl.rundir import RunDir
from syncer.common import keys, strictjson
from syncer.common.atomic import atomic_write


@dataclass(frozen=True)
class LearnerPlan:
    """One learner: its id, host and the per-learner entry of the resolved config."""

    id: str
    host: HostSpec
    entry: dict[str, Any]


def learner_entry(lid: str, host: HostSpec, shard: int, shards: int) -> dict[str, Any]:
    """The resolved-config entry of one learner."""
    return {
        "id": lid,
        "host": host.name,
        "device": host.device,
        "batch_size": host.batch_size,
        "throttle": host.throttle,
        "nproc": host.nproc,
        "threads": host.threads,
        "env": dict(host.env),
        "shard": shard % shards,
        "shards": shards,
    }


def learner_plans(inv: Inventory) -> list[LearnerPlan]:
    """learner-0, learner-1, ... in inventory order; one data shard each."""
    pairs = inv.learner_hosts()
    return [LearnerPlan(lid, host, learner_entry(lid, host, i, len(pairs))) for i, (lid, host) in enumerate(pairs)]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def syncer_section(inv: Inventory, run: RunDir, advertise: str) -> dict[str, Any]:
    """Bind address, ports and the address learners dial."""
    all_local = all(h.local for h in inv.hosts) and inv.syncer.host == "local"
    bind = inv.syncer.bind or ("127.0.0.1" if all_local else "0.0.0.0")
    control = "127.0.0.1"
    if inv.syncer.host != "local":  # the syncer runs on an inventory host: dial that host
        advertise = control = inv.syncer.advertise or inv.host(inv.syncer.host).address
    # "dir" is relative to config.json, so it is the run directory on whichever host reads it
    return {
        "host": inv.syncer.host,
        "bind_host": bind,
        "port": inv.syncer.port or free_port(),
        "control_port": inv.syncer.control_port or free_port(),
        "advertise": inv.syncer.advertise or advertise,
        "control_address": control,
        "dir": ".",
    }


def resolved_config(inv: Inventory, run: RunDir, advertise: str) -> dict[str, Any]:
    """The JSON document every process of the run reads."""
    return {
        "version": 1,
        "run_id": f"{inv.run.name}-{secrets.token_hex(4)}",
        "run": inv.run.to_dict(),
        "syncer": syncer_section(inv, run, advertise),
        "learners": [p.entry for p in learner_plans(inv)],
        "keys": {"dir": "keys"},
        "inventory": inv.path,
    }


def write(inv: Inventory, run: RunDir, advertise: str = "127.0.0.1") -> dict[str, Any]:
    """Create keys (unless insecure) and config.json in the run directory; returns the config."""
    config = resolved_config(inv, run, advertise)
    if not inv.run.insecure:
        for name in ["syncer", "operator", *(e["id"] for e in config["learners"])]:
            keys.create(run.keys, name)
    save_config(run, config)
    return config


def save_config(run: RunDir, config: dict[str, Any]) -> None:
    atomic_write(run.config, strictjson.dumps(config, indent=1))


def load_config(run: RunDir) -> dict[str, Any]:
    return json.loads(run.config.read_text())


def add_learners(run: RunDir, config: dict[str, Any], host: HostSpec, count: int) -> list[str]:
    """Append `count` learners on `host` to the config (keys too); returns their ids."""
    existing = config["learners"]
    shards = existing[0]["shards"] if existing else 1
    next_index = 1 + max((int(e["id"].rsplit("-", 1)[1]) for e in existing), default=-1)
    new_ids = []
    for i in range(count):
        lid = f"learner-{next_index + i}"
        existing.append(learner_entry(lid, host, next_index + i, shards))
        if not config["run"].get("insecure"):
            keys.create(run.keys, lid)
        new_ids.append(lid)
    save_config(run, config)
    return new_ids


def describe(inv: Inventory) -> list[str]:
    """Human-readable lines of what `up` would do (for --dry-run)."""
    lines = [
        f"run {inv.run.name}: model {inv.run.model}, data {inv.run.data}, H={inv.run.H}, "
        f"fragments={inv.run.fragments}, quorum={inv.run.quorum}, compression={inv.run.compression}, "
        f"merge={inv.run.merge}{', INSECURE' if inv.run.insecure else ''}",
        f"syncer on {inv.syncer.host} (port {inv.syncer.port or 'auto'})",
    ]
    for plan in learner_plans(inv):
        h = plan.host
        where = "this machine" if h.local else f"{h.address} over SSH"
        lines.append(
            f"{plan.id} on {h.name} ({where}): device {h.device}, nproc {h.nproc}, "
            f"batch {h.batch_size or inv.run.batch_size}, throttle {h.throttle:g}"
        )
    lines += [f"WARNING: {risk}" for risk in inv.run.risks(len(learner_plans(inv)))]
    return lines
