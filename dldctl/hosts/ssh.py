"""`SSHHost`: the `Host` interface on a remote machine, over one paramiko connection.

What "done right" means here, each from a known failure (see ARCHITECTURE.md, Known pitfalls):
- one transport per host, reused for every command and the SFTP session, rebuilt transparently
  when it has dropped; at most 7 commands at a time plus 1 SFTP channel per connection, under
  sshd's default MaxSessions of 10;
- at most 6 connection handshakes at a time in this process (sshconnect.py): sshd's
  MaxStartups (10:30:100) drops unauthenticated connections beyond 10 ("Error reading SSH
  protocol banner"), and on a loaded host sshd still counts a connection for a moment after
  our side finished its handshake (8 at a time went past 10 once in a full test run); those
  drops and connection resets are retried with capped, jittered exponential backoff, all of
  it within connect_timeout, and a failed connect says how far it got (ssherrors.py);
- a refused sftp subsystem, or an SFTP program that does not start, is told apart from a lost
  connection (paramiko says "Channel closed." or "EOF during negotiation"; sshconnect.py);
- stdout and stderr drained together before the exit status is read (paramiko#448: reading
  the status first hangs once output passes the 2 MiB channel window);
- our own deadline on every command and SFTP request, plus transport keepalives: a dead host
  fails an operation, it never hangs it;
- host keys checked against known_hosts (policies in `sshconfig.py`); never AutoAddPolicy;
- closing a channel does not kill the remote command, so long-lived processes are started
  detached (`start`) and stopped by (pid, start time) through `signal`;
- environment values travel on the channel's stdin, never in a command line (`ps` shows those).
"""

from __future__ import annotations

import os
import posixpath
import secrets
import shlex
import signal as _signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import paramiko

from dldctl.errors import DldError, HostError, RemoteCommandError, SSHError, UnreachableError, UsageError
from dldctl.hosts.base import (
    CommandResult,
    Host,
    ProcRef,
    env_exports,
    expand_home,
    is_live,
    launcher_script,
    output_tail,
    parse_started,
    parse_stat,
)
from dldctl.hosts.sshconfig import DEFAULT_CONFIG, POLICIES, SSHTarget, parse_jump, resolve_target
from dldctl.hosts.sshconnect import connect, open_sftp
from syncer.common.atomic import atomic_file

COMMAND_SLOTS_PER_HOST = 7  # + 1 SFTP channel = 8 <= sshd's MaxSessions 10
T = TypeVar("T")


def _sh(script: str) -> str:
    """Run our own scripts under sh whatever the user's login shell is."""
    return "sh -c " + shlex.quote(script)


