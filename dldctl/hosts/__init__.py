"""Where dldctl runs things: the operator's machine (`LocalHost`) or a remote one (`SSHHost`).

Both implement `Host` (base.py): run a command, copy files, start a detached process and signal
it later by its `ProcRef` (pid plus start time, so a reused pid is never signalled by mistake).
"""

from dldctl.hosts.base import CommandResult, Host, ProcRef
from dldctl.hosts.local import LocalHost
from dldctl.hosts.ssh import SSHHost

__all__ = ["CommandResult", "Host", "LocalHost", "ProcRef", "SSHHost"]
