"""Benchmark: the syncer's capacity plan, from costs measured in this run.

Measures, on this machine, the inputs of the capacity model in bench/capacity_model.py:

- the round's CPU per parameter against the number of pushes in it (M = 1, 2, 4, 8, 16; the real
  SyncerCore with the native kernel, int4 + zstd, as bench/syncer_throughput.py drives it, one
  thread, CPU time), fitted to a + b*M; memcpy of the same bytes, same run, is the baseline;
- the wire bytes of one push per parameter (the same blobs);
- one-way throughput of a ZeroMQ DEALER -> ROUTER connection with CURVE on loopback (4 MiB
  messages, the same sockets and options as the syncer's link), against the same without CURVE;
- what the process holds per parameter is read from bench/results/syncer_memory.json (steady
  bytes per parameter and the empty process) where it exists, else 12 + 1 bytes is assumed.

It then prints, for gpt2-124m, a 350M and a 774M shape, 7B and 70B (H = 64, 1 s steps by default),
one shard's memory, merge and crypto cores and link at M learners, the largest fleet one shard
keeps up with, and the shards the model needs; and checks the model against the load generator's
measured searches (bench/results/loadgen_search_*.json): the fleet it found sustained must not
exceed what the model predicts.

    .venv/bin/python bench/capacity.py [--quick] [--out PATH] [--H 64] [--step-s 1] [--learners 8] [--ram-gb 128]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import zmq

from bench import capacity_model as cm
from bench import common
from bench import syncer_throughput as st
from syncer.common.settings import RunSettings

SHAPES = {"gpt2-124m": 124.4e6, "gpt2-350m": 354.8e6, "gpt2-774m": 774.0e6, "7B": 6.74e9, "70B": 68.98e9}
RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20


def round_costs(model: str, counts: list[int], repeat: int) -> tuple[list[dict], float]:
    """CPU ns per parameter of one round of every fragment, for each number of pushes; and the
    push's wire bytes per parameter."""
    rows, push_B = [], 0.0
    for m in counts:
        settings = RunSettings(model=model, fragments=4, H=64, round_clock="learner")
        learners = [f"l{i}" for i in range(m)]
        core = st.build_core(model, settings, learners=learners)
        n = st.global_model(core).numel
        blobs = st.make_blobs(core, settings, m)
        push_B = sum(len(row[0]) for row in blobs) / n
        rounds = st.Rounds(core, blobs, settings.H, learners)
        rounds()  # warm-up
        t = common.measure(rounds, repeat=repeat, warmup=0)
        base = common.measure(functools.partial(st.memcpy, core), repeat=3, warmup=1)
        ns = 1e9 * t.cpu.median / n
        rows.append({"pushes": m, "ns/param": ns, "spread": t.cpu.spread, "memcpy ns/param": 1e9 * base.cpu.median / n})
        print(f"  M = {m:2d}: {ns:.2f} ns per parameter per round ({t.cpu.spread:.0%} spread)")
    return rows, push_B


def link_MBps(curve: bool, total_mb: int, msg_mb: int = 4) -> float:
    """One-way MB/s of a DEALER -> ROUTER connection on loopback (`curve`: with CURVE)."""
    ctx_s, ctx_c = zmq.Context(), zmq.Context()  # one I/O thread each, as two processes would have
    router, dealer = ctx_s.socket(zmq.ROUTER), ctx_c.socket(zmq.DEALER)
    try:
        if curve:
            server_pub, server_sec = zmq.curve_keypair()
            client_pub, client_sec = zmq.curve_keypair()
            router.curve_server, router.curve_secretkey, router.curve_publickey = True, server_sec, server_pub
            dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = server_pub, client_pub, client_sec
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        payload, count = bytes(msg_mb * MIB), total_mb // msg_mb
        dealer.send(b"warm")
        router.recv_multipart()
        start = time.perf_counter()
        for _ in range(count):
            dealer.send(payload, copy=False)
        for _ in range(count):
            router.recv_multipart(copy=False)
        return count * msg_mb * MIB / 1e6 / (time.perf_counter() - start)
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx_s.term()
        ctx_c.term()


def memory_costs() -> tuple[float, float, str]:
    """(state bytes per parameter, empty process bytes, where from)."""
    path = RESULTS / "syncer_memory.json"
    try:
        rows = json.loads(path.read_text())["rows"]
        big = max(rows, key=lambda r: r["params_M"])
        return float(big["steady_B/param"]), float(big["empty_MB"]) * 1e6, f"{path.name} ({big['model']})"
    except (OSError, ValueError, KeyError):
        return 13.0, 250e6, "assumed (no syncer_memory.json)"


