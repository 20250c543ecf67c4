"""`dldctl check`: can every host of an inventory run a learner? Host by host, before `up`.

For each host: SSH (reachability, host key, authentication), the Python it will use and its
version, torch and its version, the requested device, and whether the host can reach the
syncer's port on this machine (we listen on it for the duration of the check).
"""

from __future__ import annotations

import shlex
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dldctl import extras
from dldctl.errors import DldError
from dldctl.hostopen import open_host
from dldctl.hosts.slurm import SlurmHost
from dldctl.inventory import HostSpec, Inventory
from dldctl.lifecycle import plan

PROBE = r"""
import json, sys, socket
out = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.cuda.is_available()
    out["gpus"] = torch.cuda.device_count() if out["cuda"] else 0
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
addr, port = sys.argv[1], int(sys.argv[2])
try:
    socket.create_connection((addr, port), timeout=3).close()
    out["port"] = True
except OSError as exc:
    out["port"] = False
    out["port_error"] = str(exc)
print(json.dumps(out))
"""


@dataclass
class HostCheck:
    """Findings for one host; `ok` only if every check passed."""

    name: str
    items: dict[str, tuple[bool, str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(passed for passed, _ in self.items.values())

    def add(self, what: str, passed: bool, detail: str) -> None:
        self.items[what] = (passed, detail)


class _Listener:
    """A throwaway TCP listener standing in for the syncer's port during the check."""

    def __init__(self, bind: str, port: int = 0) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind, port))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        self.sock.close()


def _device_ok(spec: HostSpec, facts: dict) -> tuple[bool, str]:
    if spec.device == "cpu":
        return True, "cpu"
    if not facts.get("cuda"):
        return False, f"{spec.device} requested but torch sees no CUDA device"
    index = int(spec.device.split(":")[1]) if ":" in spec.device else 0
    gpus = facts.get("gpus", 0)
    return index < gpus, f"{gpus} GPU(s) visible" + ("" if index < gpus else f", {spec.device} is not one of them")


def _no_torch(spec: HostSpec, facts: dict) -> str:
    """The torch cell of a host whose Python has none: why, and what to do."""
    error = facts.get("torch_error", "missing")
    if spec.setup == "venv":
        return f"{error} (setup = venv installs it)"
    return f"{error} ({extras.fix('torch')})" if spec.local else error


def _site_ok(spec: HostSpec) -> str:
    """What a site's passing check covered."""
    part = f"partition {spec.partition}" if spec.partition else "the default partition"
    asks = "".join(f", {key} {getattr(spec, key)}" for key in ("account", "time") if getattr(spec, key))
    return f"sbatch, squeue, scancel, scontrol; {part} takes the jobs{asks}"


def check_host(inv: Inventory, spec: HostSpec, advertise: str | None, port: int) -> HostCheck:
    """Every check for one host; never raises for a host problem (it is reported instead)."""
    import json

    result = HostCheck(spec.name)
    host = open_host(spec, inv.ssh)
    try:
        host.home()
        result.add("ssh", True, "local" if spec.local else f"{spec.address} ok")
        if isinstance(host, SlurmHost):  # a site: its scheduler would take the jobs as asked
            found = host.problems()
            result.add(host.scheduler, not found, "; ".join(found) or _site_ok(spec))
        python = sys.executable if spec.local else spec.python
        if not advertise:
            local_end = getattr(host, "local_address", None)
            advertise = (local_end() if callable(local_end) else None) or "127.0.0.1"
        out = host.run(
            f"{shlex.quote(python)} -c {shlex.quote(PROBE)} {shlex.quote(advertise)} {port}", timeout=120, check=False
        )
        if out.status != 0:
            result.add(
                "python", False, f"{python}: {(out.stderr or out.stdout).strip().splitlines()[-1:] or ['not found']}"
            )
            return result
        facts = json.loads(out.stdout.strip().splitlines()[-1])
        result.add("python", True, f"{facts['python']} ({facts['executable']})")
        result.add("torch", "torch" in facts or spec.setup == "venv", facts.get("torch") or _no_torch(spec, facts))
        if spec.site:
            result.add("device", True, f"{spec.device}: on the compute nodes (the login node is not one)")
        else:
            result.add(
                "device",
                *(_device_ok(spec, facts) if "torch" in facts else (spec.device == "cpu", "unknown without torch")),
            )
        result.add(
            "port",
            bool(facts.get("port")),
            f"reaches {advertise}:{port}" if facts.get("port") else facts.get("port_error", "no"),
        )
    except DldError as exc:
        result.add("ssh", False, exc.line())
    finally:
        host.close()
    return result


def check(inv: Inventory, advertise: str | None = None) -> list[HostCheck]:
    """Check every host in parallel. The port the hosts dial is the syncer's own where the
    inventory fixed it (the one a firewall was opened for); one taken here is a ConfigError, as
    at `up`."""
    plan.check_fixed_ports(inv)
    listener = _Listener(plan.syncer_bind(inv), inv.syncer.port if inv.syncer.host == "local" else 0)
    address = advertise or inv.syncer.advertise or None
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            return list(pool.map(lambda h: check_host(inv, h, address, listener.port), inv.hosts))
    finally:
        listener.close()
