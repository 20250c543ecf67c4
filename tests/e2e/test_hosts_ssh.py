"""SSHHost against real sshd hosts on loopback (the `ssh_fleet` fixture, tests/sshfleet.py)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paramiko
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from dldctl.errors import (
    HostError,
    HostKeyError,
    RemoteCommandError,
    SSHAuthError,
    UnreachableError,
)
from dldctl.hosts import LocalHost, ProcRef, SSHHost
from tests.sshfleet import FleetHost, SSHFleet, descendants, free_port, keygen, write_ssh_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def connect(h: FleetHost, name: str = "fleet", **kw: object) -> SSHHost:
    """An SSHHost for a fleet host; keyword arguments override the fleet's settings."""
    args: dict = dict(
        port=h.port, user=h.user, identity_file=h.identity_file, known_hosts=h.known_hosts, use_ssh_config=False
    )
    args.update(kw)
    return SSHHost(name, h.address, **args)


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.fixture(scope="module")
def host(ssh_fleet: SSHFleet) -> Iterator[SSHHost]:
    """One connection to the first fleet host, shared by the tests that do not close it."""
    h = connect(ssh_fleet.hosts[0], "fleet-0")
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def rdir(ssh_fleet: SSHFleet, request: pytest.FixtureRequest) -> str:
    """A fresh directory for this test on the (loopback) remote side, inside the fleet's
    workdir so that nothing lands in the real home directory."""
    path = ssh_fleet.workdir / "remote" / request.node.name.replace("[", "-").rstrip("]")
    return str(path)


@pytest.fixture
def started() -> Iterator[list[ProcRef]]:
    """Processes a test started on a fleet host: SIGKILLed (by group) afterwards. The fleet is
    this machine, so LocalHost can do it even when the SSH side is what broke."""
    refs: list[ProcRef] = []
    try:
        yield refs
    finally:
        for ref in refs:
            LocalHost("cleanup").signal(ref, signal.SIGKILL)


def test_run_large_output_input_env_and_errors(host: SSHHost) -> None:
    t0 = time.monotonic()
    big = "head -c 6000000 /dev/zero | tr '\\0' o; head -c 5000000 /dev/zero | tr '\\0' e >&2"
    r = host.run(big, timeout=30)
    assert (r.status, len(r.stdout), len(r.stderr)) == (0, 6_000_000, 5_000_000)
    assert time.monotonic() - t0 < 10
    r = host.run('cat; printf "|%s" "$DLD_X"', input=b"x" * 3_000_000, env={"DLD_X": "a b'c\nd"})
    assert r.stdout == "x" * 3_000_000 + "|a b'c\nd"
    with pytest.raises(RemoteCommandError) as info:
        host.run("echo out; echo boom-detail >&2; exit 3")
    assert info.value.status == 3 and "boom-detail" in info.value.output_tail
    assert "host fleet-0" in str(info.value)
    t0 = time.monotonic()
    with pytest.raises(HostError, match=r"did not finish within 0.5s"):
        host.run("sleep 3", timeout=0.5)
    assert time.monotonic() - t0 < 3
    assert host.run("echo still-usable").stdout == "still-usable\n"


def test_files(host: SSHHost, tmp_path: Path, rdir: str) -> None:
    base = rdir
    src = tmp_path / "blob.bin"
    src.write_bytes(bytes(range(256)) * 4000)
    host.put_file(src, f"{base}/a/b/blob.bin", mode=0o640)
    host.put_file(src, f"{base}/private.bin", mode=0o600)
    home = host.home()
    assert home.startswith("/") and host.exists("~") and host.exists(f"{home}/")
    assert host.exists(f"{base}/a/b/blob.bin") and not host.exists(f"{base}/none")
    assert host.size(f"{base}/a/b/blob.bin") == 1_024_000 and host.size(f"{base}/none") is None
    assert host.read_bytes(f"{base}/a/b/blob.bin", 300, 10) == src.read_bytes()[300:310]
    host.get_file(f"{base}/a/b/blob.bin", tmp_path / "back" / "blob.bin")
    assert (tmp_path / "back" / "blob.bin").read_bytes() == src.read_bytes()
    host.put_bytes(b"s3cret", f"{base}/keys/k.key")
    assert host.read_bytes(f"{base}/keys/k.key") == b"s3cret"
    # /proc/vmstat over SFTP (its size says 0): the same kernel's OOM-kill count as here
    assert host.oom_kills() is not None and host.oom_kills() == LocalHost("here").oom_kills()
    modes = host.run(f"cd {base} && stat -c '%a %n' a/b/blob.bin private.bin keys/k.key").stdout
    assert modes.split("\n")[:3] == ["640 a/b/blob.bin", "600 private.bin", "600 keys/k.key"]
    host.mkdir(f"{base}/m/n/o")
    host.mkdir(f"{base}/m/n/o")
    assert host.run(f"test -d {base}/m/n/o && find {base} -name '*.tmp' | wc -l").stdout == "0\n"
    with pytest.raises(HostError, match="no such file"):
        host.read_bytes(f"{base}/none")


