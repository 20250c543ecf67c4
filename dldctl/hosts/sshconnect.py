"""Opening one SSH connection: load the identity keys, shake hands, retry what is transient.

`SSHHost` (ssh.py) keeps one connection per host and calls `connect` whenever it has none or
the one it had dropped. This module is that one step, as functions of the resolved `SSHTarget`
(sshconfig.py), the host-key policy and the host's timeouts; its only state is the process-wide
limit of 6 handshakes at a time (sshd's MaxStartups, see ssh.py's docstring). Dropped banners
and connection resets are retried with capped, jittered exponential backoff; every other
failure is reported at once, as the error `classify_connect_error` chose.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable

import paramiko

from dldctl.errors import DldError, SSHAuthError, SSHError
from dldctl.hosts.sshconfig import SSHTarget, classify_connect_error, load_identity, make_policy

# paramiko logs each failed handshake (with a traceback) at ERROR; with no handler configured,
# Python's last-resort handler would print those on the operator's terminal during retries.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

MAX_CONCURRENT_CONNECTS = 6
CONNECT_ATTEMPTS = 6
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.2, 3.0
_CONNECT_SLOTS = threading.BoundedSemaphore(MAX_CONCURRENT_CONNECTS)


class _Transient(Exception):
    """A connect failure worth retrying (dropped banner, reset); carries the final error."""

    def __init__(self, error: DldError) -> None:
        super().__init__(error.line())
        self.error = error


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
    """Handshake under the process-wide connect limit, retrying transient failures.

    `jump_channel` gives the socket for each attempt (a channel through the jump host, or None
    for a direct TCP connection); `name` is the host's name in every error."""
    keys = _identities(name, target)
    for attempt in range(CONNECT_ATTEMPTS):
        sock = jump_channel()  # before taking a slot: the jump's connect takes one
        with _CONNECT_SLOTS:
            try:
                return _handshake(name, target, policy, sock, keys, timeout=timeout, keepalive_s=keepalive_s)
            except _Transient as exc:
                last = exc
        if attempt + 1 < CONNECT_ATTEMPTS:
            time.sleep(_backoff(attempt))
    raise last.error from last.__cause__


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
    """One connect attempt: TCP, banner, key exchange, host key check, authentication."""
    client = paramiko.SSHClient()
    if t.known_hosts.exists():
        try:
            client.load_host_keys(str(t.known_hosts))
        except OSError as exc:
            raise SSHError(name, f"cannot read {t.known_hosts}: {exc}") from exc
    client.set_missing_host_key_policy(make_policy(name, policy, t))
    try:
        client.connect(
            t.address,
            port=t.port,
            username=t.user,
            pkey=keys[0][1] if keys else None,
            key_filename=[path for path, _ in keys[1:]] or None,
            allow_agent=True,
            look_for_keys=not t.identity_files,
            sock=sock,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
            channel_timeout=timeout,
        )
    except Exception as exc:
        client.close()
        retry, error = classify_connect_error(name, t, exc, timeout, CONNECT_ATTEMPTS)
        if retry:
            raise _Transient(error) from exc
        raise error from exc
    client.get_transport().set_keepalive(keepalive_s)
    return client
