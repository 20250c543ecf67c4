"""What a failed SSH connect or SFTP open means: the error to report, and whether to retry.

Pure functions of the failure and of what the connect attempt saw (`ConnectEvidence`, gathered
by sshconnect.py), so that every message can be unit-tested without a network. A message
asserts only what the evidence shows:

    phase    how far the attempt got: "tcp", "banner" (TCP up, waiting for `SSH-2.0-...`),
             "kex" (banner received, key exchange running), "auth" (authenticating)
    timed_out   our deadline (connect_timeout) ended the attempt, whatever paramiko then said
                ("No existing session", "Authentication failed." after we closed the socket)
    received    the bytes the host sent before its banner, or instead of it; OpenSSH's sshd
                writes "Exceeded MaxStartups" there before dropping a connection past MaxStartups,
                which is the only case where MaxStartups is named as the cause
    closed / reset  the host closed (EOF) or reset the connection while we read from it

A connection closed or reset before the banner is retried (sshd past MaxStartups does that, and
older sshd versions say nothing when they do), as is a reset later on; nothing else is.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import paramiko

from dldctl.errors import DldError, HostError, SSHAuthError, SSHError, UnreachableError
from dldctl.hosts.sshconfig import SSHTarget, changed_key_error

PHASES = {"tcp": "TCP connect", "banner": "SSH banner", "kex": "key exchange", "auth": "authentication"}
MAXSTARTUPS_TEXT = "Exceeded MaxStartups"


@dataclass(frozen=True)
class ConnectEvidence:
    """What one connect attempt saw (see the module docstring)."""

    phase: str = "banner"
    timed_out: bool = False
    received: bytes = b""
    closed: bool = False
    reset: bool = False


def pre_banner_text(received: bytes, limit: int = 100) -> str:
    """The lines a host sent before its `SSH-` banner, printable, joined by " / ", shortened."""
    lines = []
    for raw in received.splitlines():
        if raw.startswith(b"SSH-"):
            break
        line = "".join(c if c.isprintable() else "?" for c in raw.decode("utf-8", "replace")).strip()
        if line:
            lines.append(line)
    text = " / ".join(lines)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _ssh_cmd(t: SSHTarget) -> str:
    port = f" -p {t.port}" if t.port != 22 else ""
    return f"ssh -v{port} {t.user}@{t.address}"


def timeout_error(host: str, t: SSHTarget, ev: ConnectEvidence, connect_timeout: float, dropped: int) -> DldError:
    """The attempt ran out of connect_timeout; say at which step and what the host had sent."""
    where = f"{t.address}:{t.port}"
    within = f"within {connect_timeout:g} s (connect_timeout)"
    earlier = f" (after {dropped} dropped attempt{'s' * (dropped > 1)})" if dropped else ""
    if ev.phase == "tcp":
        return UnreachableError(
            host,
            f"no TCP connection to {where} {within}{earlier}",
            hint="is the host up, the address right, and the port open in its firewall?",
        )
    if ev.phase == "banner":
        said = pre_banner_text(ev.received)
        what = (
            f"it sent {said!r} but no SSH banner" if said else "it accepted the TCP connection but sent no SSH banner"
        )
        return UnreachableError(
            host,
            f"no SSH handshake from {where} {within}: {what}{earlier}",
            hint="sshd there may be hung or stopped, or a firewall or proxy holds the port instead of sshd; "
            f"try `{_ssh_cmd(t)}`",
        )
    step = "the key exchange did not finish" if ev.phase == "kex" else "authentication did not finish"
    return UnreachableError(
        host,
        f"no SSH handshake from {where} {within}: {step}{earlier}",
        hint="the host or its sshd may be overloaded or hung"
        + (", or its authentication (PAM, LDAP, DNS) slow" if ev.phase == "auth" else ""),
    )


def dropped_error(host: str, t: SSHTarget, ev: ConnectEvidence, attempts: int) -> tuple[bool, DldError]:
    """The host closed or reset the connection before its banner: retry unless it said why."""
    where = f"{t.address}:{t.port}"
    tries = f"{attempts} attempt{'s' * (attempts > 1)}"
    said = pre_banner_text(ev.received)
    if MAXSTARTUPS_TEXT.lower() in said.lower():
        return True, UnreachableError(
            host,
            f'{where} refused new connections: its sshd said "{MAXSTARTUPS_TEXT}" ({tries})',
            hint="too many unauthenticated connections to it at once: raise MaxStartups in its sshd_config, "
            "or connect from fewer places at a time",
        )
    how = "reset it" if ev.reset else "closed it"
    if said:
        return False, UnreachableError(
            host,
            f"{where} accepted the connection and {how}, sending {said!r} instead of an SSH banner",
            hint=f"is that port sshd's? if it is, its log says why it refused us; try `{_ssh_cmd(t)}`",
        )
    return True, UnreachableError(
        host,
        f"{where} accepted the connection and {how} before the SSH banner ({tries}): not an SSH server on "
        "that port, a firewall or proxy, or sshd refusing new connections (MaxStartups)",
        hint=f"check the address and port, and try `{_ssh_cmd(t)}`",
    )


def classify_connect_error(
    host: str, t: SSHTarget, exc: BaseException, ev: ConnectEvidence, connect_timeout: float, attempts: int
) -> tuple[bool, DldError]:
    """Map a failed connect attempt to (worth retrying?, the error to report)."""
    where = f"{t.address}:{t.port}"
    if isinstance(exc, DldError):
        return False, exc  # our host key policy
    if isinstance(exc, paramiko.BadHostKeyException):
        return False, changed_key_error(host, t, exc)
    if ev.timed_out:
        return False, timeout_error(host, t, ev, connect_timeout, attempts - 1)
    if isinstance(exc, paramiko.AuthenticationException) or "No authentication methods available" in str(exc):
        tried = ", ".join(t.identity_files) or "~/.ssh/id_*"
        return False, SSHAuthError(
            host,
            f"{where} refused our key for user {t.user} (tried {tried} and the SSH agent)",
            hint="add the public key to ~/.ssh/authorized_keys on the host, or fix [ssh] user / identity_file",
        )
    if ev.phase == "tcp":
        return False, _tcp_error(host, where, exc)
    if ev.phase == "banner" and (ev.closed or ev.reset):
        return dropped_error(host, t, ev, attempts)
    if ev.reset or isinstance(exc, ConnectionResetError):
        step = PHASES.get(ev.phase, ev.phase)
        return True, SSHError(host, f"{where} reset the connection during the {step} ({attempts} attempts)")
    if ev.closed or isinstance(exc, EOFError):
        step = PHASES.get(ev.phase, ev.phase)
        return False, SSHError(
            host,
            f"{where} closed the connection during the {step}: {exc or type(exc).__name__}",
            hint=f"its sshd log says why; try `{_ssh_cmd(t)}`",
        )
    return False, SSHError(host, f"SSH handshake with {where} failed: {exc}")


def _tcp_error(host: str, where: str, exc: BaseException) -> DldError:
    """The TCP connect itself failed (a timeout there is `timeout_error`'s)."""
    if isinstance(exc, ConnectionRefusedError):
        return UnreachableError(
            host, f"connection refused by {where}", hint="is sshd running there, and is the port right?"
        )
    if isinstance(exc, socket.gaierror):
        return UnreachableError(host, f"cannot resolve {where.rpartition(':')[0]}", hint="check the host's address")
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return UnreachableError(host, f"cannot connect to {where}: {reason}")


def sftp_refused_error(host: str, t: SSHTarget) -> HostError:
    """sshd accepted us and opened a session, then refused the "sftp" subsystem request."""
    return HostError(
        host,
        f"the sshd on {t.address}:{t.port} has no SFTP subsystem: it refused the sftp subsystem request",
        hint="add `Subsystem sftp internal-sftp` or `Subsystem sftp /usr/lib/openssh/sftp-server` to the "
        "host's /etc/ssh/sshd_config, then restart sshd",
    )


def sftp_start_error(
    host: str, t: SSHTarget, exc: BaseException, status: int | None, stderr: str, op_timeout: float
) -> HostError:
    """sshd accepted the sftp subsystem request, but no SFTP server answered on the channel:
    the configured program is missing or fails, or something printed text before it spoke.
    `status` is the subsystem's exit status if it exited (127: the program was not found)."""
    if isinstance(exc, TimeoutError):
        what = f"no SFTP version reply within {op_timeout:g}s"
    elif status is not None and status != 0:
        what = f"it exited with status {status}" + (": program not found" if status == 127 else "")
    elif isinstance(exc, EOFError) or "EOF" in str(exc):
        what = "it closed the channel at once"
    elif "Garbage packet" in str(exc):
        what = "the channel carried something other than SFTP, such as text a login script printed"
    else:
        what = str(exc) or type(exc).__name__
    said = " | ".join(line.strip() for line in stderr.strip().splitlines()[-2:] if line.strip())
    return HostError(
        host,
        f"the SFTP server on {t.address}:{t.port} did not start: {what}" + (f"; it said: {said}" if said else ""),
        hint="check the `Subsystem sftp` line of the host's sshd_config: `internal-sftp` needs no program; "
        "and that the user's shell startup files print nothing when not interactive",
    )
