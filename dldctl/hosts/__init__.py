"""Where dldctl runs things: the operator's machine (`LocalHost`) or a remote one (`SSHHost`).

Both implement `Host` (base.py): run a command, copy files, start a detached process and signal
it later by its `ProcRef` (pid plus start time, so a reused pid is never signalled by mistake).
"""

from typing import TYPE_CHECKING, Any

from dldctl.hosts.base import CommandResult, Host, ProcRef
from dldctl.hosts.local import LocalHost

if TYPE_CHECKING:
    from dldctl.hosts.ssh import SSHHost

__all__ = ["CommandResult", "Host", "LocalHost", "ProcRef", "SSHHost"]


def __getattr__(name: str) -> Any:
    """`SSHHost` on first use: it brings paramiko (0.1 s of every command's start), and a command
    on a run of local hosts only (`status`, `chaos`, `logs`) never needs it."""
    if name == "SSHHost":
        from dldctl.hosts.ssh import SSHHost

        return SSHHost
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
