"""Benchmark: the syncer's memory per parameter, against what its rounds must hold.

A round must hold, per parameter, three fp32 vectors (the global parameters, the Nesterov
momentum and the error-feedback residual: 12 bytes) and the pending contributions' codes as they
came on the wire (int4: half a byte a value plus one fp32 scale per block, about 0.53 bytes per
contribution). This measures what a syncer process really holds: each model runs in a fresh
process that drives the real `SyncerCore` (the native kernel, default settings: int4 + zstd,
4 fragments, 4 learners, as bench/syncer_throughput.py) and reads its resident set size
(/proc/self/status) at four points:

- `empty`: everything imported, the kernel loaded, no model (the baseline subtracted below);
- `steady`: the model uploaded and 3 rounds of every fragment merged (the three vectors written
  through), no contribution pending;
- `pending`: 4 contributions waiting in every fragment's round (the most a round holds here);
- `peak`: the high-water mark while those rounds close (reset just before), the round's own
  temporaries included (the update payload, its zstd frame, the blob).

Per parameter: (RSS - empty) / parameters, against `expected` = 12 + the pending codes' bytes /
parameters (0 when nothing is pending). `over` = measured / expected - 1 (the target: at most 20%).
The learners' side runs in the parent process: it writes the 4 learners' blobs of every fragment
to files, and the syncer's process reads each afresh for its push (as a frame off a socket).

    .venv/bin/python bench/syncer_memory.py [--quick] [--out PATH] [--models a,b]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common

STATE_BYTES = 12  # theta, momentum, residual: fp32 each


def rss() -> dict[str, int]:
    """Resident set size and its high-water mark, in bytes (Linux)."""
    fields = {}
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def reset_peak() -> bool:
    """Start a new high-water mark (Linux >= 4.0: "5" > /proc/self/clear_refs); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def child(model: str, zstd: bool, blobs_dir: Path) -> dict[str, Any]:
    """In a fresh process: the readings of one model (see the module docstring). The pushes'
    blobs come from files the parent wrote, read afresh for every push (as frames off a socket)."""
    from bench import syncer_throughput as st
    from syncer.common.settings import RunSettings
    from syncer.globalmodel import Outbox

    torch.set_num_threads(1)
    kwargs: dict[str, Any] = {} if zstd else {"zstd": False}  # the key is new: the code before has no zstd
    settings = RunSettings(model=model, fragments=4, H=64, round_clock="learner", **kwargs)
    warm_up(zstd)
    gc.collect()
    empty = rss()["VmRSS"]
    core = init_core(model, settings)
    count = len(st.global_model(core).theta)
    pusher = Pusher(core, blobs_dir)
    for _ in range(3):
        for p in range(count):
            pusher.round(p)
            core.tick(pusher.now, Outbox())
    gc.collect()
    steady = rss()["VmRSS"]
    for p in range(count):
        pusher.round(p)
    gc.collect()
    pending = rss()["VmRSS"]
    held = sum(_codes_nbytes(c.delta) for r in core.rounds.values() for c in r.contributions.values())
    peak_ok = reset_peak()
    core.tick(pusher.now, Outbox())
    peak = rss()["VmHWM"] if peak_ok else 0
    params = st.global_model(core).numel
    return {"params": params, "empty": empty, "steady": steady, "pending": pending, "peak": peak, "held": held}


def warm_up(zstd: bool) -> None:
    """A gpt-tiny syncer through its first rounds and gone: what the first use of torch, the
    kernel and zstd leaves resident belongs to the empty process, not to the model."""
    from bench import syncer_throughput as st
    from syncer.common.settings import RunSettings
    from syncer.globalmodel import Outbox

    kwargs: dict[str, Any] = {} if zstd else {"zstd": False}
    settings = RunSettings(model="gpt-tiny", fragments=4, H=64, round_clock="learner", **kwargs)
    core = init_core("gpt-tiny", settings)
    blobs = st.make_blobs(core, settings)
    pusher = Pusher(core, None)
    for p, row in enumerate(blobs):
        pusher.round(p, row)
        core.tick(pusher.now, Outbox())


