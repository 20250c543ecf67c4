"""Benchmark: rejoin after kill -9, and state-transfer throughput (issue 9, item 6).

**Rejoin.** A fleet of 4 local learners (gpt-tiny, seq 32, batch 8, H = 32, quorum 1,
`restart_delay_s = 0.5`) is killed K times, twice in the same run: restarts as fresh processes
(`warm_spares = false`, the baseline) and restarts by a warm spare (the default; each kill waits
until a spare is ready). It is killed (`dldctl chaos kill learner-<i> --signal KILL`,
learners in turn, one kill every `--gap` seconds). For each kill, from the run's own records:

    fault_inject (chaos)   ->  restart (supervisor: new process)      "restart delay": detection + delay
    restart                ->  rejoin (syncer: hello, new incarnation) "process start": python, torch, workload
                                                                       (a warm spare: only the workload)
    rejoin                 ->  first `round` in metrics.jsonl listing   "join until contributing": state fetch,
                               the learner as a contributor             H/P inner steps, push, merge

The total (kill to contributing again) and each part are reported as median, min and max over the
kills.

**State transfer** (issue 20). A fleet of 2 gpt-medium learners (10.8 M parameters, 43 MB of
fp32) comes up; learner-1 is removed (`dldctl learner remove`) and this process then joins *as
learner-1*, with a real `learner.client.SyncerClient` (its config and CURVE keys from the run
directory), several times: each time a new incarnation says hello and fetches every fragment in fp32
chunks (`state_chunk_mb`, default 4 MiB; `learner.link.fetch_window` requests in flight),
CRC-checked, while learner-0 keeps training. Timed from `client.start()` to `client.ready`
(connect, CURVE handshake, hello, every chunk). Twice: a CURVE fleet (as every run) and an insecure
one (`insecure = true`), which splits out what CURVE costs. Baselines in the same fleets, one of
each right after every fetch (the same load): the same bytes over loopback from other processes,
plain TCP (`sendall` / `recv_into`), ZeroMQ DEALER/ROUTER with the client's chunks and window,
and the same with CURVE. Target: the CURVE fetch at >= 30% of raw TCP (`TARGET_VS_TCP`).

    .venv/bin/python bench/rejoin.py                    # full: 2 x 8 kills, 10 transfers, ~5 min on 2 cores
    .venv/bin/python bench/rejoin.py --quick            # 2 x 4 kills, 5 transfers, ~3 min
    .venv/bin/python bench/rejoin.py --transfer-only    # only the state transfer (~1.5 min), --chunk-mb MB
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.fleet import BenchRun, diloco_run, local_host

LEARNERS = 4
TARGET_VS_TCP = 0.30  # issue 20: a fetch at >= 30% of raw TCP per syncer shard


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kills", type=int, default=None, help="default 8, quick 4")
    parser.add_argument("--gap", type=float, default=8.0, help="seconds between kills")
    parser.add_argument("--transfers", type=int, default=None, help="state fetches to time (default 5, quick 3)")
    parser.add_argument("--transfer-only", action="store_true", help="only the state-transfer part (no kills)")
    parser.add_argument("--chunk-mb", type=float, default=None, help="state_chunk_mb of the transfer fleets")


# --------------------------------------------------------------------------- rejoin after kill -9


def kill_phases(
    events: list[dict[str, Any]], rounds: list[dict[str, Any]], kill_t: float, target: str
) -> dict[str, Any]:
    """Times from one kill to each later stage of its learner's comeback (None when not seen)."""

    def first(kind: str, after: float) -> float | None:
        return next((e["t"] for e in events if e["kind"] == kind and e["target"] == target and e["t"] >= after), None)

    restart = first("restart", kill_t)
    rejoin = first("rejoin", restart) if restart else None
    contrib = next((r["t"] for r in rounds if rejoin and r["t"] >= rejoin and target in r["contributors"]), None)
    gap = lambda a, b: b - a if a is not None and b is not None else None
    return {
        "target": target,
        "kill_t": kill_t,
        "restart_delay_s": gap(kill_t, restart),
        "process_start_s": gap(restart, rejoin),
        "join_to_contributing_s": gap(rejoin, contrib),
        "total_s": gap(kill_t, contrib),
    }


def spares_ready(fleet: BenchRun) -> int:
    """How many warm spares of host `here` have said they are ready so far."""
    log = fleet.run_dir / "logs" / "spare-here.log" if fleet.run_dir else None
    return log.read_text().count("ready; waiting") if log is not None and log.exists() else 0