class SSHHost(Host):
    """A remote machine reached over SSH (optionally through jump hosts)."""

    def __init__(
        self,
        name: str,
        address: str,
        *,
        user: str | None = None,
        port: int | None = None,
        identity_file: str | os.PathLike[str] | None = None,
        known_hosts: str | os.PathLike[str] | None = None,
        host_key_policy: str = "strict",
        proxy_jump: str | None = None,
        connect_timeout: float = 10.0,
        keepalive_s: int = 15,
        use_ssh_config: bool = True,
        ssh_config_file: str | os.PathLike[str] | None = None,
        op_timeout: float = 60.0,
    ) -> None:
        self.name = name
        if host_key_policy not in POLICIES:
            raise UsageError(
                f"host {name}: unknown host_key_policy {host_key_policy!r}", hint='use "strict" or "accept-new"'
            )
        config = (ssh_config_file or DEFAULT_CONFIG) if use_ssh_config else None
        self.target: SSHTarget = resolve_target(
            address,
            user=user,
            port=port,
            identity_file=identity_file,
            known_hosts=known_hosts,
            proxy_jump=proxy_jump,
            config_file=config,
        )
        self.policy = host_key_policy
        self.connect_timeout, self.keepalive_s, self.op_timeout = connect_timeout, keepalive_s, op_timeout
        self._lock = threading.RLock()  # guards the connection
        self._sftp_lock = threading.RLock()  # one SFTP request stream at a time; taken first
        self._slots = threading.BoundedSemaphore(COMMAND_SLOTS_PER_HOST)
        self._client: paramiko.SSHClient | None = None
        self._sftp_client: paramiko.SFTPClient | None = None
        self._home: str | None = None
        self._jump = self._make_jump(identity_file, config) if self.target.proxy_jump else None

    def _make_jump(
        self, identity_file: str | os.PathLike[str] | None, config: str | os.PathLike[str] | None
    ) -> SSHHost:
        """The next hop towards us of `proxy_jump` ("a,b": a is reached first, then b)."""
        hops = (self.target.proxy_jump or "").split(",")
        user, address, port = parse_jump(hops[-1].strip())
        return SSHHost(
            f"{hops[-1].strip()} (jump host for {self.name})",
            address,
            user=user,
            port=port,
            identity_file=identity_file,
            known_hosts=self.target.known_hosts,
            host_key_policy=self.policy,
            proxy_jump=",".join(hops[:-1]) or None,
            connect_timeout=self.connect_timeout,
            keepalive_s=self.keepalive_s,
            use_ssh_config=config is not None,
            ssh_config_file=config,
            op_timeout=self.op_timeout,
        )

    # ----- connection ------------------------------------------------------------------------

    def _transport(self) -> paramiko.Transport:
        """The live transport, reconnecting if there is none or it dropped."""
        with self._lock:
            transport = self._client.get_transport() if self._client else None
            if transport is not None and transport.is_active():
                return transport
            self._drop()
            self._client = self._connect()
            return self._client.get_transport()

    def local_address(self) -> str | None:
        """Our end of the connection: the address this host can dial back (None via a jump)."""
        if self._jump is not None:
            return None
        sock = self._transport().sock
        try:
            return sock.getsockname()[0]
        except (AttributeError, OSError):
            return None

    def _connect(self) -> paramiko.SSHClient:
        """A new connection to the target, through the jump host if there is one (sshconnect.py)."""
        return connect(
            self.name,
            self.target,
            self.policy,
            timeout=self.connect_timeout,
            keepalive_s=self.keepalive_s,
            jump_channel=self._jump_channel,
        )

    def _jump_channel(self) -> paramiko.Channel | None:
        """A direct-tcpip channel through the jump host to our target, used as our socket."""
        if self._jump is None:
            return None
        t = self.target
        try:
            return self._jump._transport().open_channel(
                "direct-tcpip", (t.address, t.port), ("127.0.0.1", 0), timeout=self.connect_timeout
            )
        except paramiko.ChannelException as exc:
            raise UnreachableError(
                self.name, f"jump host {self._jump.name} cannot reach {t.address}:{t.port} ({exc})"
            ) from exc
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise SSHError(self.name, f"jump host {self._jump.name} failed: {exc}") from exc

    def _reset(self) -> None:
        """Drop a connection that stopped answering; the next operation reconnects."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        """Forget the connection (caller holds the lock)."""
        if self._sftp_client is not None:
            self._sftp_client.close()
            self._sftp_client = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def _reopening(self, what: str, open_fn: Callable[[paramiko.Transport], T]) -> T:
        """Open a channel; if the connection had silently dropped, reconnect once and retry."""
        for attempt in range(2):
            transport = self._transport()
            try:
                return open_fn(transport)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                if attempt == 0 and not transport.is_active():
                    continue
                raise SSHError(self.name, f"cannot open {what}: {exc}") from exc
        raise AssertionError("unreachable")

    @contextmanager
    def _session(self, deadline: float) -> Iterator[paramiko.Channel]:
        """A session channel for one command, within this host's concurrency limit."""
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise HostError(
                self.name,
                f"timed out waiting for a free SSH session ({COMMAND_SLOTS_PER_HOST} commands already running)",
            )
        try:
            wait = min(self.connect_timeout, max(0.1, deadline - time.monotonic()))
            chan = self._reopening("an SSH session", lambda t: t.open_session(timeout=wait))
            try:
                yield chan
            finally:
                chan.close()
        finally:
            self._slots.release()

    @contextmanager
    def _sftp(self, what: str) -> Iterator[paramiko.SFTPClient]:
        """The host's SFTP client (one, serialized), with errors mapped to HostError.

        Its own lock, so a long upload does not hold up commands on the same connection."""
        with self._sftp_lock:
            sftp = self._sftp_client
            if sftp is None or sftp.get_channel().closed:
                sftp = self._sftp_client = self._reopening("an SFTP session", self._open_sftp)
            try:
                yield sftp
            except FileNotFoundError as exc:
                raise HostError(self.name, f"cannot {what}: no such file") from exc
            except TimeoutError as exc:
                self._reset()
                raise HostError(self.name, f"cannot {what}: no answer within {self.op_timeout:g}s") from exc
            except (paramiko.SSHException, EOFError) as exc:
                self._reset()
                raise SSHError(self.name, f"cannot {what}: connection lost ({exc})") from exc
            except OSError as exc:
                raise HostError(self.name, f"cannot {what}: {exc.strerror or exc}") from exc

    def _open_sftp(self, transport: paramiko.Transport) -> paramiko.SFTPClient:
        return open_sftp(
            self.name, self.target, transport, open_timeout=self.connect_timeout, op_timeout=self.op_timeout
        )

    def _path(self, remote: str) -> str:
        return expand_home(remote, self.home)

    # ----- commands --------------------------------------------------------------------------

    def run(
        self,
        command: str,
        *,
        timeout: float = 60.0,
        input: bytes | None = None,
        check: bool = True,
        env: dict[str, str] | None = None,
    ) -> CommandResult:
        """Run a command line in the user's login shell on the host."""
        wire, stdin = command, input or b""
        if env:
            # The exports go first on stdin; `dd bs=1` reads exactly their length, so the
            # command still gets `input` after them and no value shows up in a command line.
            exports = env_exports(env).encode()
            loader = f'eval "$(dd bs=1 count={len(exports)} 2>/dev/null)" && exec sh -c "$0"'
            wire, stdin = f"{_sh(loader)} {shlex.quote(command)}", exports + stdin
        deadline = time.monotonic() + timeout
        with self._session(deadline) as chan:
            try:
                chan.exec_command(wire)
                out, err = _pump(chan, stdin, deadline)
                if not chan.status_event.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError
            except TimeoutError as exc:
                raise HostError(
                    self.name,
                    f"`{command}` did not finish within {timeout:g}s",
                    hint="it may still be running on the host",
                ) from exc
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise SSHError(self.name, f"connection lost running `{command}`: {exc}") from exc
            status = chan.recv_exit_status()
        if status == -1 and not chan.get_transport().is_active():
            raise SSHError(self.name, f"connection lost running `{command}`")
        result = CommandResult(status, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
        if check and status != 0:
            raise RemoteCommandError(self.name, command, status, output_tail(result))
        return result

    def put_file(self, local: Path, remote: str, mode: int = 0o644) -> None:
        """SFTP upload to a tmp file beside `remote`, chmod, then rename over `remote`."""
        dest = self._path(remote)
        parent = posixpath.dirname(dest) or "."
        tmp = posixpath.join(parent, f".{posixpath.basename(dest)}.{secrets.token_hex(4)}.tmp")
        self.mkdir(parent)
        if mode & 0o077 == 0:
            # private: create the file 0600 first, so it is never open-able by others
            self.run(_sh(f"umask 077 && : > {shlex.quote(tmp)}"), timeout=self.op_timeout)
        try:
            with self._sftp(f"copy {local} to {remote}") as sftp, open(local, "rb") as src:
                with sftp.open(tmp, "w" if mode & 0o077 == 0 else "wx") as dst:
                    dst.chmod(mode)
                    dst.set_pipelined(True)
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                sftp.posix_rename(tmp, dest)
        except BaseException:
            try:
                self.run(_sh(f"rm -f -- {shlex.quote(tmp)}"), check=False, timeout=10.0)
            except DldError:
                pass  # the original error is the one to report
            raise

    def put_bytes(self, data: bytes, remote: str, mode: int = 0o600) -> None:
        """Write `data` atomically; created under umask 077, so never readable by others."""
        dest = self._path(remote)
        q_dir, q_dest = shlex.quote(posixpath.dirname(dest) or "."), shlex.quote(dest)
        q_tmp = shlex.quote(f"{dest}.{secrets.token_hex(4)}.tmp")
        script = (
            f"mkdir -p -- {q_dir} && umask 077 && cat > {q_tmp} && "
            f"chmod {mode:o} {q_tmp} && mv -f -- {q_tmp} {q_dest} || "
            f"{{ rm -f -- {q_tmp}; exit 1; }}"
        )
        result = self.run(_sh(script), input=data, check=False, timeout=self.op_timeout)
        if result.status != 0:
            raise HostError(self.name, f"cannot write {remote}: {output_tail(result).strip()}")

    def get_file(self, remote: str, local: Path) -> None:
        """SFTP download to a local tmp file, then rename."""
        local.parent.mkdir(parents=True, exist_ok=True)
        with self._sftp(f"copy {remote} to {local}") as sftp, atomic_file(local) as out:
            sftp.getfo(self._path(remote), out)

    def read_bytes(self, remote: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
        """Up to `limit` bytes of `remote` from `offset`."""
        path = self._path(remote)
        with self._sftp(f"read {remote}") as sftp, sftp.open(path, "r") as f:
            f.seek(offset)
            return f.read(limit)

    def size(self, remote: str) -> int | None:
        """Size in bytes, None if missing."""
        path = self._path(remote)
        with self._sftp(f"stat {remote}") as sftp:
            try:
                return sftp.stat(path).st_size
            except FileNotFoundError:
                return None

    def exists(self, remote: str) -> bool:
        """Whether the path exists (a dangling symlink counts)."""
        path = self._path(remote)
        with self._sftp(f"stat {remote}") as sftp:
            try:
                sftp.lstat(path)
                return True
            except FileNotFoundError:
                return False

    def mkdir(self, remote: str, mode: int = 0o755) -> None:
        """Create the directory and its missing parents over SFTP."""
        path = self._path(remote)
        with self._sftp(f"create directory {remote}") as sftp:
            parts = [p for p in path.split("/") if p]
            prefix = "/" if path.startswith("/") else ""
            for i in range(1, len(parts) + 1):
                current = prefix + "/".join(parts[:i])
                try:
                    sftp.stat(current)
                except FileNotFoundError:
                    try:
                        sftp.mkdir(current, mode)
                    except OSError:
                        sftp.stat(current)  # created meanwhile by someone else: fine

    def home(self) -> str:
        """The remote user's home directory (where SFTP starts)."""
        if self._home is None:
            with self._sftp("find the home directory") as sftp:
                self._home = sftp.normalize(".")
        return self._home

    # ----- processes -------------------------------------------------------------------------

    def start(self, argv: list[str], *, cwd: str, log: str, env: dict[str, str] | None = None) -> ProcRef:
        """Start `argv` detached: it outlives this connection; `env` never appears in argv."""
        script = launcher_script(argv, self._path(cwd), self._path(log))
        result = self.run(_sh(script), timeout=self.op_timeout, check=False, env=env)
        return parse_started(self.name, argv, result)

    def signal(self, ref: ProcRef, sig: int, *, group: bool = True) -> bool:
        """As LocalHost.signal, in one round trip: checks the start time, then kills."""
        name = "0" if sig == 0 else _signal.Signals(sig).name.removeprefix("SIG")
        target = f"-- -{ref.pid}" if group else str(ref.pid)
        script = (
            f"live=1\nif s=$(cat /proc/{ref.pid}/stat 2>/dev/null); then\n"
            f'  set -f; set -- ${{s##*\\) }}\n  [ "${{20}}" = {ref.start_ticks} ] || exit 3\n'
            "  case $1 in Z|X) ;; *) live=0 ;; esac\nfi\n"
            + ("" if group else "[ $live = 0 ] || exit 3\n")
            + f"kill -s {name} {target} 2>/dev/null || exit 3\nexit $live\n"
        )
        return self.run(_sh(script), timeout=self.op_timeout, check=False).status == 0

    def _stats(self, pids: list[int]) -> dict[int, str]:
        """pid -> its /proc/<pid>/stat line, for those that exist, in one round trip."""
        if not pids:
            return {}
        files = " ".join(f"/proc/{int(p)}/stat" for p in pids)
        out = self.run(_sh(f"cat {files} 2>/dev/null; exit 0"), timeout=self.op_timeout).stdout
        stats = {}
        for line in out.splitlines():
            stat = parse_stat(line)
            if stat is not None:
                stats[stat.pid] = line
        return stats

    def alive(self, refs: list[ProcRef]) -> dict[int, bool]:
        """pid -> alive, one command for all of them."""
        stats = self._stats([r.pid for r in refs])
        return {r.pid: is_live(parse_stat(stats.get(r.pid, "")), r) for r in refs}

    def proc_state(self, ref: ProcRef) -> str | None:
        """The process state letter, None if gone or the pid was reused."""
        stat = parse_stat(self._stats([ref.pid]).get(ref.pid, ""))
        return stat.state if stat and stat.start_ticks == ref.start_ticks else None

    def close(self) -> None:
        """Close the connection (and the jump host's); started processes keep running."""
        with self._lock:
            self._drop()
        if self._jump is not None:
            self._jump.close()


def _pump(chan: paramiko.Channel, data: bytes, deadline: float) -> tuple[bytes, bytes]:
    """Feed `data` to stdin while draining stdout and stderr, until EOF; TimeoutError at
    `deadline`. Everything in one loop, so neither side can block the other (paramiko#448)."""
    wake = threading.Event()  # set by paramiko whenever either buffer gets data
    chan.in_buffer.set_event(wake)
    chan.in_stderr_buffer.set_event(wake)
    out, err, sent = bytearray(), bytearray(), 0
    if not data:
        chan.shutdown_write()
    while True:
        busy = False
        if chan.recv_ready():
            out += chan.recv(1 << 16)
            busy = True
        if chan.recv_stderr_ready():
            err += chan.recv_stderr(1 << 16)
            busy = True
        if sent < len(data) and chan.send_ready():
            sent += chan.send(data[sent : sent + (1 << 15)])
            if sent == len(data):
                chan.shutdown_write()
            busy = True
        if (chan.eof_received or chan.closed) and not busy and not chan.recv_ready() and not chan.recv_stderr_ready():
            return bytes(out), bytes(err)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        if not busy:
            wake.wait(min(remaining, 0.05))  # 50 ms cap: window space for stdin sets no event
