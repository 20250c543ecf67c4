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

**State transfer.** A fleet of 2 gpt-medium learners (10.8 M parameters, 43 MB of fp32) comes up;
learner-1 is removed (`dldctl learner remove`) and this process then joins *as learner-1*, with a
real `learner.client.SyncerClient` (its config and CURVE keys from the run directory), several
times: each time a new incarnation says hello and fetches every fragment in fp32 chunks
(`state_chunk_mb` = 4, 4 requests in flight), CRC-checked, while learner-0 keeps training. Timed
from `client.start()` to `client.ready` (connect, CURVE handshake, hello, every chunk). Baselines in
the same run, the same bytes over loopback from another process: plain TCP (`sendall` /
`recv_into`), and ZeroMQ DEALER/ROUTER with the same 4 MiB chunks and 4 in flight, no encryption.

    .venv/bin/python bench/rejoin.py            # full: 2 x 8 kills, 5 transfers, ~5 min on 2 cores
    .venv/bin/python bench/rejoin.py --quick    # 2 x 4 kills, 3 transfers, ~2.5 min
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import secrets
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.fleet import BenchRun, diloco_run, local_host

LEARNERS = 4
CHUNK = 4 << 20
WINDOW = 4


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kills", type=int, default=None, help="default 8, quick 4")
    parser.add_argument("--gap", type=float, default=8.0, help="seconds between kills")
    parser.add_argument("--transfers", type=int, default=None, help="state fetches to time (default 5, quick 3)")


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


def fetch_state(run_dir: Path, settings: dict[str, Any], times: int) -> dict[str, Any]:
    """Join as learner-1 with a real SyncerClient `times` times; seconds and bytes per fetch."""
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
    nbytes = 4 * sum(plan.sizes())
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
    return {"bytes": nbytes, "params": nbytes // 4, "seconds": seconds}


def measure_transfer(times: int) -> dict[str, Any]:
    """A gpt-medium fleet of 2; learner-1 removed; this process fetches the state as learner-1."""
    run = diloco_run(32, model="gpt-medium", eval_every=100000)
    with BenchRun("xfer") as fleet:
        run_dir = fleet.up(run, [local_host("here", 2)])
        fleet.wait_for(lambda: fleet.events("initialized"), 240, "the global model to exist")
        fleet.dl("learner", "remove", "learner-1")
        fleet.wait_for(lambda: fleet.events("leave"), 60, "learner-1 to leave")
        result = fetch_state(run_dir, run, times)
        fleet.down()
    return result


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


def _serve_zmq(port_q: Any, nbytes: int, times: int) -> None:
    """Baseline server: a ROUTER answering each chunk request with CHUNK bytes of the state."""
    import zmq

    payload = bytes(nbytes)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port_q.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    served = 0
    while served < times * ((nbytes + CHUNK - 1) // CHUNK):
        rid, offset = sock.recv_multipart()
        off = int(offset)
        sock.send_multipart([rid, offset, payload[off : off + CHUNK]], copy=False)
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


def zmq_fetch(port: int, nbytes: int) -> float:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    t0 = time.perf_counter()
    sock.connect(f"tcp://127.0.0.1:{port}")
    offsets = list(range(0, nbytes, CHUNK))
    buf = bytearray(nbytes)
    inflight = 0
    while offsets or inflight:
        while offsets and inflight < WINDOW:
            sock.send(str(offsets.pop(0)).encode())
            inflight += 1
        off, data = sock.recv_multipart()
        buf[int(off) : int(off) + len(data)] = data
        inflight -= 1
    elapsed = time.perf_counter() - t0
    sock.close(linger=0)
    ctx.term()
    return elapsed


def baseline(kind: str, nbytes: int, times: int) -> list[float]:
    """Seconds per transfer of `nbytes` from a server process over loopback."""
    spawn = mp.get_context("spawn")
    port_q = spawn.Queue()
    server = spawn.Process(
        target=_serve_tcp if kind == "tcp" else _serve_zmq, args=(port_q, nbytes, times), daemon=True
    )
    server.start()
    try:
        port = port_q.get(timeout=60)
        return [(tcp_fetch if kind == "tcp" else zmq_fetch)(port, nbytes) for _ in range(times)]
    finally:
        server.join(timeout=30)
        if server.is_alive():
            server.kill()
            server.join()


def transfer_rows(xfer: dict[str, Any], tcp: list[float], zmq_s: list[float]) -> list[dict[str, Any]]:
    nbytes = xfer["bytes"]
    rows = []
    for name, secs in (
        ("SyncerClient full state (CURVE, CRC)", xfer["seconds"]),
        ("raw TCP, loopback", tcp),
        ("raw ZeroMQ, 4 MiB chunks x4", zmq_s),
    ):
        rows.append(
            {
                "transfer": name,
                "MB": nbytes / 1e6,
                "median_s": statistics.median(secs),
                "MB/s (median)": common.mb_per_s(nbytes, statistics.median(secs)),
                "MB/s (best)": common.mb_per_s(nbytes, min(secs)),
                "n": len(secs),
            }
        )
    for r in rows:
        r["vs TCP"] = r["MB/s (median)"] / rows[1]["MB/s (median)"]
    return rows


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("rejoin", __doc__, _extra, argv)
    kills = args.kills or (4 if args.quick else 8)
    times = args.transfers or (3 if args.quick else 5)
    phases = {
        "fresh process": measure_rejoins(kills, args.gap, warm=False),
        "warm spare": measure_rejoins(kills, args.gap, warm=True),
    }
    stages = {how: summarize(p) for how, p in phases.items()}
    for how, rows in stages.items():
        common.print_table(
            f"Rejoin after kill -9, {how}: {len(phases[how])} kills, 4 gpt-tiny learners, H=32, restart delay 0.5 s",
            rows,
        )
    xfer = measure_transfer(times)
    rows = transfer_rows(xfer, baseline("tcp", xfer["bytes"], times), baseline("zmq", xfer["bytes"], times))
    common.print_table(
        f"State transfer: gpt-medium, {xfer['params']:,} params, {xfer['bytes'] / 1e6:.1f} MB fp32", rows
    )
    common.write_json(
        args.out,
        {
            "benchmark": "rejoin",
            "quick": args.quick,
            "kills": phases,
            "stages": stages,
            "transfer": xfer,
            "transfer_rows": rows,
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
