"""What bench/loadgen_fleet.py reads of a process through /proc, and how it sums the shards of a
sharded syncer into one: no sockets, no processes of its own.

- `proc_cpu`: user + system seconds of a process so far (every thread), `thread_cpu`: the same
  per kind of thread: `loop` (the main thread: the syncer's event loop, merges included),
  `zmq` (libzmq's I/O threads: CURVE and the TCP copies), `other` (the checkpoint writer and
  any other Python or torch thread). A thread that ended takes its time out of its kind's sum
  (the process total keeps it).
- `proc_memory`: VmRSS and VmHWM.
- `machine_busy`: CPU seconds the whole machine spent busy so far (/proc/stat, every core and
  process): over a window, minus what the benchmark's own processes used, what others took.
- `counter_delta`: what a syncer's status counters say happened between two snapshots.
- `combine`: the syncer numbers of several shards as one (cores and memory summed, memory
  sampled at the same times, checkpoints pooled).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def _stat_cpu(text: str) -> float:
    """utime + stime, in seconds, of a /proc stat line."""
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state is fields[0]
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process so far; 0 if it is gone."""
    try:
        return _stat_cpu(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return 0.0


def thread_kind(pid: int, tid: int, comm: str) -> str:
    """`loop` for the main thread, `zmq` for libzmq's background threads, else `other`."""
    if tid == pid:
        return "loop"
    return "zmq" if comm.startswith("ZMQbg") else "other"


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process's threads, summed per `thread_kind` (empty if it is gone)."""
    out = {"loop": 0.0, "zmq": 0.0, "other": 0.0}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # ended meanwhile
        comm = text[text.index("(") + 1 : text.rindex(")")]
        out[thread_kind(pid, int(tid), comm)] += _stat_cpu(text)
    return out


def thread_delta(before: dict[str, float], after: dict[str, float], span: float) -> dict[str, float]:
    """Cores each kind of thread used over `span` seconds."""
    return {k: max(0.0, after.get(k, 0.0) - before.get(k, 0.0)) / span for k in after}


def machine_busy() -> float:
    """Busy CPU seconds of the whole machine so far (every core: user, nice, system, irq,
    softirq, steal), from /proc/stat; 0 where it cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = fh.readline().split()
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICK


def proc_memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, in MB (empty if it is gone)."""
    out: dict[str, float] = {}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the syncer counted during the window: dropped sends and pushes, rejections, disconnects."""
    if not before or not after:
        return {"unknown": "the syncer did not answer a status request in time"}
    b, a = before["syncer"], after["syncer"]
    out: dict[str, Any] = {k: a.get(k, 0) - b.get(k, 0) for k in ("dropped_sends", "dropped_pushes", "disconnects")}
    out["rejected"] = sum(a.get("rejected", {}).values()) - sum(b.get("rejected", {}).values())
    out["live"] = after["quorum"]["live"]
    out["open_rounds"] = after["quorum"]["open_rounds"]
    return out


def combine(
    parts: Sequence[dict[str, Any]], rss: Sequence[Sequence[float]], rounds: int, span: float
) -> dict[str, Any]:
    """The syncer numbers of all shards as one: cores, memory and counters summed (RSS: the
    largest sum of samples taken at the same time), checkpoints pooled (`share`: the mean
    share of its window a shard's checkpoints took)."""
    cpu = sum(p["cpu_cores"] for p in parts)
    counters = [p["counters"] for p in parts]
    known = all("unknown" not in c for c in counters)
    return {
        "cpu_cores": cpu,
        "threads": {k: sum(p["threads"].get(k, 0.0) for p in parts) for k in ("loop", "zmq", "other")},
        "cpu_s_per_round": cpu * span / rounds if rounds else None,
        "rss_mb_max": max(sum(sample) for sample in rss),
        "rss_mb_end": sum(rss[-1]),
        "hwm_mb": sum(p["hwm_mb"] for p in parts),
        "counters": {k: sum(c[k] for c in counters) for k in counters[0]} if known else counters,
        "checkpoints": {
            "count": sum(p["checkpoints"]["count"] for p in parts),
            "seconds": [s for p in parts for s in p["checkpoints"]["seconds"]],
            "share": sum(p["checkpoints"]["share"] for p in parts) / len(parts),
        },
    }
