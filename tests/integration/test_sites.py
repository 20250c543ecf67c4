"""bench/sites.py: real namespaces with shaped veths and an sshd per site, and a teardown that leaves nothing.

Needs root (CI runs as root); skipped otherwise. Every test checks that the machine's network
namespaces and veths are back to what they were before it ran.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.sites import SiteHost, Sites
from bench.sites_ledger import STATE_DIR, start_time
from dldctl import inventory
from syncer.common import strictjson
from syncer.common.atomic import atomic_write

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces, veths and tc need root"),
]

PREFIX = "dldt"  # not the harness's default: a test never meets a benchmark's sites
RATE = 8_000_000  # bits/s
PAYLOAD = 2_000_000  # bytes
# One end of a measured transfer: "serve-*" listens on argv[2] (any port, printed first), the
# others dial argv[2]:argv[3]; "*send" sends PAYLOAD bytes, "*recv" prints "bytes seconds", timed
# from the first byte to the end: what the link carried, not what the sender's buffers took.
PEER = f"""import socket, sys, time
mode, addr = sys.argv[1], sys.argv[2]
if mode.startswith("serve"):
    srv = socket.create_server((addr, 0)); print(srv.getsockname()[1], flush=True); c = srv.accept()[0]
else:
    c = socket.create_connection((addr, int(sys.argv[3])))
if mode.endswith("send"):
    c.sendall(b"x" * {PAYLOAD}); c.close()
else:
    n, t = 0, 0.0
    while b := c.recv(65536):
        t = t or time.monotonic(); n += len(b)
    print(n, time.monotonic() - t)
