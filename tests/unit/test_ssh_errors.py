"""What a failed SSH connect means (dldctl/hosts/ssherrors.py): pure, no network.

Each case is the evidence a real attempt gathers (tests/e2e/test_ssh_errors.py produces them
against real sshd and socket servers); here every branch, and the rule that MaxStartups is named
as the cause only when sshd said so.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import paramiko
import pytest

from dldctl.errors import HostKeyError, SSHAuthError, SSHError, UnreachableError
from dldctl.hosts.sshconfig import SSHTarget
from dldctl.hosts.sshconnect import Deadline
from dldctl.hosts.ssherrors import (
    ConnectEvidence,
    classify_connect_error,
    pre_banner_text,
    sftp_refused_error,
    sftp_start_error,
)

T = SSHTarget("10.0.0.9", 2222, "alice", ("/k/id",), True, Path("/k/known_hosts"), None)
BANNER_FAIL = paramiko.SSHException("Error reading SSH protocol banner")


def classify(exc: BaseException, ev: ConnectEvidence, attempts: int = 1) -> tuple[bool, str, type]:
    retry, error = classify_connect_error("gpu-a", T, exc, ev, 5.0, attempts)
    return retry, error.line(), type(error)


def test_pre_banner_text() -> None:
    assert pre_banner_text(b"Exceeded MaxStartups\r\n") == "Exceeded MaxStartups"
    assert pre_banner_text(b"hello\r\n\r\nworld\nSSH-2.0-OpenSSH_9.2\r\nbinary") == "hello / world"
    assert pre_banner_text(b"SSH-2.0-x\r\n") == "" and pre_banner_text(b"") == ""
    assert pre_banner_text(b"a\x00\x1bb\xff") == "a??b\ufffd"
    assert pre_banner_text(b"x" * 500, limit=20) == "x" * 17 + "..."


def test_maxstartups_named_only_when_sshd_said_so() -> None:
    said = ConnectEvidence(phase="banner", received=b"Exceeded MaxStartups\r\n", closed=True)
    retry, line, kind = classify(BANNER_FAIL, said, attempts=4)
    assert retry and kind is UnreachableError
    assert line.startswith('host gpu-a: 10.0.0.9:2222 refused new connections: its sshd said "Exceeded MaxStartups"')
    assert "(4 attempts)" in line and "raise MaxStartups" in line
    for ev in (ConnectEvidence(phase="banner", closed=True), ConnectEvidence(phase="banner", reset=True)):
        retry, line, kind = classify(BANNER_FAIL, ev, attempts=6)
        assert retry and kind is UnreachableError and "refused new connections" not in line
        assert (
            "before the SSH banner (6 attempts): not an SSH server on that port, a firewall or proxy, or sshd " in line
        )
        assert ("reset it" if ev.reset else "closed it") in line


def test_other_text_before_closing_is_quoted_and_not_retried() -> None:
    ev = ConnectEvidence(phase="banner", received=b"HTTP/1.1 400 Bad Request\r\n\r\n", closed=True)
    retry, line, _ = classify(BANNER_FAIL, ev)
    assert not retry and "sending 'HTTP/1.1 400 Bad Request' instead of an SSH banner" in line
    assert "MaxStartups" not in line


@pytest.mark.parametrize(
    ("phase", "received", "says"),
    [
        ("tcp", b"", "no TCP connection to 10.0.0.9:2222 within 5 s (connect_timeout)"),
        ("banner", b"", "no SSH handshake from 10.0.0.9:2222 within 5 s (connect_timeout): it accepted the TCP "),
        ("banner", b"hi\r\n", "within 5 s (connect_timeout): it sent 'hi' but no SSH banner"),
        ("kex", b"SSH-2.0-x\r\n", "within 5 s (connect_timeout): the key exchange did not finish"),
        ("auth", b"SSH-2.0-x\r\n", "within 5 s (connect_timeout): authentication did not finish"),
    ],
)
def test_timeouts_say_where_they_stopped(phase: str, received: bytes, says: str) -> None:
    # whatever paramiko said once our deadline closed the socket: it is the timeout that counts
    for exc in (paramiko.SSHException("No existing session"), paramiko.AuthenticationException("failed"), EOFError()):
        retry, line, kind = classify(exc, ConnectEvidence(phase=phase, timed_out=True, received=received))
        assert not retry and kind is UnreachableError and says in line, line
        assert "No existing session" not in line and "MaxStartups" not in line
    _, line, _ = classify(EOFError(), ConnectEvidence(phase="banner", timed_out=True), attempts=3)
    assert "(after 2 dropped attempts)" in line


def test_tcp_failures() -> None:
    tcp = ConnectEvidence(phase="tcp")
    assert classify(ConnectionRefusedError(111, "refused"), tcp)[1].startswith(
        "host gpu-a: connection refused by 10.0.0.9:2222"
    )
    assert "cannot resolve 10.0.0.9" in classify(socket.gaierror(-2, "Name or service not known"), tcp)[1]
    assert "cannot connect to 10.0.0.9:2222: No route to host" in classify(OSError(113, "No route to host"), tcp)[1]


def test_auth_host_key_and_other_failures() -> None:
    auth = ConnectEvidence(phase="auth")
    retry, line, kind = classify(paramiko.AuthenticationException("Authentication failed."), auth)
    assert not retry and kind is SSHAuthError and "refused our key for user alice (tried /k/id" in line
    policy = HostKeyError("gpu-a", "unknown host key")
    assert classify_connect_error("gpu-a", T, policy, auth, 5.0, 1) == (False, policy)
    retry, line, kind = classify(ConnectionResetError(104, "reset"), ConnectEvidence(phase="kex", reset=True), 2)
    assert retry and kind is SSHError and "reset the connection during the key exchange (2 attempts)" in line
    retry, line, _ = classify(EOFError(), ConnectEvidence(phase="kex", closed=True))
    assert not retry and "closed the connection during the key exchange" in line
    retry, line, _ = classify(paramiko.SSHException("Incompatible version (1.5 instead of 2.0)"), ConnectEvidence())
    assert (
        not retry
        and line == "host gpu-a: SSH handshake with 10.0.0.9:2222 failed: Incompatible version (1.5 instead of 2.0)"
    )


def test_sftp_refused() -> None:
    line = sftp_refused_error("gpu-a", T).line()
    assert line.startswith("host gpu-a: the sshd on 10.0.0.9:2222 has no SFTP subsystem")
    assert "`Subsystem sftp internal-sftp`" in line and "restart sshd" in line


@pytest.mark.parametrize(
    ("exc", "status", "stderr", "says"),
    [
        (EOFError(), 127, "", "did not start: it exited with status 127: program not found"),
        (EOFError(), 1, "oops\nbad config\n", "did not start: it exited with status 1; it said: oops | bad config"),
        (EOFError(), None, "", "did not start: it closed the channel at once"),
        (TimeoutError(), None, "", "did not start: no SFTP version reply within 2s"),
        (paramiko.SFTPError("Garbage packet received"), None, "", "something other than SFTP, such as text a login"),
    ],
)
def test_sftp_server_did_not_start(exc: BaseException, status: int | None, stderr: str, says: str) -> None:
    line = sftp_start_error("gpu-a", T, exc, status, stderr, 2.0).line()
    assert line.startswith("host gpu-a: the SFTP server on 10.0.0.9:2222 did not start: ") and says in line, line
    assert "`Subsystem sftp` line" in line


def test_the_connect_deadline_fires_once_or_not_at_all() -> None:
    fired = threading.Event()
    timer = Deadline(0.05, fired.set)
    assert fired.wait(2) and timer.fired and timer.disarm() is False
    calls: list[int] = []
    timer = Deadline(5, lambda: calls.append(1))
    assert timer.disarm() is True and not timer.fired and calls == []
