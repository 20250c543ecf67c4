"""Benchmark: a joining learner's state transfer from a sharded syncer (issue 20).

Targets: each shard's transfer at **>= 30% of raw TCP** (`TARGET_VS_TCP`), and **>= 1 GB/s in
all** from several shards (`TARGET_AGGREGATE_MBS`), raw TCP measured in the same run.

For each shard count S (`--shards 1,2,4`: S = 1 is the unsharded syncer of the same run) the
benchmark starts S real shard processes of one run (bench/loadgen_syncer.py: `python -m syncer
--shard N`, CURVE keys as `dldctl up` writes them, checkpoints off) for a model of `--model`'s
shape (bench/loadgen_core.py manifests: no model is built; default gpt2-124m, 498 MB of fp32 in
`--fragments` 8). learner-0 joins with the real `learner.syncerlink.SyncerLink` (one
`SyncerClient` per shard), uploads random initial values to every shard and leaves. Then this
process joins as learner-1 `--transfers` times, each time a fresh SyncerLink (a new incarnation):
every shard's client says hello and fetches its fragments in fp32 chunks (`state_chunk_mb`, the
`fetch_window` in flight), CRC-checked, all shards at once, each on its own thread (as the real
learner). Nothing else runs: no merges, no training. Timed from `start()` until each shard's
client is ready (`per shard`: that shard's bytes / its time) and until all are (`aggregate`:
every byte / the last one's time), and the CPU the shard processes (all of them) and this process
(the learner's side) used meanwhile, in cores (of the machine's 2).

Baselines, one of each right after every fetch (the same machine state): raw TCP over loopback
from other processes (`sendall` / `recv_into`: `_serve_tcp`, `tcp_fetch`), one stream of one shard's bytes
(`tcp 1 stream`), and S streams at once, one per shard's bytes, each from its own process into
its own thread here (`tcp S streams`: aggregate and per stream). `vs tcp` compares a shard's
transfer with a raw stream under the same concurrency (S streams), the aggregate with S raw
streams' aggregate.

    .venv/bin/python bench/shard_transfer.py --quick          # S = 1, 2, 4; 3 transfers each, ~2 min
    .venv/bin/python bench/shard_transfer.py                  # 5 transfers each
    .venv/bin/python bench/shard_transfer.py --set insecure=true   # without CURVE
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import common
from bench import loadgen_core as core
from bench.loadgen_measure import proc_cpu
from bench.loadgen_syncer import SyncerProcess, write_run
from learner.config import load as load_learner_config
from learner.link import fetch_window
from learner.syncerlink import SyncerLink
from syncer.wire import fragments, shards

TARGET_VS_TCP = 0.30  # issue 20: a shard's transfer at >= 30% of raw TCP
TARGET_AGGREGATE_MBS = 1000.0  # issue 20: >= 1 GB/s from several shards


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt2-124m", choices=sorted(core.SHAPES), help="model shape")
    parser.add_argument("--fragments", type=int, default=8, help="P (at least the most shards)")
    parser.add_argument("--shards", default="1,2,4", help="shard counts, in order")
    parser.add_argument("--transfers", type=int, default=None, help="fetches per shard count (default 5, quick 3)")
    common.add_set_option(parser, "[run] overrides, e.g. insecure=true,state_chunk_mb=1")
    parser.add_argument("--tmp", default=None, help="where the run directories go")


@dataclass
class Fetch:
    """One join: seconds until each shard's client was ready, and until all were; CPU seconds
    each shard process and this process (the learner's link threads, libzmq's) spent meanwhile."""

    per_shard: list[float]
    total: float
    shard_cpu: list[float] = field(default_factory=list)
    learner_cpu: float = 0.0


@dataclass
class Series:
    """Every fetch of one shard count and its interleaved baselines."""

    shards: int
    bytes_per_shard: list[int]
    fetches: list[Fetch] = field(default_factory=list)
    tcp_one: list[float] = field(default_factory=list)  # seconds: one stream of shard 0's bytes
    tcp_all: list[list[float]] = field(default_factory=list)  # seconds of each of S streams at once


class ShardedRun:
    """S shard processes of one run holding an uploaded model; always close() (a context manager)."""

    def __init__(self, count: int, specs: list[fragments.TensorSpec], run: dict[str, Any], tmp: str | None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="dldctl-xfer-", dir=tmp))
        self.specs = specs
        self.sizes = fragments.plan(specs, int(run["fragments"])).sizes()
        self.owned = [shards.assign(self.sizes, count).owned(s) for s in range(count)]
        self.config = write_run(self.dir, 2, run, run_id="xfer", shards=count)
        self.syncers = [SyncerProcess(self.dir, self.config, s) for s in range(count)]

    def __enter__(self) -> ShardedRun:
        for syncer in self.syncers:
            syncer.start()
        for syncer in self.syncers:
            syncer.wait_up(60.0)
        return self

    def __exit__(self, *exc: object) -> None:
        for syncer in self.syncers:
            syncer.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def link(self, learner: str) -> SyncerLink:
        """The real learner's link to every shard, as `learner` (random initial values)."""
        cfg = load_learner_config(self.config, learner, workdir=self.dir / learner)
        manifest = fragments.manifest_to_json(self.specs)
        g = torch.Generator().manual_seed(0)
        values = lambda: [torch.randn(n, generator=g) * 0.02 for n in self.sizes]  # only learner-0 uploads
        return SyncerLink(cfg, manifest, self.sizes, values, secrets.token_hex(8))

    def upload(self) -> None:
        """learner-0 uploads the initial model to every shard, then leaves."""
        link = self.link("learner-0")
        link.start()
        try:
            if not link.wait_ready(300.0):
                raise TimeoutError(f"the upload did not finish; shards not ready: {link.not_ready()}")
        finally:
            link.stop(flush_s=0.0)

    def fetch(self, timeout: float = 120.0) -> Fetch:
        """learner-1 joins (a new incarnation): seconds until each shard's state, and all, are here."""
        link = self.link("learner-1")
        done: list[float | None] = [None] * len(link.clients)
        cpu0, own0 = [proc_cpu(x.pid) for x in self.syncers], proc_cpu(os.getpid())
        t0 = time.perf_counter()
        link.start()
        try:
            while None in done:
                now = time.perf_counter() - t0
                if now > timeout:
                    raise TimeoutError(f"the state fetch did not finish in {timeout:.0f} s: {link.not_ready()}")
                for s, client in enumerate(link.clients):
                    if done[s] is None and client.ready.is_set():
                        done[s] = now
                time.sleep(0.001)
        finally:
            link.stop(flush_s=0.0)
        per_shard = [float(d) for d in done if d is not None]
        shard_cpu = [proc_cpu(x.pid) - c for x, c in zip(self.syncers, cpu0, strict=True)]
        return Fetch(per_shard, max(per_shard), shard_cpu, proc_cpu(os.getpid()) - own0)