"""


def netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def veths() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


@pytest.fixture(autouse=True)
def leaves_nothing() -> Iterator[None]:
    """Nothing the test made is left. (What was there before may be gone: `Sites.start` removes a
    dead run's leftovers by design; CI once saw a site's namespace and veth vanish during a test.)"""
    before_ns, before_veths = netns(), veths()
    yield
    assert (netns() - before_ns, veths() - before_veths) == (set(), set())


def inside(ns: str) -> list[str]:
    return ["ip", "netns", "exec", ns]


def transfer(address: str, site_ns: str, upload: bool) -> float:
    """A connection from inside `site_ns` to a listener on `address` in the root namespace (the
    syncer's side); PAYLOAD bytes up (site -> operator) or down; the receiver's rate in bits/s."""
    server = subprocess.Popen(
        [sys.executable, "-c", PEER, "serve-recv" if upload else "serve-send", address],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = server.stdout.readline().strip()  # type: ignore[union-attr]
        client = [*inside(site_ns), sys.executable, "-c", PEER, "send" if upload else "recv", address, port]
        done = subprocess.run(client, capture_output=True, text=True, timeout=30)
        received, seconds = (server.communicate(timeout=30)[0] if upload else done.stdout).split()
    finally:
        server.kill()
        server.wait()
    assert int(received) == PAYLOAD
    return PAYLOAD * 8 / float(seconds)


def ssh(h: SiteHost, command: str) -> subprocess.CompletedProcess[str]:
    """The OpenSSH client with the harness's key and known_hosts only (strict host key checking)."""
    options = ["-F", "/dev/null", "-i", str(h.identity_file), "-o", f"UserKnownHostsFile={h.known_hosts}"]
    options += ["-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes"]
    return subprocess.run(
        ["ssh", *options, "-p", str(h.port), f"{h.user}@{h.address}", command],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_sites_are_reachable_shaped_and_leave_nothing_behind(tmp_path: Path) -> None:
    with Sites(tmp_path, 2, rate="8mbit", prefix=PREFIX) as sites:
        one, two = sites.hosts
        ours = {one.namespace, two.namespace}
        assert ours <= netns() and {one.veth_operator, two.veth_operator} <= veths()
        assert sites.advertise == one.operator_address and one.operator_address.startswith("198.1")

        # (a) ssh with the generated key and known_hosts lands inside site 1's namespace
        done = ssh(one, "ip -4 -o addr show")
        assert done.returncode == 0, done.stderr
        assert f"inet {one.address}/24" in done.stdout and two.address not in done.stdout

        # (b) site 2 reaches site 1's operator address (advertise) through its OWN veth, shaped
        # both ways at its own rate: the syncer's listener and the replies on that connection
        before = {h.name: sites.counters(h) for h in sites.hosts}
        up = transfer(sites.advertise, two.namespace, upload=True)
        down = transfer(sites.advertise, two.namespace, upload=False)
        after = {h.name: sites.counters(h) for h in sites.hosts}
        print(f"site2 -> operator {up / 1e6:.2f} Mbit/s, operator -> site2 {down / 1e6:.2f} Mbit/s (cap 8)")
        for rate in (up, down):
            assert 0.3 * RATE < rate < 1.3 * RATE
        assert after["site2"]["rx_bytes"] - before["site2"]["rx_bytes"] >= PAYLOAD
        assert after["site2"]["tx_bytes"] - before["site2"]["tx_bytes"] >= PAYLOAD
        assert all(after["site1"][k] - before["site1"][k] < PAYLOAD / 10 for k in ("rx_bytes", "tx_bytes"))

        # the inventory snippet is one dldctl accepts, with one advertise address for every site
        table = f'[syncer]\nbind = "0.0.0.0"\nadvertise = "{sites.advertise}"\n\n'
        inv = inventory.parse(tomllib.loads(table + sites.inventory_hosts(tmp_path / "h")), "sites")
        inventory.validate(inv)
        assert [(h.address, h.port) for h in inv.hosts] == [(one.address, 22), (two.address, 22)]
        assert inv.ssh.host_key_policy == "strict" and not inv.ssh.use_ssh_config
        pids = [one.sshd_pid, two.sshd_pid]

    # (c) nothing of it is left: namespaces, veths, sshd processes, state files
    assert not ours & netns()
    assert not {one.veth_operator, two.veth_operator} & veths()
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]
    assert not list(STATE_DIR.glob(f"{PREFIX}s*-{sites.token}.json"))
    sites.close()  # idempotent


def test_set_rate_reshapes_both_directions(tmp_path: Path) -> None:
    with Sites(tmp_path, 1, rate="100mbit", prefix=PREFIX) as sites:
        (h,) = sites.hosts
        sites.set_rate(h, "8mbit")
        up = transfer(h.operator_address, h.namespace, upload=True)
        assert 0.3 * RATE < up < 1.3 * RATE and sites.rates["site1"] == "8mbit"
        with pytest.raises(ValueError, match="not a tc rate"):
            sites.set_rate(h, "fast")


def test_set_operator_rate_reshapes_the_syncers_aggregate_egress(tmp_path: Path) -> None:
    """bench/race_thin.py joins fast and thins every link, the syncer's shared egress included."""
    with Sites(tmp_path, 1, rate="100mbit", operator_rate="100mbit", prefix=PREFIX) as sites:
        (h,) = sites.hosts
        sites.set_operator_rate("8mbit")
        down = transfer(h.operator_address, h.namespace, upload=False)
        assert 0.3 * RATE < down < 1.3 * RATE and sites.operator_rate == "8mbit"
    with pytest.raises(RuntimeError, match="no aggregate cap"):  # refused before any tc command
        Sites(tmp_path / "flat", 1, rate="100mbit", prefix=PREFIX).set_operator_rate("8mbit")


def test_a_dead_runs_leftovers_are_removed_and_a_live_runs_are_not(tmp_path: Path) -> None:
    token = os.urandom(3).hex()
    dead_ns, live_ns, veth = f"{PREFIX}s9-{token}", f"{PREFIX}s8-{token}", f"{PREFIX}9o{token}"
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid is now a dead owner's
    subprocess.run(["ip", "netns", "add", dead_ns], check=True)
    subprocess.run(["ip", "netns", "add", live_ns], check=True)
    subprocess.run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", dead_ns], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", dead_ns, "sleep", "600"])  # a process left inside
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    dead = {"namespace": dead_ns, "veth_operator": veth, "owner_pid": gone.pid, "owner_start": "1"}
    live = {"namespace": live_ns, "owner_pid": os.getpid(), "owner_start": start_time(os.getpid())}
    for record in (dead, live):
        atomic_write(STATE_DIR / f"{record['namespace']}.json", strictjson.dumps(record))
    try:
        time.sleep(0.2)  # let the sleeper enter the namespace
        with Sites(tmp_path, 1, rate="10mbit", prefix=PREFIX) as sites:
            assert sites.removed_stale == [dead_ns]
            assert dead_ns not in netns() and veth not in veths()
            assert not (STATE_DIR / f"{dead_ns}.json").exists()
            assert sleeper.wait(timeout=5) == -signal.SIGKILL
            assert live_ns in netns() and (STATE_DIR / f"{live_ns}.json").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
        for ns in (dead_ns, live_ns):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
            (STATE_DIR / f"{ns}.json").unlink(missing_ok=True)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)