def test_start_survives_disconnect_and_group_signal(ssh_fleet: SSHFleet, rdir: str, started: list[ProcRef]) -> None:
    h0 = ssh_fleet.hosts[0]
    first = connect(h0, "first")
    first.mkdir(rdir)
    ref = first.start(
        ["sh", "-c", f'echo "got $DLD_SECRET" > {rdir}/out; sleep 60 & echo $! > {rdir}/child; echo to-log; pwd; wait'],
        cwd="~",
        log=f"{rdir}/logs/p.log",
        env={"DLD_SECRET": "hunter2"},
    )
    started.append(ref)
    first.close()  # the process must outlive the connection
    with connect(h0, "second") as h:
        assert wait_for(lambda: h.exists(f"{rdir}/child") and h.read_bytes(f"{rdir}/child").strip() != b"")
        child = int(h.read_bytes(f"{rdir}/child"))
        assert h.alive([ref]) == {ref.pid: True}
        assert h.read_bytes(f"{rdir}/out") == b"got hunter2\n"
        assert h.read_bytes(f"{rdir}/logs/p.log.pid") == f"{ref.pid}\n".encode()
        assert h.tail(f"{rdir}/logs/p.log").split("\n") == ["to-log", h.home()]
        ps = h.run(f"ps -o pid=,pgid=,sid= -p {ref.pid} {child}").stdout.split()
        assert ps == [str(ref.pid)] * 3 + [str(child), str(ref.pid), str(ref.pid)]
        assert b"hunter2" not in h.read_bytes(f"/proc/{ref.pid}/cmdline")
        assert h.run(f"readlink /proc/{ref.pid}/fd/0").stdout == "/dev/null\n"
        assert h.signal(ref, signal.SIGTERM) is True
        assert wait_for(
            lambda: (
                h.proc_state(ref) in (None, "Z")
                and h.run(
                    f"kill -0 {child} 2>/dev/null && ! grep -q '^State:.*Z' /proc/{child}/status", check=False
                ).status
                != 0
            )
        )
        assert h.alive([ref]) == {ref.pid: False}
        assert h.signal(ref, signal.SIGTERM) is False


