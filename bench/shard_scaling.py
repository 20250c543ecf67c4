"""Benchmark: does the syncer's merge throughput scale with its shards? (issue 20)

Target: **2 shards sustain at least 1.8x the merge throughput of one shard on this 2-core machine,
same run** (`TARGET`). The load generator of bench/loadgen.py (bench/loadgen_fleet.py: real
`python -m syncer` processes, synthetic learners with the real learner link, one per shard)
offers the same load to a syncer of 1 shard, then of 2 shards of one run (`--shards 1,2`;
`--repeat` alternates them), each a fresh run: start, learner-0 uploads the model to every
shard, the others fetch it (nobody steps until all hold the state: a fetch cannot finish while
its fragment merges several times a second), settle, one measured window.

The load is above what one shard can merge (saturation): a model whose rounds are CPU-bound
(gpt2-124m: 4 fragments of 31 M parameters, an int4 + zstd push of 13.6 MB each), 2 learners
and short steps (H = 4, 0.05 s: 20 rounds/s offered, 622 M parameters per second; one shard
merges about a third of that). What the settings leave out, in both configurations alike:

- checkpoints (`checkpoint_s = 0`, `checkpoint_every` = 10^6): the merge is what is measured;
- the backlog cap (`max_backlog = 0`): a saturated syncer merges each fragment less often than
  every H steps, so every push would be capped and its rest carried into the next rounds, extra
  pushes that cost a round more the more it is overloaded (1 shard more than 2: a bias);
- CURVE, unless `--curve`: the generator's learners run on these 2 cores too, and their side of
  CURVE (0.5 cores for one shard at this load) is work real learners do on their own hosts; the
  shards' own CURVE (libzmq's thread, `zmq` below) is measured with `--curve`;
- the settle (`--settle-s`, default 35 s) outlasts the 30 s after a state transfer in which a
  shard keeps the previous version of every merged fragment (a copy per merge).

Baseline, same run (`--ceiling-s`, bench/merge_ceiling.py): the merge alone, no sockets, the same
rounds (2 pushes, the real `SyncerCore`) in 1 process, then in 2 processes at once, each holding
one shard's fragments: the most this machine's cores give 2 shards over 1.

Measured per configuration over the window (bench/loadgen_core.py's definitions):

    Mparams/s      parameters of the global model merged per second (each shard's: per shard);
                   the result is the ratio of these: 2 shards / 1 shard
    push MB/s      push bytes merged per second (the rounds' `bytes_in`): the work behind them
    saturated      achieved rounds/s under 0.9 x offered: the syncer, not the offer, set the rate
    loop / zmq     cores of each shard's main thread (event loop and merges: CPU-bound near 1.0)
                   and of its libzmq I/O threads (CURVE, TCP copies); per loop core: Mparams/s
                   over the loops' cores (the same in both: sharding costs the merge nothing)
    gen cpu        the generator's worker processes (they share the 2 cores)
    machine        cores the whole machine was busy (/proc/stat); others: of those, what no
                   process of this benchmark used (another user's work: the numbers are then low)

    .venv/bin/python bench/shard_scaling.py --quick          # 1 then 2 shards, 30 s windows, ~4 min
    .venv/bin/python bench/shard_scaling.py                  # 60 s windows, ~5 min
    .venv/bin/python bench/shard_scaling.py --curve --out bench/results/shard_scaling_curve.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import common, merge_ceiling
from bench import loadgen_core as core
from bench.loadgen_fleet import LoadConfig, LoadFleet

TARGET = 1.8  # issue 20: 2 shards >= 1.8 x one shard's merge throughput
SATURATED = 0.9  # achieved below this share of the offered rounds: the syncer set the rate
MERGE_ONLY = {"checkpoint_s": 0.0, "checkpoint_every": 1_000_000, "max_backlog": 0.0}


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt2-124m", choices=sorted(core.SHAPES), help="model shape")
    parser.add_argument("--learners", type=int, default=2, help="synthetic learners")
    parser.add_argument("--procs", type=int, default=1, help="worker processes for the synthetic learners")
    parser.add_argument("--H", type=int, default=4, help="inner steps per sync of a fragment")
    parser.add_argument("--fragments", type=int, default=4, help="P")
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds per inner step")
    parser.add_argument("--window-s", type=float, default=None, help="measurement window (default 60, quick 30)")
    parser.add_argument("--settle-s", type=float, default=35.0, help="wait after joining (> 30 s: see above)")
    parser.add_argument("--curve", action="store_true", help="CURVE on every link (default: insecure, see above)")
    parser.add_argument("--ceiling-s", type=float, default=10.0, help="seconds of the merge-alone baseline (0: skip)")
    parser.add_argument("--shards", default="1,2", help="shard counts to run, in order")
    parser.add_argument("--repeat", type=int, default=1, help="run the shard counts this many times, alternating")
    parser.add_argument("--decode", choices=("one", "all", "none"), default="none", help="who decodes the updates")
    common.add_set_option(parser, "[run] overrides (of the settings above too)")
    parser.add_argument("--tmp", default=None, help="where the run directories go, e.g. /dev/shm")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (logs, metrics)")
    parser.add_argument(
        "--syncer-threads", type=int, default=0, help="torch threads per shard process (OMP_NUM_THREADS; 0: default)"
    )


def configs(args: argparse.Namespace) -> list[LoadConfig]:
    """One LoadConfig per run, the shard counts alternating `--repeat` times."""
    base = LoadConfig(
        shape=args.model,
        H=args.H,
        fragments=args.fragments,
        step_time=args.step_time,
        procs=max(1, args.procs),
        decode=args.decode,
        variants=2,
        window_s=args.window_s if args.window_s is not None else (30.0 if args.quick else 60.0),
        settle_s=args.settle_s,
        declared=args.learners,
        overrides={**MERGE_ONLY, "insecure": not args.curve, **common.overrides(args.set)},
        tmp=args.tmp,
        keep=args.keep,
        syncer_threads=args.syncer_threads,
    )
    counts = [int(s) for s in args.shards.split(",")]
    return [LoadConfig(**{**asdict(base), "shards": s}) for _ in range(max(1, args.repeat)) for s in counts]


def run_one(cfg: LoadConfig) -> dict[str, Any]:
    """A fresh run of `cfg.shards` shards: start, join every learner, one window; its level."""
    load = os.getloadavg()[0]
    with LoadFleet(cfg) as fleet:
        start = fleet.start()
        join_s = fleet.resize(cfg.declared, hold=True)
        level = fleet.measure(cfg.declared)
        level["fragments"] = [list(owned) for owned in fleet.owned]
        level["bytes_in"] = push_bytes(fleet, level)
    level.update(shard_count=cfg.shards, start=start, join_s=join_s, load_average=[load, os.getloadavg()[0]])
    return level


def push_bytes(fleet: LoadFleet, level: dict[str, Any]) -> list[float]:
    """Push bytes merged per second by each shard in the window (the rounds' `bytes_in`)."""
    start, end = level["window"]["start"], level["window"]["end"]
    out = []
    for s in range(fleet.cfg.shards):
        rounds = [r for r in fleet.rounds(s) if start <= float(r["t"]) < end]
        out.append(sum(float(r.get("bytes_in", 0)) for r in rounds) / (end - start))
    return out


def _parts(level: dict[str, Any]) -> list[dict[str, Any]]:
    """Each shard's part of a level (an unsharded level is its own only part)."""
    return level.get("shards") or [{"shard": 0, "stats": level["stats"], "syncer": level["syncer"]}]


def _each(values: list[float], fmt: str = "{:.0f}") -> str:
    return " / ".join(fmt.format(v) for v in values)


def row(level: dict[str, Any], cfg: LoadConfig, baseline: float) -> dict[str, Any]:
    """One configuration's row: throughput (total and per shard), latency, CPU of every process."""
    st, parts, gen = level["stats"], _parts(level), level["generator"]
    loops = [p["syncer"]["threads"]["loop"] for p in parts]
    zmqs = [p["syncer"]["threads"]["zmq"] for p in parts]
    syncer_cpu = sum(p["syncer"]["cpu_cores"] for p in parts)
    return {
        "shards": level["shard_count"],
        "Mparams/s": st["params_per_s"] / 1e6,
        "per shard": _each([p["stats"]["params_per_s"] / 1e6 for p in parts]),
        "vs 1 shard": st["params_per_s"] / baseline if baseline else None,
        "push MB/s": sum(level["bytes_in"]) / 1e6,
        "rounds/s": st["achieved_rate"],
        "of offered": st["achieved_rate"] / cfg.schedule.offered_rate,
        "contrib/round": st["contributors_mean"],
        "lat p50/p99 s": f"{st['latency']['p50'] or 0:.2f} / {st['latency']['p99'] or 0:.2f}",
        "merge p50 s": _each([p["stats"]["merge_s"]["p50"] or 0.0 for p in parts], "{:.3f}"),
        "missed": f"{st['missed']}/{st['replies']}",
        "loop cores": _each(loops, "{:.2f}"),
        "zmq cores": _each(zmqs, "{:.2f}"),
        "syncer cores": syncer_cpu,
        "Mparams/s per loop core": st["params_per_s"] / 1e6 / sum(loops) if sum(loops) else None,
        "rss MB": _each([p["syncer"]["rss_mb_max"] for p in parts]),
        "gen cpu": gen["cpu_cores"],
        "gen lag p99 s": gen["lag"]["p99"],
        "machine cores": level["machine"]["busy_cores"],
        "others cores": level["machine"]["others_cores"],
    }


def verdict(levels: list[dict[str, Any]], cfg: LoadConfig) -> dict[str, Any]:
    """The ratio of the medians (2 shards / 1 shard) and what limited each side."""
    by = {s: [lv for lv in levels if lv["shard_count"] == s] for s in sorted({lv["shard_count"] for lv in levels})}
    rate = {s: statistics.median(lv["stats"]["params_per_s"] for lv in lvs) for s, lvs in by.items()}
    offered = cfg.schedule.offered_rate
    out: dict[str, Any] = {"target": TARGET, "params_per_s": rate}
    for s, lvs in by.items():
        out[f"saturated_{s}"] = all(lv["stats"]["achieved_rate"] < SATURATED * offered for lv in lvs)
    if 1 in rate and 2 in rate:
        out["ratio"] = rate[2] / rate[1]
        out["met"] = out["ratio"] >= TARGET
        per_core = {s: statistics.median(_per_loop_core(lv) for lv in lvs) for s, lvs in by.items()}
        out["per_loop_core_ratio"] = per_core[2] / per_core[1]  # 1.0: a shard merges as much per core of its loop
    return out


def _per_loop_core(level: dict[str, Any]) -> float:
    """Parameters merged per second per core the shards' loops used."""
    loops = sum(p["syncer"]["threads"]["loop"] for p in _parts(level))
    return float(level["stats"]["params_per_s"]) / loops if loops else 0.0


def limits(levels: list[dict[str, Any]]) -> list[str]:
    """What each run's numbers say limited it (the honest reading of the table)."""
    notes = []
    for lv in levels:
        parts, gen = _parts(lv), lv["generator"]["cpu_cores"]
        total = sum(p["syncer"]["cpu_cores"] for p in parts) + gen
        loops = [p["syncer"]["threads"]["loop"] for p in parts]
        why = []
        if any(loop >= 0.85 for loop in loops):
            why.append(f"a shard's loop is CPU-bound ({_each(loops, '{:.2f}')} cores)")
        busy, others = lv["machine"]["busy_cores"], lv["machine"]["others_cores"]
        if busy >= 0.9 * (os.cpu_count() or 2):
            why.append(
                f"the machine's {os.cpu_count()} cores are used up ({busy:.2f}: syncer {total - gen:.2f}, "
                f"generator {gen:.2f}, other processes {others:.2f})"
            )
        elif others > 0.2:
            why.append(f"other processes took {others:.2f} cores")
        if lv["generator"]["lag"]["p99"] and lv["generator"]["lag"]["p99"] > 0.5:
            why.append(f"the generator lags (step boundaries {lv['generator']['lag']['p99']:.2f} s late, p99)")
        notes.append(f"{lv['shard_count']} shard(s): " + ("; ".join(why) or "no CPU limit seen"))
    return notes


def main() -> None:
    args = common.parse_args("shard_scaling", __doc__, _extra)
    torch.set_num_threads(1)
    runs = configs(args)
    cfg = runs[0]
    params = core.param_count(core.manifest(cfg.shape))
    print(
        f"{cfg.shape}: {params / 1e6:.1f} M parameters, P = {cfg.fragments}, H = {cfg.H}, step {cfg.step_time:g} s, "
        f"{cfg.declared} learners: {cfg.schedule.offered_rate:.1f} rounds/s offered "
        f"({cfg.schedule.offered_params_per_s(params) / 1e6:.0f} M params/s); load average "
        f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    began, levels = time.monotonic(), []
    ceiling = merge_alone(cfg, [r.shards for r in runs], args.ceiling_s)
    for run in runs:
        level = run_one(run)
        levels.append(level)
        print(
            f"  {run.shards} shard(s): {level['stats']['params_per_s'] / 1e6:.0f} M params/s merged, "
            f"{level['stats']['achieved_rate']:.2f} rounds/s, generator {level['generator']['cpu_cores']:.2f} cores",
            flush=True,
        )
    report(args, cfg, levels, ceiling, params, time.monotonic() - began)


def merge_alone(cfg: LoadConfig, counts: list[int], seconds: float) -> list[merge_ceiling.CeilingResult]:
    """The baseline: the same rounds without sockets, in 1 process and in each shard count's
    processes at once (bench/merge_ceiling.py); none when `seconds` is 0."""
    if seconds <= 0:
        return []
    env = {"OMP_NUM_THREADS": str(cfg.syncer_threads)} if cfg.syncer_threads > 0 else {}
    out = []
    for k in sorted(set(counts)):
        result = merge_ceiling.measure(cfg.shape, cfg.fragments, k, cfg.declared, seconds, env)
        out.append(result)
        print(
            f"  merge alone, {k} process(es) at once: {result.params_per_s / 1e6:.0f} M params/s "
            f"({' / '.join(f'{c:.2f}' for c in result.cpu_cores)} cores)",
            flush=True,
        )
    return out


def report(
    args: argparse.Namespace,
    cfg: LoadConfig,
    levels: list[dict[str, Any]],
    ceiling: list[merge_ceiling.CeilingResult],
    params: int,
    wall: float,
) -> None:
    """The table, the verdict and what limited each run, and the JSON."""
    v = verdict(levels, cfg)
    alone = {c.processes: c.params_per_s for c in ceiling}
    if 1 in alone and 2 in alone:
        v["merge_alone_ratio"] = alone[2] / alone[1]
    baseline = v["params_per_s"].get(1, 0.0)
    rows = [row(lv, cfg, baseline) for lv in levels]
    mode = "insecure (no CURVE)" if cfg.overrides.get("insecure") else "CURVE"
    common.print_table(
        f"Merge throughput by syncer shards: {cfg.shape}, {cfg.declared} learners, H = {cfg.H}, P = {cfg.fragments}, "
        f"step {cfg.step_time:g} s (offered {cfg.schedule.offered_params_per_s(params) / 1e6:.0f} M params/s), "
        f"{mode}, checkpoints {'off' if cfg.overrides.get('checkpoint_s') == 0 else 'on'}, "
        f"window {cfg.window_s:g} s",
        rows,
    )
    notes = limits(levels)
    for note in notes:
        print(f"  {note}")
    if "ratio" in v:
        print(
            f"2 shards / 1 shard: {v['ratio']:.2f}x the merged parameters per second (target >= {TARGET}x: "
            f"{'MET' if v['met'] else 'NOT MET'}); saturated: 1 shard {v.get('saturated_1')}, "
            f"2 shards {v.get('saturated_2')}"
        )
    if "per_loop_core_ratio" in v:
        print(
            f"per core of the shards' loops, 2 shards merged {v['per_loop_core_ratio']:.2f}x what 1 shard did "
            "(1.0: the shards lose nothing to each other; the rest of the gap is cores the loops did not get)"
        )
    if "merge_alone_ratio" in v:
        print(
            f"the merge alone (no sockets) in 2 processes at once: {v['merge_alone_ratio']:.2f}x one process "
            f"({alone[1] / 1e6:.0f} -> {alone[2] / 1e6:.0f} M params/s)"
        )
    payload = {
        "benchmark": "shard_scaling",
        "quick": args.quick,
        "config": asdict(cfg),
        "model": {"shape": cfg.shape, "params": params},
        "offered": {
            "rounds_per_s": cfg.schedule.offered_rate,
            "params_per_s": cfg.schedule.offered_params_per_s(params),
        },
        "verdict": v,
        "merge_alone": [asdict(c) for c in ceiling],
        "limits": notes,
        "rows": rows,
        "levels": levels,
        "wall_s": wall,
    }
    print(f"wrote {common.shown(common.write_json(args.out, payload))}")


if __name__ == "__main__":
    main()
