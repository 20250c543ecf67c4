"""What this host says a new process may have in memory: /proc/meminfo, and the memory limit and
usage (and memory.stat) of this process's cgroup and of every cgroup above it (v2 and v1),
as found.

Standard library only, and runnable on its own (`python hostmem.py` prints the JSON): `dldctl up`
and `check` send this file to each syncer host and run it there with the host's Python
(dldctl/lifecycle/memcheck.py); a syncer calls `probe()` on itself at its start and at each hello
before it has a model (syncer/server.py). syncer/common/memfit.py (pure) reads the answer:
`free(probe())`.
"""

from __future__ import annotations

import json
import os


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _mounts() -> dict[str, tuple[str, str]]:
    """cgroup v2 and the v1 memory hierarchy: (mount point, root inside the hierarchy)."""
    mounts: dict[str, tuple[str, str]] = {}
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) > 4 and len(rest) > 2 and rest[0] in ("cgroup", "cgroup2"):
            key = "v2" if rest[0] == "cgroup2" else ("v1" if "memory" in rest[2].split(",") else "")
            if key:
                mounts.setdefault(key, (fields[4], fields[3]))
    return mounts


def own_cgroups() -> list[tuple[str, str, list[str]]]:
    """This process's memory cgroup in each hierarchy mounted here: (version "v1" or "v2", the
    hierarchy's mount point, the cgroup's path below it as parts)."""
    mounts, found = _mounts(), []
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        key = "v2" if controllers == "" else ("v1" if "memory" in controllers.split(",") else "")
        if key not in mounts:
            continue
        point, root = mounts[key]
        rel = path[len(root) :] if root != "/" and path.startswith(root) else path
        found.append((key, point, [p for p in rel.split("/") if p]))
    return found


def probe() -> dict[str, object]:
    """{"meminfo": /proc/meminfo's text, "rooms": [[limit, usage, memory.stat] of each cgroup up
    to the root]}."""
    rooms = []
    for key, point, parts in own_cgroups():
        names = ("memory.max", "memory.current") if key == "v2" else ("memory.limit_in_bytes", "memory.usage_in_bytes")
        for i in range(len(parts), -1, -1):
            where = os.path.join(point, *parts[:i])
            rooms.append([_read(os.path.join(where, name)) for name in (*names, "memory.stat")])
    return {"meminfo": _read("/proc/meminfo"), "rooms": rooms}


if __name__ == "__main__":
    print(json.dumps(probe()))