def test_alive_many_in_one_round_trip_and_stop_continue(
    host: SSHHost, started: list[ProcRef], rdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refs = [host.start(["sleep", "60"], cwd="/", log=f"{rdir}/p.log") for _ in range(6)]
    started.extend(refs)
    for ref in refs[:2]:
        assert host.signal(ref, signal.SIGKILL)
    reused = ProcRef(refs[2].pid, refs[2].start_ticks + 1)
    calls: list[str] = []
    real_run = host.run
    monkeypatch.setattr(host, "run", lambda cmd, **kw: calls.append(cmd) or real_run(cmd, **kw))
    assert wait_for(lambda: not any(host.alive(refs[:2]).values()))
    calls.clear()
    states = host.alive(refs[2:] + refs[:2])
    assert len(calls) == 1  # one round trip for all
    assert states == {**{r.pid: True for r in refs[2:]}, **{r.pid: False for r in refs[:2]}}
    assert host.alive([reused]) == {reused.pid: False}
    assert host.signal(reused, signal.SIGKILL) is False and host.proc_state(reused) is None
    assert host.signal(refs[2], signal.SIGSTOP)
    assert wait_for(lambda: host.proc_state(refs[2]) == "T")
    assert host.signal(refs[2], signal.SIGCONT, group=False)
    assert wait_for(lambda: host.proc_state(refs[2]) == "S")


def test_follow_a_remote_log(host: SSHHost, started: list[ProcRef], rdir: str) -> None:
    log = f"{rdir}/f.log"
    host.put_bytes(b"old 1\nold 2\nold 3\n", log)
    stop = threading.Event()
    lines = host.follow(log, from_end_lines=2, poll_s=0.05, stop=stop.is_set)
    assert [next(lines), next(lines)] == ["old 2", "old 3"]
    started.append(host.start(["sh", "-c", "for i in 1 2 3 4 5; do echo tick $i; sleep 0.05; done"], cwd="/", log=log))
    assert [next(lines) for _ in range(5)] == [f"tick {i}" for i in range(1, 6)]
    stop.set()
    assert list(lines) == []
    assert host.tail(log, 2) == "tick 4\ntick 5"


def test_strict_refuses_unknown_host_key(ssh_fleet: SSHFleet, tmp_path: Path) -> None:
    h = ssh_fleet.hosts[1]
    known = tmp_path / "known_hosts"
    known.write_text("")
    with pytest.raises(HostKeyError) as info:
        connect(h, "strict", known_hosts=known).run("true")
    msg = str(info.value)
    assert "unknown host key" in msg and f"ssh-keyscan -p {h.port} {h.address}" in msg
    assert "accept-new" in msg and known.read_text() == ""


def test_accept_new_adds_the_key_then_strict_works(ssh_fleet: SSHFleet, tmp_path: Path) -> None:
    h = ssh_fleet.hosts[1]
    known = tmp_path / "ssh" / "known_hosts"  # does not exist yet
    with connect(h, "tofu", known_hosts=known, host_key_policy="accept-new") as s:
        assert s.run("echo ok").stdout == "ok\n"
    assert known.read_text() == f"[{h.address}]:{h.port} {h.host_pub}\n"
    with connect(h, "strict", known_hosts=known) as s:
        assert s.run("echo ok").stdout == "ok\n"
    assert known.read_text().count("\n") == 1


@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_changed_host_key_is_refused(ssh_fleet: SSHFleet, tmp_path: Path, policy: str) -> None:
    h = ssh_fleet.hosts[1]
    other = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode()
    known = tmp_path / "known_hosts"
    known.write_text(f"[{h.address}]:{h.port} {other}\n")
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED") as info:
        connect(h, "mitm", known_hosts=known, host_key_policy=policy).run("true")
    assert "ssh-keygen -R" in str(info.value)
    assert known.read_text() == f"[{h.address}]:{h.port} {other}\n"


def test_identity_file_problems(ssh_fleet: SSHFleet, tmp_path: Path) -> None:
    h = ssh_fleet.hosts[1]
    missing = tmp_path / "no_such_key"
    with pytest.raises(SSHAuthError, match=f"identity file {missing} does not exist"):
        connect(h, "auth", identity_file=missing).run("true")
    garbage = tmp_path / "garbage_key"
    garbage.write_text("not a key\n")
    with pytest.raises(SSHAuthError, match=f"identity file {garbage} is not a usable"):
        connect(h, "auth", identity_file=garbage).run("true")
    stranger = keygen(tmp_path / "stranger", "not authorized")
    with pytest.raises(SSHAuthError, match="refused our key for user root"):
        connect(h, "auth", identity_file=stranger).run("true")


def test_unreachable_fails_fast(tmp_path: Path) -> None:
    port = free_port("127.0.0.5")
    t0 = time.monotonic()
    with pytest.raises(UnreachableError, match=f"connection refused by 127.0.0.5:{port}"):
        SSHHost("ghost", "127.0.0.5", port=port, use_ssh_config=False, known_hosts=tmp_path / "kh").run("true")
    assert time.monotonic() - t0 < 2


def test_many_concurrent_connections(ssh_fleet: SSHFleet) -> None:
    h = ssh_fleet.hosts[2]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with connect(h, f"c{i}") as s:
                results[i] = s.run(f"echo {i}").stdout.strip()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert errors == [] and results == {i: str(i) for i in range(20)}
    assert "past MaxStartups" not in h.log.read_text()  # the semaphore kept us under


def test_many_commands_on_one_connection(ssh_fleet: SSHFleet) -> None:
    with connect(ssh_fleet.hosts[2], "shared") as s:
        out: list[str] = []
        threads = [
            threading.Thread(target=lambda i=i: out.append(s.run(f"sleep 0.2; echo {i}").stdout)) for i in range(16)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sorted(out) == sorted(f"{i}\n" for i in range(16))  # beyond MaxSessions 10


class FlakyRelay:
    """Drops the first `drop` connections before the banner, without a word (as older sshd
    versions past MaxStartups do), then relays to `target`."""

    def __init__(self, address: str, target: tuple[str, int], drop: int) -> None:
        self.server = socket.create_server((address, 0))
        self.port, self.target, self.drop, self.dropped = self.server.getsockname()[1], target, drop, 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            if self.dropped < self.drop:
                self.dropped += 1
                conn.close()
                continue
            up = socket.create_connection(self.target)
            self.conns += [conn, up]
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def close(self) -> None:
        for s in [self.server, *self.conns]:
            s.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def test_dropped_banners_are_retried(ssh_fleet: SSHFleet, tmp_path: Path) -> None:
    h = ssh_fleet.hosts[2]
    relay = FlakyRelay("127.0.0.6", (h.address, h.port), drop=3)
    try:
        known = tmp_path / "known_hosts"
        known.write_text(f"[127.0.0.6]:{relay.port} {h.host_pub}\n")
        with SSHHost(
            "flaky",
            "127.0.0.6",
            port=relay.port,
            user=h.user,
            identity_file=h.identity_file,
            known_hosts=known,
            use_ssh_config=False,
        ) as s:
            assert s.run("echo through").stdout == "through\n"
        assert relay.dropped == 3
    finally:
        relay.close()


def test_ssh_config_alias(ssh_fleet: SSHFleet, tmp_path: Path) -> None:
    h = ssh_fleet.hosts[1]
    config = write_ssh_config(tmp_path / "config", "fleet-alias", h)
    with SSHHost("aliased", "fleet-alias", ssh_config_file=config) as s:
        assert (s.target.address, s.target.port, s.target.user) == (h.address, h.port, "root")
        assert s.run("echo via-alias").stdout == "via-alias\n"


def test_proxy_jump(ssh_fleet: SSHFleet) -> None:
    jump, target = ssh_fleet.hosts[0], ssh_fleet.hosts[1]
    with connect(target, "behind-jump", proxy_jump=f"root@{jump.address}:{jump.port}") as s:
        assert s.run("echo hello-from-behind").stdout == "hello-from-behind\n"
        transport = s._client.get_transport()
        sock = getattr(transport.sock, "inner", transport.sock)  # under sshconnect's recording tap
        assert isinstance(sock, paramiko.Channel)
        assert sock.get_transport().getpeername()[:2] == (jump.address, jump.port)


def test_reconnects_after_the_connection_drops(ssh_fleet: SSHFleet) -> None:
    with connect(ssh_fleet.hosts[2], "flappy") as s:
        assert s.run("echo 1").stdout == "1\n"
        s._client.get_transport().close()
        assert s.run("echo 2").stdout == "2\n"
        assert s.exists("/")


def test_hung_host_times_out(ssh_fleet: SSHFleet, tmp_path: Path) -> None:
    h2 = ssh_fleet.hosts[2]
    extra = ssh_fleet.start_sshd("127.0.0.4", host_key=h2.host_key)
    stopped: list[int] = []
    try:
        known = SSHFleet.write_known_hosts(tmp_path / "kh", [extra])
        with connect(extra, "hung", known_hosts=known, op_timeout=1.0) as s:
            assert s.run("echo up").stdout == "up\n" and s.exists("/")  # SFTP open too
            stopped = descendants(extra.pid)  # its session processes
            for pid in stopped:  # the host hangs, TCP stays up
                os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(HostError, match=r"did not finish within 1s|Timeout opening"):
                s.run("echo never", timeout=1.0)
            with pytest.raises(HostError, match="no answer within 1s"):
                s.size("/etc/hostname")
            assert time.monotonic() - t0 < 5
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        ssh_fleet.stop_host(extra)
