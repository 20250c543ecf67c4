"""Who and how to connect: `~/.ssh/config` resolution, identity files and host-key policies.

Kept apart from the connection code (`ssh.py`, `sshconnect.py`) so that these decisions (which
user, port, key, known_hosts file; whether an unknown or changed host key is accepted) are easy
to read and test; what a failed connect means is `ssherrors.py`'s.

Host-key policy, as OpenSSH's StrictHostKeyChecking:
    strict       a key not in known_hosts is refused; the message says how to add it
    accept-new   a key not in known_hosts is appended to it (trust on first use)
    (both)       a key that differs from the one in known_hosts is always refused
paramiko's AutoAddPolicy is never used: it would accept a changed key's host as new when the
entry is missing from the in-memory set, and it rewrites the whole file.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import paramiko

from dldctl.errors import (
    ConfigError,
    HostKeyError,
    SSHAuthError,
    UsageError,
)

POLICIES = ("strict", "accept-new")
DEFAULT_CONFIG = "~/.ssh/config"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"

# accept-new appends to a shared file; concurrent connects in one process must not interleave
_KNOWN_HOSTS_LOCK = threading.Lock()


@dataclass(frozen=True)
class SSHTarget:
    """A host alias resolved to what we actually connect to."""

    address: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    identity_explicit: bool  # given by the caller: a missing file is an error, not skipped
    known_hosts: Path
    proxy_jump: str | None


def resolve_target(
    alias: str,
    *,
    user: str | None,
    port: int | None,
    identity_file: str | os.PathLike[str] | None,
    known_hosts: str | os.PathLike[str] | None,
    proxy_jump: str | None,
    config_file: str | os.PathLike[str] | None,
) -> SSHTarget:
    """Merge explicit arguments over `~/.ssh/config` (explicit wins, as on ssh's command line)."""
    cfg = _lookup(alias, config_file) if config_file is not None else {"hostname": alias}
    explicit = identity_file is not None
    if identity_file is not None:  # `explicit`, spelled out so that mypy narrows the type
        identities: tuple[str, ...] = (os.path.expanduser(os.fspath(identity_file)),)
    else:
        identities = tuple(os.path.expanduser(p) for p in cfg.get("identityfile", []))
    known = known_hosts if known_hosts is not None else _first(cfg.get("userknownhostsfile"))
    jump = proxy_jump if proxy_jump is not None else cfg.get("proxyjump")
    return SSHTarget(
        address=cfg.get("hostname", alias),
        port=port if port is not None else int(cfg.get("port", 22)),
        user=user or cfg.get("user") or getpass.getuser(),
        identity_files=identities,
        identity_explicit=explicit,
        known_hosts=Path(os.path.expanduser(os.fspath(known or DEFAULT_KNOWN_HOSTS))),
        proxy_jump=None if not jump or jump.lower() == "none" else jump,
    )


def _lookup(alias: str, config_file: str | os.PathLike[str]) -> dict:
    """paramiko's view of one Host entry; a missing default config file means no entries."""
    path = Path(os.path.expanduser(os.fspath(config_file)))
    if not path.exists() and os.fspath(config_file) == DEFAULT_CONFIG:
        return {"hostname": alias}
    try:
        return dict(paramiko.SSHConfig.from_path(str(path)).lookup(alias))
    except OSError as exc:
        raise ConfigError(str(path), None, f"cannot read SSH config: {exc.strerror}") from exc
    except (paramiko.ConfigParseError, ValueError) as exc:
        raise ConfigError(str(path), None, f"cannot parse SSH config: {exc}") from exc


def _first(value: str | list[str] | None) -> str | None:
    """UserKnownHostsFile may list several files; we read and write the first."""
    if not value:
        return None
    return (value.split() if isinstance(value, str) else value)[0]


def parse_jump(spec: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` -> (user, host, port); `[v6addr]:port` works too."""
    user, _, hostport = spec.rpartition("@")
    host, port = hostport, None
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    elif hostport.count(":") == 1:
        name, _, port_text = hostport.partition(":")
        if port_text.isdigit():
            host, port = name, int(port_text)
    return (user or None), host, port


def load_identity(host: str, path: str) -> paramiko.PKey:
    """Read a private key; every failure is an SSHAuthError naming the file and the fix."""
    try:
        return paramiko.PKey.from_path(path)
    except FileNotFoundError as exc:
        raise SSHAuthError(host, f"identity file {path} does not exist", hint="fix [ssh] identity_file") from exc
    except PermissionError as exc:
        raise SSHAuthError(
            host, f"identity file {path} is not readable", hint=f"check its owner and permissions: ls -l {path}"
        ) from exc
    except paramiko.PasswordRequiredException as exc:
        raise SSHAuthError(
            host, f"identity file {path} is passphrase-protected", hint=f"load it into the agent: ssh-add {path}"
        ) from exc
    except (paramiko.SSHException, ValueError, OSError) as exc:
        raise SSHAuthError(
            host,
            f"identity file {path} is not a usable private key ({exc})",
            hint="point [ssh] identity_file at the private key, not the .pub",
        ) from exc


def known_hosts_name(address: str, port: int) -> str:
    """The name a known_hosts line uses: `addr` on port 22, `[addr]:port` otherwise."""
    return address if port == 22 else f"[{address}]:{port}"


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint (as `ssh-keygen -l` prints it)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def load_known_hosts(host: str, path: Path) -> paramiko.HostKeys:
    """The known_hosts file's keys (none if the file does not exist yet)."""
    keys = paramiko.HostKeys()
    try:
        keys.load(str(path))
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise HostKeyError(host, f"cannot read known_hosts file {path}: {exc.strerror}") from exc
    return keys


class _StrictPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown keys with a message saying how to trust the host."""

    def __init__(self, host: str, target: SSHTarget) -> None:
        self.host, self.target = host, target

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        t = self.target
        scan = f"ssh-keyscan -p {t.port} {t.address}" if t.port != 22 else f"ssh-keyscan {t.address}"
        raise HostKeyError(
            self.host,
            f"unknown host key for {hostname} ({key.get_name()} {fingerprint(key)}), not in {t.known_hosts}",
            hint=f'verify it, then run `{scan} >> {t.known_hosts}`, or set host_key_policy = "accept-new"',
        )


class _AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Trust on first use: append the unknown key to known_hosts (one line, never a rewrite)."""

    def __init__(self, host: str, target: SSHTarget) -> None:
        self.host, self.target = host, target

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        path = self.target.known_hosts
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        try:
            with _KNOWN_HOSTS_LOCK:
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                with os.fdopen(fd, "a", encoding="ascii") as f:
                    f.write(line)
        except OSError as exc:
            raise HostKeyError(
                self.host,
                f"cannot add the host key to {path}: {exc.strerror}",
                hint="make the known_hosts file writable",
            ) from exc
        client.get_host_keys().add(hostname, key.get_name(), key)


def make_policy(host: str, policy: str, target: SSHTarget) -> paramiko.MissingHostKeyPolicy:
    """The policy object for `policy` ("strict" or "accept-new")."""
    if policy == "strict":
        return _StrictPolicy(host, target)
    if policy == "accept-new":
        return _AcceptNewPolicy(host, target)
    raise UsageError(f"host {host}: unknown host_key_policy {policy!r}", hint='use "strict" or "accept-new"')


def changed_key_error(host: str, target: SSHTarget, exc: paramiko.BadHostKeyException) -> HostKeyError:
    """The refusal for a host whose key differs from the one in known_hosts."""
    name = known_hosts_name(target.address, target.port)
    return HostKeyError(
        host,
        f"HOST KEY CHANGED for {name}: it offers {exc.key.get_name()} {fingerprint(exc.key)}, "
        f"{target.known_hosts} has {fingerprint(exc.expected_key)}; refusing to connect "
        "(possible man-in-the-middle)",
        hint=f"if the host was reinstalled, remove the old key with "
        f"`ssh-keygen -R '{name}' -f {target.known_hosts}` and connect again",
    )