def measure_rejoins(kills: int, gap: float, warm: bool) -> list[dict[str, Any]]:
    """Kill learners in turn on a running fleet, then read each comeback from events and rounds.

    With `warm`, each kill waits (up to 60 s) for a warm spare to be ready, so every restart is a
    hand-over; without, every restart is a fresh process (warm_spares = false)."""
    with BenchRun("rejoin-warm" if warm else "rejoin-fresh") as fleet:
        fleet.up(diloco_run(32, warm_spares=warm), [local_host("here", LEARNERS)])
        fleet.wait_training(LEARNERS)
        time.sleep(3.0)
        for i in range(kills):
            target = f"learner-{i % LEARNERS}"
            if warm:
                fleet.wait_for(lambda: spares_ready(fleet) > i, 60, "a warm spare", every=0.25)  # noqa: B023 (called now)
            fleet.wait_for(lambda: fleet.kill(target), 60, f"{target} to be killable", every=0.5)  # noqa: B023
            time.sleep(gap)
        time.sleep(max(0.0, 12.0 - gap))
        events, rounds = fleet.events(), fleet.rounds()
        fleet.down()
    injects = [e for e in events if e["kind"] == "fault_inject"]
    return [kill_phases(events, rounds, e["t"], e["target"]) for e in injects]


