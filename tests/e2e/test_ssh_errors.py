"""Errors that tell the truth (issue 23): each against a real sshd configured that way, or a
real socket server on loopback for the cases that are not sshd at all.

- an sshd without an SFTP subsystem: said so, with the sshd_config line that fixes it; one
  whose SFTP program is missing, prints text, or never answers: which of these;
- sshd past MaxStartups (it writes "Exceeded MaxStartups" before closing): named as the cause;
- a listener that accepts and closes, or sends something else: the possible causes, not one;
- a listener that accepts and never speaks, an sshd stopped with SIGSTOP, a banner and then
  silence: "no SSH handshake ... within N s (connect_timeout)", within about that time;
- `dldctl check` and `dldctl up` show those same lines.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import pytest

from dldctl import inventory
from dldctl.errors import DldError, HostError, UnreachableError
from dldctl.hosts import SSHHost
from dldctl.lifecycle import check as check_mod
from dldctl.testing import DldctlHome
from tests.e2e.fleetutil import run_table
from tests.sshfleet import FleetHost, SSHFleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

CT = 1.5  # connect_timeout in these tests
BOUND = CT * 2 + 2  # "within about connect_timeout": a behaviour check, not a benchmark


class Listener:
    """A TCP server on a loopback address that greets each connection with `send` (maybe
    nothing), then closes it ("close") or holds it open without a word ("silent")."""

    def __init__(self, address: str, *, send: bytes = b"", then: str = "close") -> None:
        self.server = socket.create_server((address, 0))
        self.address, self.port = address, self.server.getsockname()[1]
        self.send, self.then, self.accepted = send, then, 0
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                conn.sendall(self.send)
            except OSError:
                pass
            if self.then == "close":
                conn.close()
            else:
                self.held.append(conn)

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        for s in [self.server, *self.held]:
            s.close()


def fails(name: str, address: str, port: int, tmp_path: Path, **kw: object) -> tuple[DldError, float]:
    """Connect (and open SFTP, as `check` and `up` do); the error and how long it took."""
    args: dict = dict(port=port, use_ssh_config=False, known_hosts=tmp_path / "kh", connect_timeout=CT)
    args.update(kw)
    t0 = time.monotonic()
    with pytest.raises(DldError) as info, SSHHost(name, address, **args) as s:
        s.home()
    return info.value, time.monotonic() - t0


def fleet_args(h: FleetHost, tmp_path: Path) -> dict:
    known = SSHFleet.write_known_hosts(tmp_path / f"kh-{h.port}", [h])
    return dict(user=h.user, identity_file=h.identity_file, known_hosts=known)


@pytest.fixture
def extra_sshd(ssh_fleet: SSHFleet, request: pytest.FixtureRequest) -> Iterator[FleetHost]:
    """One more sshd on 127.0.0.7 with the sshd_config options of the test's parameter."""
    h = ssh_fleet.start_sshd("127.0.0.7", host_key=ssh_fleet.hosts[0].host_key, options=request.param)
    try:
        yield h
    finally:
        os.kill(h.pid, signal.SIGCONT)  # in case the test stopped it
        ssh_fleet.stop_host(h)


@pytest.mark.parametrize("extra_sshd", [{"Subsystem": None}], indirect=True)
def test_no_sftp_subsystem_says_so_and_how_to_fix_it(extra_sshd: FleetHost, tmp_path: Path) -> None:
    h = extra_sshd
    with SSHHost("nosftp", h.address, port=h.port, use_ssh_config=False, **fleet_args(h, tmp_path)) as s:
        assert s.run("echo commands-work").stdout == "commands-work\n"
        with pytest.raises(HostError) as info:
            s.home()
    msg = info.value.line()
    assert msg.startswith(f"host nosftp: the sshd on {h.address}:{h.port} has no SFTP subsystem")
    assert "Subsystem sftp internal-sftp" in msg and "/usr/lib/openssh/sftp-server" in msg
    assert "restart sshd" in msg and "Channel closed" not in msg
    assert "subsystem not found" in h.log.read_text()