def init_core(model: str, settings: Any) -> Any:
    """A core with 4 learners joined and the model uploaded chunk by chunk (as learner-0 does)."""
    from bench import syncer_throughput as st
    from syncer.core import SyncerCore
    from syncer.globalmodel import Outbox
    from syncer.wire import fragments
    from syncer.wire.protocol import Message

    core = SyncerCore(settings, "bench", list(st.LEARNERS), now=0.0, kernel=st.KERNEL)
    specs = manifest(model)
    for lid in st.LEARNERS:
        hello = {"learner": lid, "incarnation": "i1", "run": "bench", "pid": 1, "host": "local", "device": "cpu"}
        hello |= {"batch_size": 16, "codecs": ["int4"], "manifest": fragments.manifest_to_json(specs)}
        core.handle(lid, Message("hello", {**hello, "fragments": settings.fragments}), 0.5, Outbox())
    chunk, g = core.chunk_numel(), torch.Generator().manual_seed(0)
    for p, n in enumerate(fragments.plan(specs, settings.fragments).sizes()):
        for off in range(0, n, chunk):
            part = (torch.randn(min(chunk, n - off), generator=g) * 0.02).numpy().tobytes()
            meta = {"fragment": p, "offset": off, "numel": len(part) // 4, "total": n}
            core.handle(st.LEARNERS[0], Message("init", meta, [part]), 0.5, Outbox())
    for lid in st.LEARNERS:
        core.handle(lid, Message("heartbeat", {"step": 1, "tokens": 16, "state": "running"}), 0.5, Outbox())
    return core


def write_blobs(model: str, zstd: bool, directory: Path) -> None:
    """The 4 learners' blobs of every fragment, as bench/syncer_throughput.py makes them, to files."""
    from bench import syncer_throughput as st
    from syncer.common.settings import RunSettings
    from syncer.wire import codec, fragments

    kwargs: dict[str, Any] = {} if zstd else {"zstd": False}
    settings = RunSettings(model=model, fragments=4, H=64, round_clock="learner", **kwargs)
    for p, n in enumerate(fragments.plan(manifest(model), settings.fragments).sizes()):
        shared = torch.randn(n, generator=torch.Generator().manual_seed(1000 + p)) * 3e-4
        for m in range(len(st.LEARNERS)):
            delta = st.outer_gradient(n, 10 * p + m, shared)
            blob = codec.encode(delta, settings.compression, settings.block, **kwargs)
            (directory / f"{p}-{m}.blob").write_bytes(blob)


def manifest(model: str) -> list[Any]:
    """The manifest a learner of `model` sends (from the preset table: no torch model is built)."""
    from bench import syncer_throughput as st
    from syncer.wire import fragments
    from workload.presets import param_shapes

    return [fragments.TensorSpec(n, s, "embedding" if n in st.EMBEDDINGS else "dense") for n, s in param_shapes(model)]


def _codes_nbytes(q: Any) -> int:
    """A contribution's codes and scales at their wire size (int4: two codes a byte), whatever
    representation the syncer holds them in."""
    from syncer.wire import codec

    return int(codec.raw_length(q.mode, q.numel, q.block))


class Pusher:
    """The 4 learners' pushes of one fragment, each blob read from its file just before."""

    def __init__(self, core: Any, blobs_dir: Path | None) -> None:
        self.core, self.dir = core, blobs_dir
        self.now, self.seq = 1.0, 0

    def round(self, p: int, blobs: list[bytes] | None = None) -> None:
        """Learner m pushes `blobs[m]`, or the file {p}-{m}.blob."""
        from bench import syncer_throughput as st
        from syncer.globalmodel import Outbox
        from syncer.wire.protocol import Message

        version = st.global_model(self.core).versions[p]
        self.now += 1e-3
        self.seq += 1
        for m, lid in enumerate(st.LEARNERS):
            meta = {"fragment": p, "base_version": version, "seq": self.seq, "epoch": self.core.epoch}
            meta |= {"c_steps": 64, "c_tokens": 64 * 2048, "c_time": 6.4, "step_time": 0.1}
            blob = blobs[m] if blobs is not None else (self.dir or Path()).joinpath(f"{p}-{m}.blob").read_bytes()
            self.core.handle(lid, Message("push", meta, [blob]), self.now, Outbox())


def row(model: str, zstd: bool, r: dict[str, Any]) -> dict[str, Any]:
    """Bytes per parameter at each reading, against what the round must hold."""
    n = r["params"]
    steady, pending = (r["steady"] - r["empty"]) / n, (r["pending"] - r["empty"]) / n
    expected_pending = STATE_BYTES + r["held"] / n
    out = {
        "model": model,
        "zstd": zstd,
        "params_M": n / 1e6,
        "empty_MB": r["empty"] / 1e6,
        "steady_B/param": steady,
        "steady_over": steady / STATE_BYTES - 1,
        "pending_codes_B/param": r["held"] / n,
        "pending_B/param": pending,
        "pending_expected_B/param": expected_pending,
        "pending_over": pending / expected_pending - 1,
        "peak_B/param": (r["peak"] - r["empty"]) / n if r["peak"] else None,
        "raw": r,
    }
    out["peak_over"] = out["peak_B/param"] / expected_pending - 1 if r["peak"] else None
    return out


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="gpt-medium,gpt2-124m", help="comma-separated model presets")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--no-zstd", action="store_true", help="payloads without zstd ([run] zstd = false)")


def main() -> None:
    args = common.parse_args("syncer_memory", __doc__, _extra)
    zstd = not args.no_zstd
    if args.child:
        model, blobs_dir = args.child.split(",", 1)
        print(json.dumps(child(model, zstd, Path(blobs_dir))))
        return
    models = args.models.split(",")[:1] if args.quick else args.models.split(",")
    rows = []
    for model in models:
        with tempfile.TemporaryDirectory() as tmp:
            write_blobs(model, zstd, Path(tmp))
            cmd = [sys.executable, __file__, "--child", f"{model},{tmp}"] + ([] if zstd else ["--no-zstd"])
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
        rows.append(row(model, zstd, json.loads(proc.stdout.strip().splitlines()[-1])))
    columns = [
        "model",
        "zstd",
        "params_M",
        "empty_MB",
        "steady_B/param",
        "steady_over",
        "pending_codes_B/param",
        "pending_B/param",
        "pending_expected_B/param",
        "pending_over",
        "peak_B/param",
        "peak_over",
    ]
    common.print_table(
        "Syncer memory per parameter (RSS minus the empty process; 4 fragments, 4 learners)", rows, columns
    )
    print("expected: 12 B/param (theta, momentum, residual) + the pending contributions' codes; target: over <= 20%")
    common.write_json(args.out, {"benchmark": "syncer_memory", "quick": args.quick, "zstd": zstd, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
