"""The inventory's [metrics] table: which sinks the supervisor feeds (all off by default).

    [metrics]
    tensorboard = true            # scalars into <run dir>/tensorboard/ (tensorboard --logdir ...)
    prometheus_port = 9464        # serve /metrics on this port (0 = off)
    prometheus_bind = "127.0.0.1" # the address it listens on ("0.0.0.0" for a remote Prometheus)
    wandb = true                  # Weights & Biases, when the package is installed
    wandb_project = "dldctl"
    wandb_mode = "offline"        # offline (synced later with `wandb sync`) | online

Parsed by `dldctl/inventory.py` like every other table (unknown keys, wrong types: one line naming
the key); `validate` holds the cross-field rules. The sinks themselves are dldctl/supervise/sinks.py.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from dldctl.errors import ConfigError

WANDB_MODES = ("offline", "online")


@dataclass(frozen=True)
class MetricsSpec:
    """[metrics]: the sinks of a run's metrics and events."""

    tensorboard: bool = False
    prometheus_port: int = 0  # 0 = no Prometheus endpoint
    prometheus_bind: str = "127.0.0.1"
    wandb: bool = False
    wandb_project: str = "dldctl"
    wandb_entity: str = ""  # "" = the API key's default entity
    wandb_mode: str = "offline"

    @property
    def any(self) -> bool:
        return self.tensorboard or self.prometheus_port > 0 or self.wandb


def validate(spec: MetricsSpec, path: str) -> None:
    """Cross-field rules of [metrics]; a ConfigError names the key and the fix."""
    if not 0 <= spec.prometheus_port <= 65535:
        raise ConfigError(
            path, "metrics.prometheus_port", f"{spec.prometheus_port} is not a port", "use 1-65535, or 0 for none"
        )
    try:
        ipaddress.ip_address(spec.prometheus_bind)
    except ValueError:
        raise ConfigError(
            path,
            "metrics.prometheus_bind",
            f"{spec.prometheus_bind!r} is not an IP address",
            'use "127.0.0.1" (this machine only) or "0.0.0.0" (every interface)',
        ) from None
    if spec.wandb_mode not in WANDB_MODES:
        raise ConfigError(
            path, "metrics.wandb_mode", f"{spec.wandb_mode!r} is not a mode", f"use one of {', '.join(WANDB_MODES)}"
        )
    if spec.wandb and not spec.wandb_project.strip():
        raise ConfigError(path, "metrics.wandb_project", "is empty", 'name the project, e.g. wandb_project = "dldctl"')