def summarize(phases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for key, label in (
        ("restart_delay_s", "kill -> restart (delay 0.5 s)"),
        ("process_start_s", "restart -> rejoin"),
        ("join_to_contributing_s", "rejoin -> contributing"),
        ("total_s", "kill -> contributing"),
    ):
        values = [p[key] for p in phases if p[key] is not None]
        rows.append(
            {
                "stage": label,
                "median_s": statistics.median(values) if values else float("nan"),
                "min_s": min(values, default=float("nan")),
                "max_s": max(values, default=float("nan")),
                "n": len(values),
            }
        )
    return rows


# --------------------------------------------------------------------------- state transfer


def fetch_state(run_dir: Path, settings: dict[str, Any], times: int, between: Callable[[], None]) -> dict[str, Any]:
    """Join as learner-1 with a real SyncerClient `times` times; seconds and bytes per fetch.
    `between` runs after each fetch (the baselines, interleaved: the same load for both)."""
    from bench.evaluate import workload
    from learner.client import SyncerClient
    from learner.config import load
    from syncer.wire import fragments

    wl = workload(settings)
    params = dict(wl.model.named_parameters())
    manifest = [
        fragments.TensorSpec(n, tuple(t.shape), "embedding" if n in wl.embedding_names else "dense")
        for n, t in params.items()
    ]
    plan = fragments.plan(manifest, int(settings["fragments"]))
    seconds = []
    for _ in range(times):
        cfg = load(run_dir / "config.json", "learner-1", workdir=run_dir / "bench-client")
        client = SyncerClient(
            cfg,
            fragments.manifest_to_json(manifest),
            plan.sizes(),
            lambda: [plan.gather(p, {n: t.data for n, t in params.items()}) for p in range(plan.count)],
            secrets.token_hex(8),
        )
        t0 = time.perf_counter()
        client.start()
        if not client.ready.wait(120):
            client.stop(flush_s=0.0)
            raise TimeoutError("state fetch did not complete in 120 s")
        seconds.append(time.perf_counter() - t0)
        client.stop(flush_s=0.0)
        time.sleep(1.0)
        between()
    return {"bytes": 4 * sum(plan.sizes()), "params": sum(plan.sizes()), "seconds": seconds}


def state_bytes(model: str = "gpt-medium") -> int:
    from bench.evaluate import workload
    from bench.fleet import WORKLOAD

    return 4 * sum(t.numel() for t in workload({**WORKLOAD, "model": model}).model.parameters())


def measure_transfer(times: int, chunk_mb: float | None, insecure: bool = False) -> dict[str, Any]:
    """A gpt-medium fleet of 2; learner-1 removed; this process fetches the state as learner-1,
    each fetch followed by one of each baseline (`Baselines`), so both see the same load."""
    run = diloco_run(32, model="gpt-medium", eval_every=100000, insecure=insecure)
    if chunk_mb is not None:
        run["state_chunk_mb"] = chunk_mb
    with BenchRun("xfer-insecure" if insecure else "xfer") as fleet, Baselines(state_bytes(), times, chunk_mb) as base:
        run_dir = fleet.up(run, [local_host("here", 2)])
        fleet.wait_for(lambda: fleet.events("initialized"), 240, "the global model to exist")
        fleet.dl("learner", "remove", "learner-1")
        fleet.wait_for(lambda: fleet.events("leave"), 60, "learner-1 to leave")
        result = fetch_state(run_dir, run, times, base.fetch_each)
        result["baselines"] = base.seconds
        fleet.down()
    return result


def client_window(chunk_mb: float | None) -> tuple[int, int]:
    """(chunk bytes, chunks in flight) of a SyncerClient fetch (`state_chunk_mb`: the run's default)."""
    from learner.link import fetch_window
    from syncer.common.settings import RunSettings

    chunk = int((RunSettings().state_chunk_mb if chunk_mb is None else chunk_mb) * (1 << 20))
    return chunk, fetch_window(chunk // 4)


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


def _serve_zmq(port_q: Any, nbytes: int, times: int, chunk: int, curve: tuple[bytes, bytes] | None) -> None:
    """Baseline server: a ROUTER answering each chunk request with that chunk of the state (no
    copy, as the syncer), CURVE-encrypted when given the server's key pair."""
    import zmq

    payload = memoryview(bytes(nbytes))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if curve is not None:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = curve
    port_q.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    served = 0
    while served < times * ((nbytes + chunk - 1) // chunk):
        rid, offset = sock.recv_multipart()
        off = int(offset)
        sock.send_multipart([rid, offset, payload[off : off + chunk]], copy=False)
        served += 1
    sock.close(linger=1000)
    ctx.term()


def tcp_fetch(port: int, nbytes: int) -> float:
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


def zmq_fetch(port: int, nbytes: int, chunk: int, window: int, curve: tuple[bytes, bytes, bytes] | None) -> float:
    """One fetch of `nbytes` in chunks, the client's window in flight; timed from connect (and
    CURVE's handshake) to the last byte copied into place, as a SyncerClient join is."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    t0 = time.perf_counter()
    sock.connect(f"tcp://127.0.0.1:{port}")
    offsets = list(range(0, nbytes, chunk))
    buf = bytearray(nbytes)
    inflight = 0
    while offsets or inflight:
        while offsets and inflight < window:
            sock.send(str(offsets.pop(0)).encode())
            inflight += 1
        off, data = sock.recv_multipart(copy=False)
        start = int(off.bytes)
        buf[start : start + len(data)] = data.buffer
        inflight -= 1
    elapsed = time.perf_counter() - t0
    sock.close(linger=0)
    ctx.term()
    return elapsed


class Baselines:
    """Servers in their own processes for the same bytes over loopback: plain TCP, ZeroMQ with the
    client's chunks and window, the same with CURVE. `fetch_each()` times one fetch of each."""

    KINDS = ("tcp", "zmq", "zmq-curve")

    def __init__(self, nbytes: int, times: int, chunk_mb: float | None) -> None:
        import zmq

        self.nbytes, self.times = nbytes, times
        self.chunk, self.window = client_window(chunk_mb)
        self.server_keys, self.client_keys = zmq.curve_keypair(), zmq.curve_keypair()
        self.seconds: dict[str, list[float]] = {kind: [] for kind in self.KINDS}
        self.procs: list[Any] = []
        self.ports: dict[str, int] = {}

    def __enter__(self) -> Baselines:
        spawn = mp.get_context("spawn")
        for kind in self.KINDS:
            port_q = spawn.Queue()
            args: tuple[Any, ...] = (port_q, self.nbytes, self.times)
            if kind != "tcp":
                args += (self.chunk, self.server_keys if kind == "zmq-curve" else None)
            proc = spawn.Process(target=_serve_tcp if kind == "tcp" else _serve_zmq, args=args, daemon=True)
            proc.start()
            self.procs.append(proc)
            self.ports[kind] = port_q.get(timeout=60)
        return self

    def fetch_each(self) -> None:
        self.seconds["tcp"].append(tcp_fetch(self.ports["tcp"], self.nbytes))
        self.seconds["zmq"].append(zmq_fetch(self.ports["zmq"], self.nbytes, self.chunk, self.window, None))
        keys = (self.server_keys[0], *self.client_keys)
        self.seconds["zmq-curve"].append(zmq_fetch(self.ports["zmq-curve"], self.nbytes, self.chunk, self.window, keys))

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.join(timeout=5 if exc[0] is None else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()


def transfer_rows(curve: dict[str, Any], insecure: dict[str, Any], chunk_mb: float | None) -> list[dict[str, Any]]:
    """One row per transfer: MB/s and the ratio to raw TCP in the same fleet (interleaved), of the
    medians and of the best of each (on a shared machine the best is the least disturbed)."""
    nbytes = curve["bytes"]
    chunk, window = client_window(chunk_mb)
    zmq_name = f"raw ZeroMQ, {chunk / (1 << 20):g} MiB chunks x{window}"
    fleets = {"CURVE": curve, "insecure": insecure}
    series = [
        ("SyncerClient full state (CURVE, CRC)", "CURVE", curve["seconds"]),
        ("SyncerClient full state (insecure, CRC)", "insecure", insecure["seconds"]),
    ]
    for label, fleet in fleets.items():
        b = fleet["baselines"]
        series += [
            ("raw TCP", label, b["tcp"]),
            (zmq_name, label, b["zmq"]),
            (f"{zmq_name}, CURVE", label, b["zmq-curve"]),
        ]
    rows = []
    for name, label, secs in series:
        tcp = fleets[label]["baselines"]["tcp"]
        rows.append(
            {
                "transfer": name,
                "fleet": label,
                "median_s": statistics.median(secs),
                "MB/s (median)": common.mb_per_s(nbytes, statistics.median(secs)),
                "MB/s (best)": common.mb_per_s(nbytes, min(secs)),
                "vs raw TCP": statistics.median(tcp) / statistics.median(secs),
                "vs raw TCP (best)": min(tcp) / min(secs),
                "n": len(secs),
            }
        )
    return rows


def curve_share(curve_s: list[float], plain_s: list[float]) -> float:
    """The part of a CURVE transfer's time that encryption adds: 1 - t(insecure) / t(CURVE)."""
    return 1.0 - statistics.median(plain_s) / statistics.median(curve_s)


def transfer_verdict(rows: list[dict[str, Any]], curve: dict[str, Any], insecure: dict[str, Any]) -> dict[str, Any]:
    """The target: the CURVE fetch (what a run does) at >= TARGET_VS_TCP of raw TCP, same fleet."""
    b = curve["baselines"]
    return {
        "target_vs_tcp": TARGET_VS_TCP,
        "vs_tcp": rows[0]["vs raw TCP"],
        "insecure_vs_tcp": rows[1]["vs raw TCP"],
        "met": rows[0]["vs raw TCP"] >= TARGET_VS_TCP,
        "vs_tcp_best": rows[0]["vs raw TCP (best)"],
        "curve_share_client": curve_share(curve["seconds"], insecure["seconds"]),
        "curve_share_raw_zmq": curve_share(b["zmq-curve"], b["zmq"]),
        "client_vs_raw_zmq_curve": statistics.median(b["zmq-curve"]) / statistics.median(curve["seconds"]),
    }


def print_verdict(v: dict[str, Any]) -> None:
    print(
        f"Target: a fetch at >= {v['target_vs_tcp']:.0%} of raw TCP (medians). With CURVE: {v['vs_tcp']:.0%} "
        f"({'MET' if v['met'] else 'NOT MET'}; best against best {v['vs_tcp_best']:.0%}; insecure: "
        f"{v['insecure_vs_tcp']:.0%}). CURVE's share of the "
        f"time: {v['curve_share_client']:.0%} of a SyncerClient fetch, {v['curve_share_raw_zmq']:.0%} of a raw "
        f"ZeroMQ one; the SyncerClient runs at {v['client_vs_raw_zmq_curve']:.0%} of raw ZeroMQ with CURVE."
    )


def run_transfer(times: int, chunk_mb: float | None) -> dict[str, Any]:
    """Both fleets (CURVE, insecure), each with its interleaved baselines; the table, the verdict."""
    load = [os.getloadavg()[0]]  # the machine's load (others' work shows here), 1-min average
    curve = measure_transfer(times, chunk_mb)
    load.append(os.getloadavg()[0])
    insecure = measure_transfer(times, chunk_mb, insecure=True)
    load.append(os.getloadavg()[0])
    rows = transfer_rows(curve, insecure, chunk_mb)
    chunk, window = client_window(chunk_mb)
    common.print_table(
        f"State transfer: gpt-medium, {curve['params']:,} params, {curve['bytes'] / 1e6:.1f} MB fp32, "
        f"{chunk / (1 << 20):g} MiB chunks, {window} in flight",
        rows,
    )
    verdict = transfer_verdict(rows, curve, insecure)
    verdict["loadavg_1min"] = load
    print_verdict(verdict)
    return {"transfer": curve, "transfer_insecure": insecure, "transfer_rows": rows, "verdict": verdict}


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("rejoin", __doc__, _extra, argv)
    kills = args.kills or (4 if args.quick else 8)
    times = args.transfers or (5 if args.quick else 10)
    result: dict[str, Any] = {"benchmark": "rejoin", "quick": args.quick}
    if not args.transfer_only:
        phases = {
            "fresh process": measure_rejoins(kills, args.gap, warm=False),
            "warm spare": measure_rejoins(kills, args.gap, warm=True),
        }
        stages = {how: summarize(p) for how, p in phases.items()}
        for how, rows in stages.items():
            common.print_table(
                f"Rejoin after kill -9, {how}: {len(phases[how])} kills, 4 gpt-tiny learners, H=32, "
                "restart delay 0.5 s",
                rows,
            )
        result.update(kills=phases, stages=stages)
    result.update(run_transfer(times, args.chunk_mb))
    common.write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