@pytest.mark.parametrize(
    ("extra_sshd", "says"),
    [
        ({"Subsystem": "sftp /nonexistent/sftp-server"}, "it exited with status 127: program not found"),
        ({"Subsystem": "sftp /bin/echo welcome; sleep 1"}, "the channel carried something other than SFTP"),
        ({"Subsystem": "sftp /bin/sleep 30"}, "no SFTP version reply within 1s"),
    ],
    ids=["missing", "prints-text", "silent"],
    indirect=["extra_sshd"],
)
def test_an_sftp_server_that_does_not_start_says_how(extra_sshd: FleetHost, tmp_path: Path, says: str) -> None:
    h = extra_sshd
    with SSHHost("badsftp", h.address, port=h.port, use_ssh_config=False, op_timeout=1, **fleet_args(h, tmp_path)) as s:
        with pytest.raises(HostError) as info:
            s.home()
        assert s.run("echo still-fine").stdout == "still-fine\n"
    msg = info.value.line()
    assert msg.startswith(f"host badsftp: the SFTP server on {h.address}:{h.port} did not start: {says}"), msg
    assert "`Subsystem sftp` line" in msg


def _hold_one_unauthenticated(h: FleetHost) -> socket.socket:
    """A connection that got the banner and says nothing: sshd counts it against MaxStartups."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = socket.create_connection((h.address, h.port), timeout=5)
        if s.recv(256).startswith(b"SSH-"):
            return s
        s.close()  # the fleet's readiness probe still counted: try again
        time.sleep(0.1)
    raise AssertionError("could not hold a connection")


@pytest.mark.parametrize("extra_sshd", [{"MaxStartups": "1:100:1"}], indirect=True)
def test_maxstartups_is_named_when_sshd_says_so(extra_sshd: FleetHost, tmp_path: Path) -> None:
    h = extra_sshd
    args = fleet_args(h, tmp_path)
    held = _hold_one_unauthenticated(h)
    try:
        error, took = fails("busy", h.address, h.port, tmp_path, **args)
    finally:
        held.close()
    msg = error.line()
    assert isinstance(error, UnreachableError) and took < BOUND
    assert re.search(r'refused new connections: its sshd said "Exceeded MaxStartups" \(\d attempts\)', msg), msg
    assert "raise MaxStartups" in msg and "past MaxStartups" in h.log.read_text()
    with SSHHost("busy", h.address, port=h.port, use_ssh_config=False, connect_timeout=5, **args) as s:
        assert s.run("echo free-again").stdout == "free-again\n"  # retried until the slot freed


def test_accepted_then_closed_names_the_possible_causes_only(tmp_path: Path) -> None:
    with Listener("127.0.0.8", then="close") as srv:
        error, took = fails("closer", srv.address, srv.port, tmp_path)
    msg = error.line()
    assert isinstance(error, UnreachableError) and took < BOUND and srv.accepted >= 2  # retried
    assert re.search(
        rf"{srv.address}:{srv.port} accepted the connection and (closed|reset) it before the SSH banner "
        rf"\({srv.accepted} attempts\): not an SSH server on that port, a firewall or proxy, or sshd refusing "
        r"new connections \(MaxStartups\)",
        msg,
    ), msg
    assert "Exceeded" not in msg and "overloaded" not in msg


def test_something_else_on_the_port_is_quoted_and_not_retried(tmp_path: Path) -> None:
    with Listener("127.0.0.8", send=b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n") as srv:
        error, took = fails("web", srv.address, srv.port, tmp_path)
    msg = error.line()
    assert srv.accepted == 1 and took < 2
    assert "sending 'HTTP/1.1 400 Bad Request / Content-Length: 0' instead of an SSH banner" in msg, msg
    assert "MaxStartups" not in msg


def _assert_no_handshake(error: DldError, took: float, where: str, step: str) -> None:
    msg = error.line()
    assert isinstance(error, UnreachableError), msg
    assert msg.startswith(f"host hung: no SSH handshake from {where} within {CT:g} s (connect_timeout): {step}"), msg
    assert "No existing session" not in msg and "MaxStartups" not in msg
    assert CT - 0.1 <= took < BOUND, took


def test_a_listener_that_never_speaks_times_out_within_connect_timeout(tmp_path: Path) -> None:
    with Listener("127.0.0.8", then="silent") as srv:
        error, took = fails("hung", srv.address, srv.port, tmp_path)
        assert srv.accepted == 1  # a timeout is not retried: the budget is spent
    _assert_no_handshake(error, took, f"{srv.address}:{srv.port}", "it accepted the TCP connection but sent no SSH")


def test_a_banner_then_silence_times_out_in_the_key_exchange(tmp_path: Path) -> None:
    with Listener("127.0.0.8", send=b"SSH-2.0-OpenSSH_9.2p1 then-nothing\r\n", then="silent") as srv:
        error, took = fails("hung", srv.address, srv.port, tmp_path)
    _assert_no_handshake(error, took, f"{srv.address}:{srv.port}", "the key exchange did not finish")


@pytest.mark.parametrize("extra_sshd", [{}], indirect=True)
def test_a_stopped_sshd_times_out_within_connect_timeout(extra_sshd: FleetHost, tmp_path: Path) -> None:
    h = extra_sshd
    os.kill(h.pid, signal.SIGSTOP)  # the kernel still accepts TCP; sshd never answers
    try:
        error, took = fails("hung", h.address, h.port, tmp_path, **fleet_args(h, tmp_path))
    finally:
        os.kill(h.pid, signal.SIGCONT)
    _assert_no_handshake(error, took, f"{h.address}:{h.port}", "it accepted the TCP connection but sent no SSH")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra_sshd", [{"Subsystem": None}], indirect=True)
def test_check_and_up_show_the_same_lines(extra_sshd: FleetHost, tmp_path: Path) -> None:
    h = extra_sshd
    known = SSHFleet.write_known_hosts(tmp_path / "known_hosts", [h])
    with Listener("127.0.0.8", then="silent") as srv:
        inv = tmp_path / "inventory.toml"
        inv.write_text(
            run_table("errors", quorum=1)
            + f'\n[ssh]\nuser = "root"\nidentity_file = "{h.identity_file}"\nknown_hosts = "{known}"\n'
            f"use_ssh_config = false\nconnect_timeout = {CT}\n"
            + "".join(
                f'\n[[hosts]]\nname = "{name}"\naddress = "{addr}"\nport = {port}\nlearners = 1\n'
                f'python = "{sys.executable}"\nworkdir = "{tmp_path / name}"\n'
                for name, addr, port in (("nosftp", h.address, h.port), ("hung", srv.address, srv.port))
            )
        )
        t0 = time.monotonic()
        results = check_mod.check(inventory.load(inv))  # what `check` prints and `check --json` records
        took = time.monotonic() - t0
        with DldctlHome(tmp_path / "home") as dl:
            up = dl("up", str(inv), "-d", check=False, timeout=60)
            assert dl.leftovers() == []
    assert took < BOUND, took  # both hosts at once, each within connect_timeout
    details = {r.name: r.items["ssh"][1] for r in results}
    assert not any(r.ok for r in results) and all(list(r.items) == ["ssh"] for r in results)
    assert details["nosftp"].startswith(f"host nosftp: the sshd on {h.address}:{h.port} has no SFTP subsystem")
    assert details["hung"].startswith(f"host hung: no SSH handshake from {srv.address}:{srv.port} within 1.5 s")
    shown = " ".join((up.stdout + up.stderr).split())
    assert up.returncode == 1 and all(f"{name}: failed: {line}" in shown for name, line in details.items()), shown
    assert "fewer than quorum 1" in shown and all(shown.count(line) == 2 for line in details.values())  # and again
