"""Opening one SSH connection: load the identity keys, shake hands, retry what is transient;
and opening the SFTP channel on it.

`SSHHost` (ssh.py) keeps one connection per host and calls `connect` whenever it has none or
the one it had dropped, and `open_sftp` when it needs its SFTP channel. This module is those
steps, as functions of the resolved `SSHTarget` (sshconfig.py), the host-key policy and the
host's timeouts; its only state is the process-wide limit of 6 handshakes at a time (sshd's
MaxStartups, see ssh.py's docstring).

`connect_timeout` bounds the whole connect: TCP, banner, key exchange and authentication of
every attempt, plus the pauses between attempts (time spent waiting for one of the 6 handshake
slots does not count). paramiko's own timeouts are per step and add up (and its key-exchange
wait returns silently, leaving "No existing session" to the next step), so each attempt runs
under our own deadline: a timer that shuts the socket down when the time is up. A connection
closed or reset before the banner is retried, up to 6 attempts, with capped, jittered
exponential backoff, while the budget lasts; every other failure is reported at once. What the
attempt saw goes to `classify_connect_error` (ssherrors.py), which words the error.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import paramiko

from dldctl.errors import SSHAuthError, SSHError
from dldctl.hosts.sshconfig import SSHTarget, load_identity, make_policy
from dldctl.hosts.ssherrors import ConnectEvidence, classify_connect_error, sftp_refused_error, sftp_start_error

# paramiko logs each failed handshake (with a traceback) at ERROR; with no handler configured,
# Python's last-resort handler would print those on the operator's terminal during retries.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

MAX_CONCURRENT_CONNECTS = 6
CONNECT_ATTEMPTS = 6
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.2, 3.0
PARAMIKO_GRACE_S = 2.0  # paramiko's own timeouts sit this far behind our deadline, as a backstop
_CONNECT_SLOTS = threading.BoundedSemaphore(MAX_CONCURRENT_CONNECTS)


class _Failed(Exception):
    """One attempt failed: paramiko's (or the socket's) exception and what the attempt saw."""

    def __init__(self, exc: BaseException, evidence: ConnectEvidence) -> None:
        super().__init__(str(exc))
        self.exc, self.evidence = exc, evidence


def _backoff(attempt: int) -> float:
    """Capped exponential backoff with jitter, so that retrying clients spread out."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt) * random.uniform(0.5, 1.0)


def connect(
    name: str,
    target: SSHTarget,
    policy: str,
    *,
    timeout: float,
    keepalive_s: int,
    jump_channel: Callable[[], paramiko.Channel | None],
) -> paramiko.SSHClient:
    """Handshake under the process-wide connect limit, retrying transient failures, all of it
    within `timeout` (see the module docstring).

    `jump_channel` gives the socket for each attempt (a channel through the jump host, or None
    for a direct TCP connection); `name` is the host's name in every error."""
    keys = _identities(name, target)
    spent, attempts = 0.0, 0
    while True:
        sock = jump_channel()  # before taking a slot: the jump's connect takes one
        with _CONNECT_SLOTS:
            attempts += 1
            started = time.monotonic()
            try:
                return _handshake(name, target, policy, sock, keys, timeout=timeout - spent, keepalive_s=keepalive_s)
            except _Failed as failed:
                retry, error = classify_connect_error(name, target, failed.exc, failed.evidence, timeout, attempts)
                cause = failed.exc
            finally:
                spent += time.monotonic() - started
        pause = _backoff(attempts - 1)
        # retry only with a useful share of the budget left after the pause
        if not retry or attempts >= CONNECT_ATTEMPTS or timeout - spent - pause < min(1.0, timeout / 2):
            raise error from cause
        time.sleep(pause)
        spent += pause


def _identities(name: str, target: SSHTarget) -> list[tuple[str, paramiko.PKey]]:
    """Keys from the identity files; a given file must load, config ones may be skipped."""
    keys = []
    for path in target.identity_files:
        if not target.identity_explicit and not os.path.exists(path):
            continue  # as ssh: a missing IdentityFile in config is skipped
        try:
            keys.append((path, load_identity(name, path)))
        except SSHAuthError:
            if target.identity_explicit:
                raise
    return keys


class _Tap:
    """The socket (or jump channel) paramiko talks through, recording what we need to know
    when a handshake fails: the first bytes the host sent, and whether it closed or reset."""

    HEAD = 1024

    def __init__(self, inner: Any) -> None:
        self.inner, self.head, self.closed, self.reset = inner, b"", False, False

    def recv(self, n: int) -> bytes:
        try:
            data = self.inner.recv(n)
        except ConnectionResetError:
            self.reset = True
            raise
        if not data:
            self.closed = True
        elif len(self.head) < self.HEAD:
            self.head += data[: self.HEAD - len(self.head)]
        return data

    def abort(self) -> None:
        """Wake whatever reads or writes it, from another thread (the deadline's)."""
        try:
            if isinstance(self.inner, socket.socket):
                self.inner.shutdown(socket.SHUT_RDWR)
            else:
                self.inner.close()
        except OSError:
            pass

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)