SCRIPT = [sys.executable, str(Path(__file__).resolve().parents[2] / "bench" / "sites.py")]  # as a user runs it
NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]


def test_the_command_line_prints_the_sites_and_tears_down_on_ctrl_c(tmp_path: Path) -> None:
    cmd = [*SCRIPT, "--count", "1", "--rate", "10mbit", "--prefix", PREFIX, "--workdir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        while not (lines and lines[-1].startswith("sites are up")):
            lines.append(proc.stdout.readline())  # type: ignore[union-attr]
            assert lines[-1], "".join(lines)
        text = "".join(lines)
        assert "site1 198.1" in text and "(operator 198.1" in text and "[[hosts]]" in text
        assert 'host_key_policy = "strict"' in text
    finally:
        proc.send_signal(signal.SIGINT)  # its own teardown, also when an assertion above failed
        code = proc.wait(timeout=20)
    assert code == 0  # and the autouse fixture finds nothing left


# The checkout's files bench/sites.py loads (the rest is the standard library), one per line.
LOADED = """import os, sys
import bench.sites
root = os.getcwd() + os.sep
files = {getattr(m, "__file__", None) or "" for m in list(sys.modules.values())}
print(*sorted(f for f in files if f.startswith(root)), sep="\\n")
"""


@contextlib.contextmanager
def readable_by_all() -> Iterator[Path]:
    """bench/sites.py and the checkout's modules it imports, copied into a fresh directory every
    user may read, removed afterwards. The checkout may lie where only root enters (a clone under
    /root, in a fresh `mktemp -d`): what an unprivileged user runs must not depend on that."""
    root = Path(__file__).resolve().parents[2]
    listed = subprocess.run([sys.executable, "-c", LOADED], cwd=root, capture_output=True, text=True, check=True)
    top = Path(tempfile.mkdtemp(prefix="dldctl-sites-anyone-"))
    try:
        for name in listed.stdout.split():
            dest = top / Path(name).relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(name, dest)
        for path in [top, *top.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_without_root_the_command_line_refuses_in_one_line() -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    # the interpreter's own file: a virtual environment's `python` inside a closed checkout is a
    # link the unprivileged user cannot follow; what sites.py imports is all copied or stdlib
    python = os.path.realpath(sys.executable)
    if subprocess.run([*NOBODY, python, "-c", "pass"], capture_output=True).returncode != 0:
        pytest.skip(f"nobody cannot run {python}")
    with readable_by_all() as top:
        script = [python, str(top / "bench" / "sites.py")]
        argv = [*NOBODY, *script, "--count", "1"]
        refused = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=top)
    assert refused.returncode == 1 and refused.stdout == "", refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "cannot create network namespaces: not root (run as root, or with CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    ]
