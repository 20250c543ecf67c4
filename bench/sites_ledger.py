"""Which emulated sites live runs own, and removing what dead runs left (bench/sites.py's ledger).

Each site's namespace is recorded in STATE_DIR/<namespace>.json before it is made, with its
owner's pid and kernel start time (a reused pid is not the owner), its veth, ifb and /24 block.
Under one lock (`state_lock`), a new run removes the sites of dead owners with its prefix
(`purge_stale`: their processes SIGKILLed, veths, ifb and namespace deleted, each step tolerating a
part already gone) and picks /24s of 198.18.0.0/15 that no live record holds and the root
namespace does not use (`free_blocks`). A live owner's sites are never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STATE_DIR = Path("/run/dldctl-sites")
GONE = ("No such file", "Cannot find device", "Cannot open network namespace")  # a part already removed


def sh(*cmd: str, ok: tuple[str, ...] = ()) -> str:
    """Run one command, return its stdout; a failure raises RuntimeError (one line) unless its
    stderr mentions one of `ok` (then "")."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if proc.returncode == 0:
        return proc.stdout
    if any(o in proc.stderr for o in ok):
        return ""
    first = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[0]
    raise RuntimeError(f"{' '.join(cmd)}: {first}")


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields from the state on (field 3); [] when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return []


def start_time(pid: int) -> str:
    """The kernel's start time of `pid` (stat field 22); "" when it is gone."""
    return "".join(_stat(pid)[19:20])


def _alive(record: dict[str, Any]) -> bool:
    """Whether the process that wrote `record` still runs (same pid AND start time: no reuse)."""
    start = str(record.get("owner_start", ""))
    return bool(start) and start_time(int(record.get("owner_pid", 0))) == start


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


@contextlib.contextmanager
def state_lock() -> Iterator[None]:
    """Serialise leftover removal and address allocation between concurrent runs."""
    STATE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd = os.open(STATE_DIR / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _wait_gone(pids: list[int], timeout: float = 5.0) -> None:
    """Until none of `pids` runs any more (a zombie counts as gone) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_stat(p)[:1] in ([], ["Z"]) for p in pids):
            return
        time.sleep(0.02)


def kill_namespace(namespace: str) -> list[int]:
    """SIGKILL every process inside `namespace` (one this harness made); their pids."""
    out = sh("ip", "netns", "pids", namespace, ok=GONE)
    pids = [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait_gone(pids)
    return pids


def purge(record: dict[str, Any]) -> None:
    """Remove one site's leftovers: its processes, its veth (both ends), the ifb, the namespace,
    then its state file. Each step tolerates an already-missing part."""
    namespace = str(record.get("namespace", ""))
    if namespace:
        kill_namespace(namespace)
    for dev in (record.get("veth_operator"), record.get("ifb")):
        if dev:
            sh("ip", "link", "del", str(dev), ok=GONE)
    if namespace:
        sh("ip", "netns", "delete", namespace, ok=GONE)
        (STATE_DIR / f"{namespace}.json").unlink(missing_ok=True)


def purge_stale(prefix: str) -> list[str]:
    """Remove the sites of earlier runs with this prefix whose owner died; their namespaces."""
    records = [r for p in sorted(STATE_DIR.glob(f"{prefix}s*.json")) if (r := _read_state(p)) is not None]
    stale = [r for r in records if not _alive(r) and str(r.get("namespace", "")).startswith(f"{prefix}s")]
    for record in stale:  # a live owner's, or not one of ours, is never touched
        purge(record)
    return [str(r["namespace"]) for r in stale]


def block_net(block: int) -> ipaddress.IPv4Network:
    """The /24 number `block` (1..511) of 198.18.0.0/15."""
    return ipaddress.IPv4Network(f"198.{18 + block // 256}.{block % 256}.0/24")


def free_blocks(count: int) -> list[int]:
    """`count` /24s of 198.18.0.0/15 that no live run records and the root namespace doesn't use."""
    used = {r.get("block") for p in STATE_DIR.glob("*.json") if (r := _read_state(p))}
    seen = sh("ip", "-4", "-o", "addr", "show") + sh("ip", "-4", "route", "show", "table", "all")
    used |= {(int(b) - 18) * 256 + int(c) for b, c in re.findall(r"\b198\.(18|19)\.(\d+)\.\d+", seen)}
    free = [n for n in range(1, 512) if n not in used][:count]
    if len(free) < count:
        raise RuntimeError(f"198.18.0.0/15 has only {len(free)} free /24s left, {count} sites need one each")
    return free
