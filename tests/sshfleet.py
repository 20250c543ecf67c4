"""A fleet of real sshd test hosts on loopback addresses, for the end-to-end tests.

One `/usr/sbin/sshd` per address (127.0.0.2, 127.0.0.3, ...), each on its own free port with its
own generated ed25519 host key, all accepting one generated user key for root. A `known_hosts`
file lists every host in `[addr]:port` form. Everything lives in `workdir`; `stop()` stops only
the sshd processes this fleet started (by pid), and the per-connection sshd children they forked.

    with SSHFleet(workdir) as fleet:
        h = fleet.hosts[0]
        SSHHost("a", h.address, port=h.port, user=h.user, identity_file=h.identity_file,
                known_hosts=h.known_hosts)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from dldctl.ports import free_port

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")


@dataclass(frozen=True)
class FleetHost:
    """One running test sshd."""

    address: str
    port: int
    user: str
    identity_file: Path
    known_hosts: Path
    host_key: Path  # the sshd's private host key (its .pub beside it)
    log: Path
    pid: int

    @property
    def host_pub(self) -> str:
        """`ssh-ed25519 AAAA...` of this host's key."""
        return " ".join(Path(f"{self.host_key}.pub").read_text().split()[:2])


def keygen(path: Path, comment: str) -> Path:
    """Generate an ed25519 key pair at `path` (and `path`.pub) with no passphrase."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    return path


def write_ssh_config(path: Path, alias: str, host: FleetHost) -> Path:
    """An ssh_config file mapping `alias` to `host` (HostName, Port, User, IdentityFile)."""
    path.write_text(
        f"Host {alias}\n"
        f"    HostName {host.address}\n"
        f"    Port {host.port}\n"
        f"    User {host.user}\n"
        f"    IdentityFile {host.identity_file}\n"
        f"    UserKnownHostsFile {host.known_hosts}\n"
    )
    return path


class SSHFleet:
    """Start/stop one sshd per loopback address; see the module docstring."""

    def __init__(
        self,
        workdir: Path,
        addresses: tuple[str, ...] = ("127.0.0.2", "127.0.0.3", "127.0.0.4"),
        sshd_options: dict[str, str | None] | None = None,
    ) -> None:
        for address in addresses:
            if not address.startswith("127."):
                raise ValueError(f"test hosts must be on loopback, not {address}")
        self.workdir = Path(workdir)
        self.addresses = addresses
        self.sshd_options = dict(sshd_options or {})
        self.hosts: list[FleetHost] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._started = 0
        self.identity_file = self.workdir / "id_ed25519"
        self.known_hosts = self.workdir / "known_hosts"

    def __enter__(self) -> SSHFleet:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> SSHFleet:
        """Generate keys, start every sshd, wait until each answers with a banner."""
        if not os.access(SSHD, os.X_OK):
            raise RuntimeError(
                f"{SSHD} not found: run the project's test script (.ci/run), which installs openssh-server"
            )
        PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        keygen(self.identity_file, "dldctl-test-user")
        (self.workdir / "authorized_keys").write_text(Path(f"{self.identity_file}.pub").read_text())
        try:
            for address in self.addresses:
                self.hosts.append(self.start_sshd(address))
        except BaseException:
            self.stop()
            raise
        self.write_known_hosts(self.known_hosts, self.hosts)
        return self

    def start_sshd(
        self,
        address: str,
        *,
        host_key: Path | None = None,
        port: int | None = None,
        options: dict[str, str | None] | None = None,
    ) -> FleetHost:
        """Start one more sshd (stopped by `stop()` too); `host_key` reuses an existing key;
        `options` override sshd_config settings (None leaves one out, e.g. {"Subsystem": None})."""
        self._started += 1  # not len(self._procs): stop_host shrinks that, and the name is reused
        hdir = self.workdir / f"{address}-{self._started}"
        hdir.mkdir()
        if host_key is None:
            host_key = keygen(hdir / "ssh_host_ed25519_key", f"host {address}")
        port = port or free_port(address)
        config = self._write_config(hdir, address, port, host_key, options or {})
        log = hdir / "sshd.log"
        with open(log, "ab") as out:
            # -D: stay in the foreground, our child; -e: log to stderr (the log file)
            proc = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        self._procs.append(proc)
        self._wait_ready(proc, address, port, log)
        return FleetHost(address, port, "root", self.identity_file, self.known_hosts, host_key, log, proc.pid)

    def _write_config(
        self, hdir: Path, address: str, port: int, host_key: Path, options: dict[str, str | None]
    ) -> Path:
        settings: dict[str, str | None] = {
            "ListenAddress": f"{address}:{port}",
            "HostKey": str(host_key),
            "PidFile": str(hdir / "sshd.pid"),
            "AuthorizedKeysFile": str(self.workdir / "authorized_keys"),
            "PermitRootLogin": "prohibit-password",  # we run as root; keys only
            "PubkeyAuthentication": "yes",
            "PasswordAuthentication": "no",
            "KbdInteractiveAuthentication": "no",
            "StrictModes": "no",  # pytest's tmp dirs are not 0700 everywhere
            "UsePAM": "no",
            "LogLevel": "VERBOSE",
            "PrintMotd": "no",
            "AllowTcpForwarding": "yes",  # proxy_jump goes through direct-tcpip
            "Subsystem": "sftp internal-sftp",
            **self.sshd_options,
            **options,
        }
        path = hdir / "sshd_config"
        path.write_text("".join(f"{k} {v}\n" for k, v in settings.items() if v is not None))
        return path

    @staticmethod
    def _wait_ready(proc: subprocess.Popen[bytes], address: str, port: int, log: Path) -> None:
        """Until the sshd sends its banner (or exits, or 10 s pass)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"sshd on {address}:{port} exited: {log.read_text()[-2000:]}")
            try:
                with socket.create_connection((address, port), timeout=1) as s:
                    if s.recv(64).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd on {address}:{port} did not answer: {log.read_text()[-2000:]}")

    @staticmethod
    def write_known_hosts(path: Path, hosts: list[FleetHost]) -> Path:
        """A known_hosts file listing `hosts` in `[addr]:port keytype key` form."""
        path.write_text("".join(f"[{h.address}]:{h.port} {h.host_pub}\n" for h in hosts))
        return path

    def stop_host(self, host: FleetHost) -> None:
        """Stop one sshd of this fleet (and its per-connection children) early."""
        for proc in [p for p in self._procs if p.pid == host.pid]:
            _stop(proc)
            self._procs.remove(proc)

    def stop(self) -> None:
        """Stop the sshd processes we started (by pid) and their per-connection children."""
        while self._procs:
            _stop(self._procs.pop())


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate one sshd listener we started, then the session processes it forked."""
    children = descendants(proc.pid)
    try:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    finally:
        for pid in children:  # sessions outlive the listener; they are ours too
            for sig in (signal.SIGCONT, signal.SIGTERM):  # CONT: a test may have stopped it
                _kill(pid, sig)


def descendants(pid: int) -> list[int]:
    """Pids below `pid` in the process tree, children first (a scan of /proc; stat field 4).

    Only live processes under our own sshd: sessions and their privilege-separated children,
    not anything a test started detached (those left the tree through setsid -f)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 1 and fields[0] not in "ZX":
            parents[int(entry)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found.extend(kids)
        frontier = kids
    return found


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
