"""Wide-area SITES on one machine, emulated with network namespaces, for tests and benchmarks.

Site i gets a network namespace `{prefix}s{i}-{token}` (a random token per `Sites`: two runs never
collide) and one veth pair: the operator end `{prefix}{i}o{token}` holds 198.18.i.1/24 in the root
("operator") namespace, the site end `eth0` holds 198.18.i.2/24 inside, with `lo` up and a default
route via 198.18.i.1. Addresses come from 198.18.0.0/15 only, one /24 per site; a /24 that a live
run or the root namespace already uses is skipped, so numbering starts at 198.18.1.0/24 but may not.

Reaching the syncer: the root namespace answers for its local addresses on every interface, so
site j reaches 198.18.1.1 through ITS OWN veth, shaped by ITS OWN limits: a syncer in the root
namespace bound to 0.0.0.0 is reachable by every site at one address, `Sites.advertise`. Nothing
is forwarded (ip_forward is left alone; bench/race.py turns it on for its data-parallel ring).

Shaping: each veth end's egress (site end: site -> operator; operator end: operator -> site) is an
htb root 1: whose class 1:1 has rate = ceil = R, burst max(R/250 bytes, 32 KiB) and a bfifo of
~50 ms under it (no bufferbloat); htb, not tbf, so that `dldctl chaos link` can put its own class
beside 1:1. Without `operator_rate` the operator's total egress is count x rate; with it, an ifb
`{prefix}i{token}` caps the total (each operator end's egress is redirected through its tbf).

Each site runs a real `/usr/sbin/sshd -D` on port 22 with a generated host key, accepting one
generated root key (tests/sshfleet.py's recipe). Teardown (`close()`, the context exit, or
SIGINT/SIGTERM) stops each sshd by pid, SIGKILLs what is left inside our namespaces (`ip netns
pids`) and deletes veths, ifb and namespaces. Each namespace is recorded first (bench/sites_ledger.py) in
/run/dldctl-sites/<namespace>.json with its owner's pid and start time; a later `Sites` with the
same prefix removes what dead owners left and never touches a live owner's.

    with Sites(workdir, count=2, rate="10mbit") as sites:
        toml = run_table + f'[syncer]\nbind = "0.0.0.0"\nadvertise = "{sites.advertise}"\n\n'
        toml += sites.inventory_hosts(workdir / "hosts")

`python bench/sites.py --count 2 --rate 10mbit`: sites up, printed with an inventory snippet,
down on Ctrl-C. Needs root: else `SitesUnavailable` says why in one line (no loopback fallback).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as python bench/sites.py

from bench.sites_ledger import STATE_DIR, block_net, free_blocks, purge, purge_stale, sh, start_time, state_lock
from syncer.common import strictjson
from syncer.common.atomic import atomic_write
from tests.sshfleet import PRIVSEP_DIR, SSHD, SSHFleet, keygen
from tests.sshfleet import _stop as stop_sshd_tree

SITE_DEV = "eth0"  # the site's veth end, created directly inside its namespace
SSH_PORT = 22
LATENCY = "50ms"
_UNITS = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_UNITS |= {"bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}  # tc: bps = BYTES/s
_AS_ROOT = "run as root, or with CAP_NET_ADMIN and CAP_SYS_ADMIN"
_CAPS = (12, 21)  # CAP_NET_ADMIN (veths, qdiscs), CAP_SYS_ADMIN (ip netns add mounts)
_MATCH_ALL = ("protocol", "all", "u32", "match", "u32", "0", "0")
_REDIRECT = ("action", "mirred", "egress", "redirect", "dev")


class SitesUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message is one line saying why."""


@dataclass(frozen=True)
class SiteHost:
    """One emulated site: how to ssh into it and where it reaches the operator."""

    name: str  # site1, site2, ...
    namespace: str
    address: str  # the site's end (its sshd listens here)
    operator_address: str  # the operator's end of this site's veth
    port: int
    user: str
    identity_file: Path
    known_hosts: Path
    veth_operator: str  # in the root namespace
    veth_site: str  # inside the site's namespace
    sshd_pid: int