def _serve_tcp(port_q: Any, nbytes: int, times: int) -> None:
    """Baseline server: send `nbytes` to each of `times` connections."""
    payload = bytes(nbytes)
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    for _ in range(times):
        conn, _ = srv.accept()
        conn.sendall(payload)
        conn.close()
    srv.close()


def tcp_fetch(port: int, nbytes: int) -> float:
    """Seconds to receive `nbytes` from a `_serve_tcp` on `port` (the baseline client)."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], min(nbytes - got, 1 << 22))
            if n == 0:
                break
            got += n
    return time.perf_counter() - t0


class TcpServers:
    """One raw TCP server process per shard's bytes (`_serve_tcp`): shard 0's serves
    2 x `times` connections (one stream alone, then with the others), the rest `times`."""

    def __init__(self, sizes: list[int], times: int) -> None:
        spawn = mp.get_context("spawn")
        self.sizes, self.procs, self.ports = sizes, [], []
        for s, nbytes in enumerate(sizes):
            port_q = spawn.Queue()
            proc = spawn.Process(target=_serve_tcp, args=(port_q, nbytes, times * (2 if s == 0 else 1)), daemon=True)
            proc.start()
            self.procs.append(proc)
            self.ports.append(port_q.get(timeout=60))

    def one(self) -> float:
        """Seconds of one stream of shard 0's bytes, alone."""
        return tcp_fetch(self.ports[0], self.sizes[0])

    def all(self) -> list[float]:
        """Seconds of each stream, all S at once (one thread each, as the SyncerLink's clients)."""
        out = [0.0] * len(self.sizes)

        def fetch(s: int) -> None:
            out[s] = tcp_fetch(self.ports[s], self.sizes[s])

        threads = [threading.Thread(target=fetch, args=(s,)) for s in range(len(self.sizes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def close(self) -> None:
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()


def measure(count: int, specs: list[fragments.TensorSpec], run: dict[str, Any], times: int, tmp: str | None) -> Series:
    """S shards: upload once, then `times` fetches, each followed by the raw TCP baselines."""
    with ShardedRun(count, specs, run, tmp) as sharded:
        nbytes = [4 * sum(sharded.sizes[p] for p in owned) for owned in sharded.owned]
        series = Series(count, nbytes)
        sharded.upload()
        time.sleep(1.0)
        servers = TcpServers(nbytes, times)
        try:
            for _ in range(times):
                series.fetches.append(sharded.fetch())
                time.sleep(0.5)
                series.tcp_one.append(servers.one())
                series.tcp_all.append(servers.all())
                time.sleep(0.5)
        finally:
            servers.close()
    return series


def _mbs(nbytes: float, seconds: list[float]) -> float:
    return common.mb_per_s(nbytes, statistics.median(seconds))


def _cores(cpu: list[float], fetches: list[Fetch]) -> float:
    """Median cores over the fetches: CPU seconds / the fetch's seconds."""
    return statistics.median(c / f.total for c, f in zip(cpu, fetches, strict=True))


def row(series: Series) -> dict[str, Any]:
    """Medians over the fetches: aggregate and per shard MB/s, raw TCP's, and the ratios."""
    total = sum(series.bytes_per_shard)
    count = series.shards
    per_shard = [_mbs(series.bytes_per_shard[s], [f.per_shard[s] for f in series.fetches]) for s in range(count)]
    tcp_streams = [_mbs(series.bytes_per_shard[s], [t[s] for t in series.tcp_all]) for s in range(count)]
    tcp_aggregate = common.mb_per_s(total, statistics.median(max(t) for t in series.tcp_all))
    aggregate = common.mb_per_s(total, statistics.median(f.total for f in series.fetches))
    vs_stream = [a / b for a, b in zip(per_shard, tcp_streams, strict=True)]
    return {
        "shards": count,
        "MB": total / 1e6,
        "fetch_s": statistics.median(f.total for f in series.fetches),
        "aggregate MB/s": aggregate,
        "best MB/s": common.mb_per_s(total, min(f.total for f in series.fetches)),
        "per shard MB/s": " / ".join(f"{v:.0f}" for v in per_shard),
        "tcp 1 stream MB/s": _mbs(series.bytes_per_shard[0], series.tcp_one),
        "tcp S streams MB/s": tcp_aggregate,
        "per shard vs tcp stream": min(vs_stream),
        "aggregate vs tcp S streams": aggregate / tcp_aggregate,
        "shard cores": _cores([sum(f.shard_cpu) for f in series.fetches], series.fetches),
        "learner cores": _cores([f.learner_cpu for f in series.fetches], series.fetches),
        "n": len(series.fetches),
    }


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Both targets, on the sharded rows (S >= 2): the worst shard's ratio, the best aggregate."""
    sharded = [r for r in rows if r["shards"] >= 2]
    if not sharded:
        return {}
    worst = min(r["per shard vs tcp stream"] for r in sharded)
    best = max(sharded, key=lambda r: r["aggregate MB/s"])
    return {
        "target_vs_tcp": TARGET_VS_TCP,
        "worst_shard_vs_tcp": worst,
        "vs_tcp_met": worst >= TARGET_VS_TCP,
        "target_aggregate_MBs": TARGET_AGGREGATE_MBS,
        "best_aggregate_MBs": best["aggregate MB/s"],
        "best_aggregate_shards": best["shards"],
        "aggregate_met": best["aggregate MB/s"] >= TARGET_AGGREGATE_MBS,
    }


def run_settings(model: str, fragment_count: int, extra: dict[str, Any]) -> dict[str, Any]:
    """The [run] table: checkpoints and the global model's scoring off (nothing merges here)."""
    return {
        "model": "gpt2-124m" if model not in ("gpt-tiny", "gpt-small", "gpt-medium") else model,
        "fragments": fragment_count,
        "heartbeat_s": 0.5,
        "liveness_s": 3.0,
        "global_eval_every": 0,
        "quality_guard": 0.0,
        "checkpoint_s": 0.0,
        "checkpoint_every": 1_000_000,
        **extra,
    }


def main() -> None:
    args = common.parse_args("shard_transfer", __doc__, _extra)
    torch.set_num_threads(1)
    times = args.transfers or (3 if args.quick else 5)
    specs = core.manifest(args.model)
    run = run_settings(args.model, args.fragments, common.overrides(args.set))
    chunk = int(float(run.get("state_chunk_mb", 4.0)) * (1 << 20))
    print(
        f"{args.model}: {4 * core.param_count(specs) / 1e6:.0f} MB of fp32 in {args.fragments} fragments, "
        f"{chunk / (1 << 20):g} MiB chunks x {fetch_window(chunk // 4)} in flight per shard, "
        f"{'insecure' if run.get('insecure') else 'CURVE'}; load average {os.getloadavg()[0]:.2f} "
        f"on {os.cpu_count()} CPUs",
        flush=True,
    )
    began, load = time.monotonic(), [os.getloadavg()[0]]
    all_series = []
    for count in [int(s) for s in args.shards.split(",")]:
        series = measure(count, specs, run, times, args.tmp)
        all_series.append(series)
        load.append(os.getloadavg()[0])
        print(f"  {count} shard(s): aggregate {row(series)['aggregate MB/s']:.0f} MB/s", flush=True)
    report(args, run, all_series, load, time.monotonic() - began)


def report(
    args: argparse.Namespace, run: dict[str, Any], all_series: list[Series], load: list[float], wall: float
) -> None:
    """The table, the verdict, the JSON (every fetch and baseline in seconds)."""
    rows = [row(s) for s in all_series]
    common.print_table(
        f"State transfer from syncer shards: {args.model}, {rows[0]['MB']:.0f} MB fp32, P = {args.fragments}, "
        f"{'insecure' if run.get('insecure') else 'CURVE'}, medians of {rows[0]['n']} fetches",
        rows,
    )
    v = verdict(rows)
    if v:
        print(
            f"Targets: each shard >= {TARGET_VS_TCP:.0%} of a raw TCP stream under the same concurrency: worst "
            f"{v['worst_shard_vs_tcp']:.0%} ({'MET' if v['vs_tcp_met'] else 'NOT MET'}); >= "
            f"{TARGET_AGGREGATE_MBS:,.0f} MB/s in all: {v['best_aggregate_MBs']:,.0f} MB/s with "
            f"{v['best_aggregate_shards']} shards ({'MET' if v['aggregate_met'] else 'NOT MET'})"
        )
    payload = {
        "benchmark": "shard_transfer",
        "quick": args.quick,
        "model": args.model,
        "run": run,
        "rows": rows,
        "verdict": v,
        "series": [vars(s) | {"fetches": [vars(f) for f in s.fetches]} for s in all_series],
        "load_average": load,
        "wall_s": wall,
    }
    print(f"wrote {common.shown(common.write_json(args.out, payload))}")


if __name__ == "__main__":
    main()
