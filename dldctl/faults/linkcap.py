"""`chaos link` as data: the tc commands that cap one learner's traffic to and from the syncer.
Pure: the shell (dldctl/faults/links.py) probes each host and runs what this module writes.

Each direction is capped where it leaves a host, since a kernel shapes only what it sends: the
learner's pushes on the learner's host (to the syncer's address and port), the syncer's replies
and state on the syncer's host (to the learner's address, from the syncer's port). The cap is an
htb class with a u32 filter, so only that traffic is touched: a device whose root qdisc is
already htb (a shaped link) gets one more class beside its own; one with the kernel's default
qdisc gets dldctl's htb root (handle d1d:) whose default class leaves all else at full speed, and
loses it again with the last cap; any other root qdisc is refused (replacing it would change the
host's other traffic). tc `police` and `netem` are not needed (many kernels lack them).

Class and filter ids come from the learner's number, so the undo needs nothing remembered: it
finds the same device again and deletes the same ids.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

OWN_HANDLE = "d1d"  # the root htb dldctl adds on a device that had the kernel's default qdisc
DEFAULT_QDISCS = frozenset({"noqueue", "fq_codel", "pfifo_fast", "mq", "fq", "pfifo", "cake", "noop"})
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)\s*$", re.IGNORECASE)
_UNITS = {"bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000}


class LinkCapError(ValueError):
    """A cap that cannot be set on a host; the message says why in one sentence."""


@dataclass(frozen=True)
class LinkSide:
    """What a host said about its way to the other end (from `probe_script`)."""

    host: str
    peer_ip: str  # the other end's address as this host resolves it
    dev: str  # the device the route to it leaves by
    src: str  # this host's address on that route (what the other end sees)
    root_kind: str  # the device's root qdisc: htb, noqueue, fq_codel, tbf, ...
    root_handle: str  # e.g. "1" for "1:"


def parse_rate(text: str) -> int:
    """bits/s of `1mbit`, `500kbit`, `2.5gbit`, `64000bit` (tc's bit units; bytes are not accepted)."""
    match = _RATE.match(text)
    if not match:
        raise LinkCapError(f"{text!r} is not a rate: write it as tc does, e.g. 1mbit, 500kbit or 1gbit")
    bits = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if bits < 8_000:
        raise LinkCapError(f"{text!r} is below 8kbit: the learner could not even keep its heartbeats")
    return bits


def probe_script(peer: str) -> str:
    """A sh script that prints, one `key=value` a line, what `parse_probe` needs about the way to `peer`."""
    q = shlex.quote(peer)
    return (
        'echo "uid=$(id -u)"; echo "tc=$(command -v tc)"; '
        f"ip=$(getent ahostsv4 {q} | awk 'NR==1{{print $1}}'); echo \"ip=$ip\"; "
        '[ -n "$ip" ] && r=$(ip -o route get "$ip" 2>&1); echo "route=$r"; '
        "dev=$(printf '%s' \"$r\" | sed -n 's/.* dev \\([^ ]*\\).*/\\1/p'); echo \"dev=$dev\"; "
        '[ -n "$dev" ] && echo "qdisc=$(tc qdisc show dev "$dev" 2>&1 | grep -m1 " root ")"; true'
    )


def parse_probe(host: str, peer: str, text: str) -> LinkSide:
    """The host's side of the link, or LinkCapError naming the host and why no cap can go there."""
    facts = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    if facts.get("uid") != "0":
        raise LinkCapError(f"host {host}: not root (tc needs CAP_NET_ADMIN to cap a link)")
    if not facts.get("tc"):
        raise LinkCapError(f"host {host}: tc not found (install iproute2)")
    if not facts.get("ip"):
        raise LinkCapError(f"host {host}: cannot resolve {peer}")
    route = facts.get("route", "")
    src = re.search(r"\bsrc (\S+)", route)
    if not facts.get("dev") or src is None:
        raise LinkCapError(f"host {host}: no route to {facts['ip']} ({route.strip() or 'ip route get said nothing'})")
    kind, handle = parse_root(facts.get("qdisc", ""))
    return LinkSide(host, facts["ip"], facts["dev"], src.group(1), kind, handle)


def parse_root(line: str) -> tuple[str, str]:
    """(kind, handle) of a `tc qdisc show` root line: `qdisc htb 1: root ...` -> ("htb", "1")."""
    parts = line.split()
    if len(parts) >= 3 and parts[0] == "qdisc":
        return parts[1], parts[2].rstrip(":")
    return "noqueue", "0"


def ids(learner: str, end: int) -> tuple[str, int]:
    """(class minor in hex, filter pref) of one end's cap (0: the learner's host, 1: the syncer's;
    they differ so both fit on one device when both run on one machine): learner-N, end E ->
    (a000 + 0x1000 E + N in hex, 40000 + 4000 E + N)."""
    number = learner.rsplit("-", 1)[-1]
    n = int(number) % 4000 if number.isdigit() else sum(map(ord, learner)) % 4000
    return f"{0xA000 + 0x1000 * end + n:x}", 40000 + 4000 * end + n


def burst_bytes(rate_bits: int) -> int:
    """A bucket of ~20 ms at the rate, at least 16 KiB (a few full-size packets)."""
    return max(16 << 10, rate_bits // 8 // 50)


def cap_commands(side: LinkSide, learner: str, end: int, rate_bits: int, match: str) -> list[str]:
    """The tc commands that cap what `match` selects on `side`'s device (LinkCapError if they cannot)."""
    dev = shlex.quote(side.dev)
    minor, pref = ids(learner, end)
    out: list[str] = []
    handle = side.root_handle
    if side.root_kind != "htb":
        if side.root_kind not in DEFAULT_QDISCS:
            raise LinkCapError(
                f"host {side.host}: {side.dev}'s root qdisc is {side.root_kind}, not the kernel's default "
                "nor htb: a cap would replace it and change the host's other traffic"
            )
        handle = OWN_HANDLE
        out += [
            f"tc qdisc replace dev {dev} root handle {handle}: htb default 1",
            f"tc class replace dev {dev} parent {handle}: classid {handle}:1 htb rate 100gbit",
        ]
    burst = burst_bytes(rate_bits)
    out += [
        f"tc class replace dev {dev} parent {handle}: classid {handle}:{minor} htb rate {rate_bits}bit "
        f"ceil {rate_bits}bit burst {burst} cburst {burst}",
        f"tc filter replace dev {dev} parent {handle}: protocol ip pref {pref} u32 {match} flowid {handle}:{minor}",
    ]
    return out


def to_syncer(syncer_ip: str, port: int) -> str:
    """The u32 match of a learner's traffic to the syncer (on the learner's host)."""
    return f"match ip dst {syncer_ip}/32 match ip dport {port} 0xffff"


def from_syncer(learner_ip: str, port: int) -> str:
    """The u32 match of the syncer's traffic to one learner (on the syncer's host)."""
    return f"match ip dst {learner_ip}/32 match ip sport {port} 0xffff"


def uncap_script(side: LinkSide, learner: str, end: int) -> str:
    """A sh script that removes the learner's cap from `side` (idempotent; always exits 0), and
    dldctl's own root qdisc with the last cap in it."""
    dev = shlex.quote(side.dev)
    minor, pref = ids(learner, end)
    handle = side.root_handle
    lines = [
        f"tc filter del dev {dev} parent {handle}: pref {pref} 2>/dev/null",
        f"tc class del dev {dev} classid {handle}:{minor} 2>/dev/null",
    ]
    if handle == OWN_HANDLE:
        lines.append(
            f'[ "$(tc class show dev {dev} | grep -c "class htb {OWN_HANDLE}:")" -le 1 ] && '
            f"tc qdisc del dev {dev} root 2>/dev/null"
        )
    return "; ".join(lines) + "; true"