def rate_bits(rate: str) -> int:
    """`rate` in bits per second, read the way tc reads it ("100mbit"; "mbps" is megaBYTES/s)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", rate.lower())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) * _UNITS[m.group(2)] < 8000:
        raise ValueError(f"rate {rate!r} is not a tc rate of at least 8kbit (e.g. 100mbit, 500kbit, 1gbit)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def htb(dev: str, rate: str, ns: str | None = None, *, first: bool = True) -> list[list[str]]:
    """The tc commands that shape `dev`'s egress at `rate` with htb (the module docstring says how);
    not `first`: only the class and its queue change (a link cap's classes beside it stay)."""
    bits, tc = rate_bits(rate), ["tc", *(["-n", ns] if ns else [])]
    burst, limit = str(max(bits // 8 // 250, 32 * 1024)), str(max(bits // 8 // 20, 128 * 1024))
    root = [[*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"]] if first else []
    leaf = ["rate", f"{bits}bit", "ceil", f"{bits}bit", "burst", burst, "cburst", burst]
    return [
        *root,
        [*tc, "class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb", *leaf],
        [*tc, "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:", "bfifo", "limit", limit],
    ]


def tbf(rate: str) -> list[str]:
    """The `root tbf ...` arguments for `rate` (the ifb's aggregate cap)."""
    bits = rate_bits(rate)
    return ["root", "tbf", "rate", f"{bits}bit", "burst", str(max(bits // 8 // 250, 32 * 1024)), "latency", LATENCY]


def check_available() -> None:
    """Raise SitesUnavailable (one line) unless this process can make namespaces and veths."""
    if os.geteuid() != 0:
        found = re.search(r"CapEff:\s*([0-9a-f]+)", Path("/proc/self/status").read_text())
        caps = int(found.group(1), 16) if found else 0
        if not all(caps >> bit & 1 for bit in _CAPS):
            raise SitesUnavailable(f"cannot create network namespaces: not root ({_AS_ROOT})")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise SitesUnavailable(f"cannot create network namespaces: `{tool}` (iproute2) is not installed")
    if not os.access(SSHD, os.X_OK):
        raise SitesUnavailable(f"cannot start the sites' sshd: {SSHD} not found (install openssh-server)")


def _add_namespace(ns: str) -> None:
    try:
        sh("ip", "netns", "add", ns)
    except RuntimeError as exc:
        if "not permitted" in str(exc) or "Permission denied" in str(exc):
            raise SitesUnavailable(f"cannot create network namespaces: {exc}") from None
        raise


class Sites:
    """`count` emulated sites; see the module docstring."""

    def __init__(
        self, workdir: Path, count: int, rate: str = "100mbit", operator_rate: str | None = None, prefix: str = "dld"
    ) -> None:
        self.token = secrets.token_hex(3)
        if not re.fullmatch(r"[a-z][a-z0-9]*", prefix) or len(f"{prefix}{count}o{self.token}") > 15:
            raise ValueError(f"prefix {prefix!r}: lowercase letters/digits, short enough for 15-char device names")
        if not 1 <= count <= 250:
            raise ValueError(f"count {count}: between 1 and 250 sites")
        for r in (rate, operator_rate or rate):
            rate_bits(r)  # ValueError now, not a tc error halfway through
        self.workdir, self.count, self.prefix = Path(workdir), count, prefix
        self.operator_rate = operator_rate
        self.rates: dict[str, str] = {f"site{i}": rate for i in range(1, count + 1)}
        self._fleet = SSHFleet(self.workdir, addresses=())  # its key layout and sshd_config, no sshd
        self.identity_file, self.known_hosts = self._fleet.identity_file, self._fleet.known_hosts
        self.ifb = f"{prefix}i{self.token}" if operator_rate else ""
        self.hosts: list[SiteHost] = []
        self.removed_stale: list[str] = []
        self._records: list[dict[str, Any]] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._handlers: dict[int, Any] = {}
        self._closing = self._closed = False
        self._pending = 0

    def __enter__(self) -> Sites:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def advertise(self) -> str:
        """The one address every site reaches the root namespace at (site 1's operator end)."""
        return self.hosts[0].operator_address

    def start(self) -> Sites:
        """Remove dead runs' leftovers, then make every site and wait for its sshd."""
        if self._records or self._closed:
            raise RuntimeError("a Sites starts once; make a new one")
        check_available()
        self._install_signals()
        try:
            with state_lock():
                self.removed_stale = purge_stale(self.prefix)
                blocks = free_blocks(self.count)
                self._records = [self._record(i, block) for i, block in enumerate(blocks, 1)]
                for record in self._records:  # recorded BEFORE it exists: a kill leaves nothing unrecorded
                    atomic_write(STATE_DIR / f"{record['namespace']}.json", strictjson.dumps(record, indent=1))
            for old in (self.identity_file, Path(f"{self.identity_file}.pub")):
                old.unlink(missing_ok=True)  # a reused workdir: ssh-keygen would ask before overwriting
            self._fleet.start()  # no addresses: just the user key and authorized_keys
            if self.ifb:
                self._make_ifb()
            for i, record in enumerate(self._records, 1):
                if self._closed:  # a signal tore it down and its old handler let us go on
                    raise RuntimeError("sites: torn down by a signal while starting")
                self.hosts.append(self._make_site(i, record))
            atomic_write(self.known_hosts, "".join(map(_known_host, self.hosts)))
        except BaseException:
            self.close()
            raise
        return self

    def _record(self, i: int, block: int) -> dict[str, Any]:
        """What a later run needs to remove this site if we die: names, /24, owner (pid + start)."""
        ns, op, me = f"{self.prefix}s{i}-{self.token}", f"{self.prefix}{i}o{self.token}", os.getpid()
        return dict(namespace=ns, veth_operator=op, ifb=self.ifb, block=block, owner_pid=me, owner_start=start_time(me))

    def _make_ifb(self) -> None:
        try:
            sh("ip", "link", "add", self.ifb, "type", "ifb")
        except RuntimeError as exc:
            raise SitesUnavailable(f"cannot cap the operator's aggregate egress: {exc}") from None
        sh("ip", "link", "set", self.ifb, "up")
        sh("tc", "qdisc", "replace", "dev", self.ifb, *tbf(str(self.operator_rate)))

    def _make_site(self, i: int, record: dict[str, Any]) -> SiteHost:
        ns, op = record["namespace"], record["veth_operator"]
        net = block_net(record["block"])
        op_addr, addr = str(net[1]), str(net[2])
        _add_namespace(ns)
        sh("ip", "link", "add", op, "type", "veth", "peer", "name", SITE_DEV, "netns", ns)
        sh("ip", "addr", "add", f"{op_addr}/24", "dev", op)
        sh("ip", "link", "set", op, "up")
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", SITE_DEV)
        for dev in (SITE_DEV, "lo"):
            sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", op_addr)
        self._shape(ns, op, self.rates[f"site{i}"])
        if self.ifb:  # through the ifb's aggregate cap first, then back through op's own tbf
            sh("tc", "qdisc", "add", "dev", op, "clsact")
            sh("tc", "filter", "add", "dev", op, "egress", *_MATCH_ALL, *_REDIRECT, self.ifb)
        pid = self._start_sshd(f"site{i}", ns, addr)
        return SiteHost(
            f"site{i}", ns, addr, op_addr, SSH_PORT, "root", self.identity_file, self.known_hosts, op, SITE_DEV, pid
        )

    @staticmethod
    def _shape(ns: str, op: str, rate: str, first: bool = True) -> None:
        for command in htb(op, rate, first=first) + htb(SITE_DEV, rate, ns, first=first):  # both ways
            sh(*command)

    def _start_sshd(self, name: str, ns: str, addr: str) -> int:
        """Start the site's sshd inside its namespace; its pid once it sends a banner."""
        sdir = self.workdir / "sshd" / name
        sdir.mkdir(parents=True, exist_ok=True)
        key = sdir / "ssh_host_ed25519_key"
        for old in (key, Path(f"{key}.pub")):
            old.unlink(missing_ok=True)
        keygen(key, f"host {name}")
        PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        config = self._fleet._write_config(sdir, addr, SSH_PORT, key, {})
        log = sdir / "sshd.log"
        with open(log, "ab") as out:  # -E appends here too; stderr catches what comes before
            cmd = ["ip", "netns", "exec", ns, SSHD, "-D", "-f", str(config), "-E", str(log)]
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self._procs.append(proc)  # `ip netns exec` execs sshd: the same pid
        SSHFleet._wait_ready(proc, addr, SSH_PORT, log)
        return proc.pid

    def _host(self, site: SiteHost | str) -> SiteHost:
        name = site if isinstance(site, str) else site.name
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no site {name!r} (have {', '.join(h.name for h in self.hosts)})")

    def counters(self, site: SiteHost | str) -> dict[str, int]:
        """Bytes the site's link carried: tx_bytes operator -> site, rx_bytes site -> operator."""
        stats = Path("/sys/class/net") / self._host(site).veth_operator / "statistics"
        return {k: int((stats / k).read_text()) for k in ("tx_bytes", "rx_bytes")}

    def set_rate(self, site: SiteHost | str, rate: str) -> None:
        """Change one site's rate, both directions (the aggregate cap, if any, stays)."""
        host = self._host(site)
        self._shape(host.namespace, host.veth_operator, rate, first=False)
        self.rates[host.name] = rate

    def set_operator_rate(self, rate: str) -> None:
        """Change the aggregate cap on the operator's egress to every site (made with `operator_rate`)."""
        if not self.ifb:
            raise RuntimeError("these sites have no aggregate cap: make them with operator_rate")
        sh("tc", "qdisc", "replace", "dev", self.ifb, *tbf(rate))
        self.operator_rate = rate

    def inventory_hosts(self, workdir: Path) -> str:
        """dldctl's [ssh] table and one [[hosts]] entry per site (learners' workdir: workdir/<name>).

        Prepend [run] and `[syncer]` with bind = "0.0.0.0" and advertise = `self.advertise`."""
        q = json.dumps  # a TOML basic string is a JSON string for the paths and names used here
        out = ["[ssh]", 'user = "root"', f"identity_file = {q(str(self.identity_file))}"]
        out += [f"known_hosts = {q(str(self.known_hosts))}", "use_ssh_config = false", 'host_key_policy = "strict"']
        for h in self.hosts:
            out += ["", "[[hosts]]", f"name = {q(h.name)}", f"address = {q(h.address)}", f"port = {h.port}"]
            out += ["learners = 1", f"python = {q(sys.executable)}", f"workdir = {q(str(Path(workdir) / h.name))}"]
        return "\n".join(out) + "\n"

    def close(self) -> None:
        """Tear everything down (idempotent; each step is tried even when an earlier one failed)."""
        if self._closed:
            return
        self._closing = True
        try:
            for proc in self._procs:
                _try(_stop_sshd, proc)
            for record in self._records:
                _try(purge, record)
        finally:
            self._closed = True
            self._restore_signals()
        if self._pending:  # a signal that came during teardown: deliver it now, to the old handler
            signal.raise_signal(self._pending)

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; close() still works
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue  # the script ignores it: so do we
            self._handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        while self._handlers:
            sig, old = self._handlers.popitem()
            signal.signal(sig, old if old is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Tear down, then hand the signal to whoever handled it before (Ctrl-C still interrupts)."""
        self._pending = signum  # close() re-raises it once the old handlers are back
        if not self._closing:  # else close() is already running: let it finish
            self.close()


def _known_host(h: SiteHost) -> str:
    """`addr key` (port 22) or `[addr]:port key`: the form ssh looks up for that port."""
    pub = (h.identity_file.parent / "sshd" / h.name / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    return f"{h.address if h.port == 22 else f'[{h.address}]:{h.port}'} {' '.join(pub)}\n"


def _stop_sshd(proc: subprocess.Popen[bytes]) -> None:
    """Stop one sshd we started (SIGTERM, then SIGKILL) and its sessions, if the pid still is sshd."""
    with contextlib.suppress(OSError):  # gone: nothing to stop
        if proc.poll() is None and b"sshd" in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
            stop_sshd_tree(proc)  # the sessions get SIGTERM; kill_namespace SIGKILLs what remains


def _try(fn: Any, *args: Any) -> None:
    """Run one teardown step; report a failure in one line and carry on with the next."""
    try:
        fn(*args)
    except Exception as exc:
        print(f"sites: teardown: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Bring sites up, print them and an inventory snippet, wait for Ctrl-C, tear down."""
    p = argparse.ArgumentParser(description="Emulated wide-area sites (network namespaces + tc + sshd).")
    p.add_argument("--count", type=int, default=2)
    p.add_argument("--rate", default="100mbit", help="each site's rate, both directions (tc syntax)")
    p.add_argument("--operator-rate", default=None, help="aggregate cap on the operator's egress")
    p.add_argument("--workdir", type=Path, default=None, help="keys, sshd files, learners' workdirs")
    p.add_argument("--prefix", default="dld")
    args = p.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dldctl-sites-"))
    try:
        with Sites(workdir, args.count, args.rate, args.operator_rate, args.prefix) as sites:
            for h in sites.hosts:
                print(f"{h.name} {h.address} (operator {h.operator_address}) ssh :{h.port} {sites.rates[h.name]}")
            print(f'\n# prepend [run] and: [syncer] bind = "0.0.0.0", advertise = "{sites.advertise}"')
            print(sites.inventory_hosts(workdir / "hosts"))
            print("sites are up; Ctrl-C tears them down", flush=True)
            while True:
                signal.pause()
    except SitesUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
