"""CURVE key files for a run (a leaf: pyzmq + stdlib).

One keypair per party, in ZeroMQ's zcert text format: `NAME.key` holds the public key,
`NAME.key_secret` the public and the secret key (mode 0600). Parties: `syncer`, `operator`
(the only key allowed on the control socket) and one per learner (`learner-0`, ...), so the
syncer knows which learner is talking from the key alone and a learner cannot pose as another.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq
import zmq.auth


def create(directory: Path, name: str) -> tuple[Path, Path]:
    """Create NAME.key / NAME.key_secret in `directory` (secret file 0600); returns both paths."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = zmq.curve_keypair()
    pub_path, sec_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    _write(pub_path, _zcert(public, None), 0o644)
    _write(sec_path, _zcert(public, secret), 0o600)
    return pub_path, sec_path


def _zcert(public: bytes, secret: bytes | None) -> str:
    lines = ["#   ZeroMQ CURVE certificate (dldctl)", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, mode)


def load_public(path: Path) -> bytes:
    """The z85 public key of a .key or .key_secret file."""
    public, _ = zmq.auth.load_certificate(str(path))
    if not public:
        raise ValueError(f"{path}: no public key")
    return public


def load_pair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys of a .key_secret file."""
    public, secret = zmq.auth.load_certificate(str(path))
    if not public or not secret:
        raise ValueError(f"{path}: not a secret key file (needs public-key and secret-key)")
    return public, secret


def public_keys(directory: Path) -> dict[bytes, str]:
    """z85 public key -> party name, for every NAME.key in `directory`."""
    out: dict[bytes, str] = {}
    for path in sorted(directory.glob("*.key")):
        try:
            out[load_public(path)] = path.stem
        except (ValueError, OSError):
            continue
    return out
