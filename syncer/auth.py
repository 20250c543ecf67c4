"""Who may talk to the syncer: CURVE keys checked through ZeroMQ's ZAP (used by syncer/server.py).

The `Keyring` maps the allowed public keys (the run's key directory, syncer/common/keys.py) to party
names, re-reading the directory when an unknown key knocks, so a learner added while the run goes
on is let in; a `Provider` decides one ZAP domain ("learners": the learner keys, "control": the
operator's key) and counts what it denies; the `Authenticator` names each connection after the
party of its key, which the server reads back as the frames' User-Id.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from syncer.common import keys


class Keyring:
    """Allowed CURVE public keys -> party names; re-read from disk when an unknown key knocks."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.lock = threading.Lock()
        self.names = keys.public_keys(directory)
        self.denied: collections.Counter[str] = collections.Counter()
        self._reloaded = 0.0

    def lookup(self, z85_key: bytes) -> str | None:
        with self.lock:
            name = self.names.get(z85_key)
            if name is None and time.monotonic() - self._reloaded > 1.0:
                self._reloaded = time.monotonic()  # `dldctl learner add` drops new keys here
                self.names = keys.public_keys(self.directory)
                name = self.names.get(z85_key)
            return name

    def deny(self, what: str) -> None:
        with self.lock:
            self.denied[what] += 1


class Provider:
    """ZAP credentials callback for one domain."""

    def __init__(self, keyring: Keyring, allow: Callable[[str], bool], label: str) -> None:
        self.keyring, self.allow, self.label = keyring, allow, label

    def callback(self, domain: str, key: bytes) -> bool:
        name = self.keyring.lookup(key)
        ok = name is not None and self.allow(name)
        if not ok:
            self.keyring.deny(self.label)
        return ok


class Authenticator(ThreadAuthenticator):
    """Sets each connection's User-Id to the party name of its key."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], keyring: Keyring) -> None:
        super().__init__(context)
        self.keyring = keyring

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.keyring.lookup(z85.encode(client_public_key)) or "unknown"