class Deadline:
    """A timer that calls `expire` once `seconds` have passed, unless disarmed first."""

    def __init__(self, seconds: float, expire: Callable[[], None]) -> None:
        self._state, self._lock, self._expire = "armed", threading.Lock(), expire
        self._timer = threading.Timer(max(0.0, seconds), self._fire)
        self._timer.daemon = True
        self._timer.start()

    @property
    def fired(self) -> bool:
        return self._state == "fired"

    def _fire(self) -> None:
        with self._lock:
            if self._state != "armed":
                return
            self._state = "fired"
        self._expire()

    def disarm(self) -> bool:
        """Stop the timer; False if it had already fired."""
        self._timer.cancel()
        with self._lock:
            if self._state == "armed":
                self._state = "disarmed"
        return not self.fired


def _handshake(
    name: str,
    t: SSHTarget,
    policy: str,
    sock: paramiko.Channel | None,
    keys: list[tuple[str, paramiko.PKey]],
    *,
    timeout: float,
    keepalive_s: int,
) -> paramiko.SSHClient:
    """One connect attempt, all of it within `timeout`: TCP, banner, key exchange, host key
    check, authentication. Raises _Failed with what it saw."""
    deadline = time.monotonic() + timeout
    client = paramiko.SSHClient()
    if t.known_hosts.exists():
        try:
            client.load_host_keys(str(t.known_hosts))
        except OSError as exc:
            raise SSHError(name, f"cannot read {t.known_hosts}: {exc}") from exc
    client.set_missing_host_key_policy(make_policy(name, policy, t))
    tap = _Tap(sock if sock is not None else _tcp(t, timeout))
    timer = Deadline(deadline - time.monotonic(), tap.abort)
    backstop = timeout + PARAMIKO_GRACE_S
    try:
        client.connect(
            t.address,
            port=t.port,
            username=t.user,
            pkey=keys[0][1] if keys else None,
            key_filename=[path for path, _ in keys[1:]] or None,
            allow_agent=True,
            look_for_keys=not t.identity_files,
            sock=tap,
            timeout=backstop,
            banner_timeout=backstop,
            auth_timeout=backstop,
            channel_timeout=timeout,
        )
        if not timer.disarm():
            raise TimeoutError("connect_timeout")  # it fired just as the handshake finished
    except Exception as exc:
        timer.disarm()
        evidence = _evidence(client, tap, timed_out=timer.fired or time.monotonic() >= deadline)
        client.close()
        tap.abort()
        tap.close()
        raise _Failed(exc, evidence) from exc
    client.get_transport().set_keepalive(keepalive_s)
    return client


def _tcp(t: SSHTarget, timeout: float) -> socket.socket:
    """Our own TCP connect, so that its failures are told apart from the SSH steps'."""
    try:
        return socket.create_connection((t.address, t.port), timeout=timeout)
    except OSError as exc:
        timed_out = isinstance(exc, TimeoutError)
        raise _Failed(exc, ConnectEvidence(phase="tcp", timed_out=timed_out)) from exc


def _evidence(client: paramiko.SSHClient, tap: _Tap, *, timed_out: bool) -> ConnectEvidence:
    """How far the failed attempt got, and what the host had sent."""
    transport = client.get_transport()
    if transport is None or not transport.remote_version:
        phase = "banner"
    elif not transport.initial_kex_done:
        phase = "kex"
    else:
        phase = "auth"
    return ConnectEvidence(phase=phase, timed_out=timed_out, received=tap.head, closed=tap.closed, reset=tap.reset)


def open_sftp(
    name: str, t: SSHTarget, transport: paramiko.Transport, *, open_timeout: float, op_timeout: float
) -> paramiko.SFTPClient:
    """A session channel, then the sftp subsystem on it, then the SFTP version exchange, each
    failure told apart from a lost connection (paramiko says "Channel closed." or "EOF during
    negotiation" for all of them): a refusal on a live connection means sshd has no subsystem."""
    chan = transport.open_session(timeout=open_timeout)
    chan.settimeout(op_timeout)  # per request: a dead host errors out
    timer = Deadline(op_timeout, chan.close)  # paramiko waits for the subsystem reply without one
    try:
        chan.invoke_subsystem("sftp")
    except paramiko.SSHException as exc:
        chan.close()
        if timer.fired:
            raise TimeoutError(f"no reply to the sftp subsystem request within {op_timeout:g}s") from exc
        if transport.is_active():
            raise sftp_refused_error(name, t) from exc
        raise
    finally:
        timer.disarm()
    try:
        return paramiko.SFTPClient(chan)
    except (paramiko.SFTPError, paramiko.SSHException, EOFError, OSError) as exc:
        # its exit status follows the channel's EOF once sshd has reaped it: worth a moment
        eof = isinstance(exc, EOFError) or "EOF" in str(exc)
        ended = chan.status_event.wait(2.0) if eof else chan.exit_status_ready()
        status = chan.recv_exit_status() if ended else None
        stderr = chan.recv_stderr(4096).decode("utf-8", "replace") if chan.recv_stderr_ready() else ""
        chan.close()
        if not transport.is_active():
            raise
        raise sftp_start_error(name, t, exc, status, stderr, op_timeout) from exc