def plan_rows(c: cm.Costs, f: cm.Fleet, ram_B: float, loop_share: float, io_cores: float) -> list[dict]:
    """One row per model shape: one shard's needs at this fleet, its largest fleet, the shards."""
    rows = []
    for name, params in SHAPES.items():
        need = cm.shards(c, f, params, ram_B, loop_share, io_cores)
        rows.append(
            {
                "model": name,
                "params_B": params / 1e9,
                "GB steady": cm.memory_B(c, f, params) / 1e9,
                "GB checkpointing": cm.memory_B(c, f, params, checkpointing=True) / 1e9,
                "merge cores": cm.merge_cores(c, f, params),
                "rounds/s": 4 / f.period_s,
                "MB/s each way": cm.wire_MBps(c, f, params),
                "crypto cores": cm.crypto_cores(c, f, params),
                "max learners/shard": cm.max_learners(c, f.H, f.step_s, params, loop_share, io_cores),
                **need,
            }
        )
    return rows


def check_loadgen(c: cm.Costs, loop_share: float, io_cores: float) -> list[dict]:
    """The load generator's searches against the model: what it sustained, what the model allows."""
    rows = []
    for path in sorted(RESULTS.glob("loadgen_search_*.json")):
        d = json.loads(path.read_text())
        offered, params = d["config"], float(d["model"]["params"])
        predicted = cm.max_learners(c, int(offered["H"]), float(offered["step_time"]), params, loop_share, io_cores)
        tried = max(level["learners"] for level in d["levels"])
        rows.append(
            {
                "file": path.name,
                "params_M": params / 1e6,
                "sustained": d["sustained"],
                "largest tried": tried,
                "predicted max": predicted,
                "consistent": d["sustained"] <= predicted,
            }
        )
    return rows


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model preset the round costs are measured on")
    parser.add_argument("--H", type=int, default=64)
    parser.add_argument("--step-s", type=float, default=1.0, help="seconds per inner step")
    parser.add_argument("--learners", type=int, default=8, help="M for the plan")
    parser.add_argument("--ram-gb", type=float, default=128.0, help="RAM of one shard's host")
    parser.add_argument("--loop-share", type=float, default=0.5, help="share of the loop's core merges may take")
    parser.add_argument("--io-cores", type=float, default=1.0, help="cores for CURVE per shard")


def main() -> None:
    args = common.parse_args("capacity", __doc__, _extra)
    torch.set_num_threads(1)
    model = args.model or ("gpt-medium" if args.quick else "gpt2-124m")
    counts = [1, 4, 8] if args.quick else [1, 2, 4, 8, 16]
    print(f"round costs on {model} (native kernel, int4 + zstd, 4 fragments):")
    rounds, push_B = round_costs(model, counts, 3 if args.quick else 8)
    a, b = cm.fit_line([float(r["pushes"]) for r in rounds], [r["ns/param"] for r in rounds])
    total = 64 if args.quick else 256
    curve, plain = statistics.median(link_MBps(True, total) for _ in range(3)), link_MBps(False, total)
    state_B, base_B, memory_from = memory_costs()
    c = cm.Costs(a, b, push_B, state_B, base_B, curve)
    f = cm.Fleet(args.learners, args.H, args.step_s)
    plan = plan_rows(c, f, args.ram_gb * 1e9, args.loop_share, args.io_cores)
    checks = check_loadgen(c, args.loop_share, args.io_cores)
    common.print_table(f"Round CPU per parameter against pushes (fit: {a:.2f} + {b:.2f} x M ns)", rounds)
    print(f"push {push_B:.3f} B/param; CURVE {curve:,.0f} MB/s one way (without {plain:,.0f}); memory: {memory_from}")
    title = f"Capacity plan: M = {f.learners}, H = {f.H}, {f.step_s:g} s steps, {args.ram_gb:g} GB per shard"
    common.print_table(title, plan)
    common.print_table("The model against the load generator's searches", checks)
    common.write_json(
        args.out,
        {
            "benchmark": "capacity",
            "quick": args.quick,
            "model": model,
            "costs": vars(c) | {"plain_link_MBps": plain, "memory_from": memory_from},
            "fleet": {"learners": f.learners, "H": f.H, "step_s": f.step_s},
            "limits": {"ram_GB": args.ram_gb, "loop_share": args.loop_share, "io_cores": args.io_cores},
            "rounds": rounds,
            "plan": plan,
            "loadgen_checks": checks,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
