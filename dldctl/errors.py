"""The operator side's one exception tree (a leaf module: it imports nothing of the project).

    DldError                      anything dldctl reports as one red line
    ├── UsageError                exit 2: the user asked for something malformed
    │   └── ConfigError           an inventory/config file is wrong (names file, key, fix)
    └── OperationError            exit 1: a well-formed request that failed
        ├── HostError             a host could not do what was asked (names the host)
        │   ├── SSHError          transport-level trouble with one host
        │   │   ├── SSHAuthError        key refused, unreadable identity file
        │   │   ├── HostKeyError        unknown or changed host key
        │   │   └── UnreachableError    connect refused / timed out / no banner
        │   ├── RemoteCommandError      a command on a host exited non-zero
        │   └── SetupError              preparing a host's Python environment failed
        ├── RunError              run directory missing, no live run, corrupt state
        ├── SyncerError           the syncer did not answer or refused a request
        └── ChaosError            a fault could not be injected or undone

Third-party exceptions (paramiko, zmq, OSError, tomllib) are mapped to these at the boundary
(`raise SSHAuthError(...) from exc`). The CLI catches DldError in one place, prints
`error: <message>` in red to stderr and exits with `exit_code`; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations


class DldError(Exception):
    """Base of every error dldctl reports to the operator as one line."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(self.line())

    def line(self) -> str:
        """The one-line form: what failed, where, and what to do."""
        return f"{self.message} ({self.hint})" if self.hint else self.message


class UsageError(DldError):
    """The request itself is malformed (bad flag value, unknown learner name, ...)."""

    exit_code = 2


class ConfigError(UsageError):
    """A configuration file is wrong; the message names the file, the key and the fix."""

    def __init__(self, path: str, key: str | None, problem: str, fix: str | None = None) -> None:
        self.path = path
        self.key = key
        where = f"{path}: [{key}]" if key else f"{path}:"
        super().__init__(f"{where} {problem}", hint=fix)


class OperationError(DldError):
    """A well-formed request that could not be carried out."""

    exit_code = 1


class Interrupted(OperationError):
    """Ctrl-C (or SIGTERM) during a command that changes a run: what it left is in the message."""

    exit_code = 130


class HostError(OperationError):
    """A host could not do what was asked; `host` names it."""

    def __init__(self, host: str, message: str, *, hint: str | None = None) -> None:
        self.host = host
        super().__init__(f"host {host}: {message}", hint=hint)


class SSHError(HostError):
    """Transport-level trouble with one host."""


class SSHAuthError(SSHError):
    """The host refused our key, or the identity file could not be read."""


class HostKeyError(SSHError):
    """The host's key is unknown (under the strict policy) or has changed."""


class UnreachableError(SSHError):
    """Connection refused, timed out, or no SSH banner."""


class RemoteCommandError(HostError):
    """A command on a host exited non-zero; carries its exit status and output tail."""

    def __init__(self, host: str, command: str, status: int, output_tail: str) -> None:
        self.command = command
        self.status = status
        self.output_tail = output_tail
        tail = output_tail.strip().splitlines()[-3:] if output_tail.strip() else []
        detail = (" | " + " | ".join(tail)) if tail else ""
        super().__init__(host, f"`{command}` exited with {status}{detail}")


class SetupError(HostError):
    """Preparing the host's Python environment failed."""


class RunError(OperationError):
    """The run directory is missing, no run is live, or its state is unreadable."""


class SyncerError(OperationError):
    """The syncer did not answer, or refused a request."""


class ChaosError(OperationError):
    """A fault could not be injected or undone."""
