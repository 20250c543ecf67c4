"""Benchmark: a protocol-level load generator for the syncer at the size of real models (issue 20).

N synthetic learners (bench/loadgen_worker.py), spread over `--procs` worker processes, speak the
real wire protocol to one real syncer process (`python -m syncer`, a resolved configuration and
CURVE keys as `dldctl up` writes them), or to the `--shards` S processes of a sharded one (each
learner then holds one link per shard, as the real learner does, and pushes each fragment to its
owner shard): each has its own DEALER socket and key, says hello
(learner-0 uploads the initial model of the chosen shape, the others fetch it in 4 MB chunks),
heartbeats, answers the syncer's round calls at its next step boundary (`round_clock = "syncer"`,
the default; `--set round_clock=learner` pushes on each learner's own schedule instead) with an
int4 + zstd outer gradient of realistic statistics (encoded once per fragment, a few variants),
and takes in the updates (decoded on one learner per worker with `--decode one`, the default).
The link is the real learner's (`learner.link.LinkCore`); no model is trained or held.

Model shapes (manifests from the GPT formulas, no model built): gpt2-124m, gpt2-350m, gpt2-774m
(GPT-2 small / medium / large, vocabulary 50,304), and the presets gpt-tiny, gpt-small, gpt-medium.

Measured over a window of `--window-s` after the fleet joined and settled (definitions in
bench/loadgen_core.py):

    rounds/s       merge rounds closed per second (the syncer's `round` records); offered = P / (H x step)
    Mparams/s      parameters of the global model merged per second (offered: the model every H steps)
    latency        last push of a round leaving -> the last of its contributors holding the update
                   (client side, p50/p99); `sent`: the same from the syncer's records (update sent)
    merge          the syncer's merge time per round (record `merge_s`)
    missed         pushes that missed their round (a round of their fragment closed without them)
    syncer cpu     cores the syncer process used (/proc/PID/stat utime + stime over the window);
                   rss: VmRSS sampled through the window (max), hwm: VmHWM (peak since start)
    ckpt_s         seconds of the window the syncer spent writing checkpoints (in its loop: nothing
                   else moves meanwhile); clear_p99: the latency of the rounds no checkpoint touched
    gen cpu / lag  the worker processes' cores, and how late they handled step boundaries (p99):
                   if large, the generator, not the syncer, was the bottleneck
    join_s         seconds until the learners added at this size held the global state
    verdict        kept up: rounds/s >= --min-rate x offered, latency p99 <= --max-latency-s (default:
                   the round interval H/P x step), missed <= --max-missed

With `--shards` S > 1 the table has a row per shard under each fleet size's total ("all": rates
and Mparams/s summed, latency over every round, cores and memory of the shards summed); a
shard's offered rate is its own fragments' share. loop / zmq: the cores of the syncer's main
thread (its event loop and merges) and of libzmq's I/O threads (CURVE, TCP copies).

The baseline is the offered load itself (same run): rate_ratio = achieved / offered rounds per second.
`--search` grows one fleet on one syncer (2, 4, 8, ... up to --max-learners; after the first size
it cannot sustain, bisects --refine times) and reports the largest size the syncer kept up with.

    .venv/bin/python bench/loadgen.py --quick                       # gpt2-124m, 4 learners, 0.25 s steps, ~1.5 min
    .venv/bin/python bench/loadgen.py --learners 8 --model gpt2-350m
    .venv/bin/python bench/loadgen.py --search --model gpt2-124m --max-learners 16 --window-s 96
    .venv/bin/python bench/loadgen.py --quick --shards 2                 # the same fleet on 2 syncer shards
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import common
from bench import loadgen_core as core
from bench.loadgen_fleet import LoadConfig, LoadFleet
from bench.loadgen_syncer import SyncerDied

COLUMNS = [
    "learners",
    "rounds",
    "offered/s",
    "rounds/s",
    "rate_ratio",
    "Mparams/s",
    "contrib/round",
    "lat_p50_s",
    "lat_p99_s",
    "clear_p99_s",
    "sent_p99_s",
    "merge_p50_s",
    "merge_p99_s",
    "missed",
    "syncer_cpu",
    "cpu_s/round",
    "rss_MB",
    "hwm_MB",
    "ckpt_s",
    "gen_cpu",
    "gen_lag_p99_s",
    "reconnects",
    "join_s",
    "verdict",
]


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt2-124m", choices=sorted(core.SHAPES), help="model shape")
    parser.add_argument("--learners", type=int, default=4, help="fleet size (without --search)")
    parser.add_argument("--procs", type=int, default=2, help="worker processes for the synthetic learners")
    parser.add_argument("--H", type=int, default=64, help="inner steps per sync of a fragment")
    parser.add_argument("--fragments", type=int, default=4, help="P")
    parser.add_argument("--step-time", type=float, default=None, help="seconds per inner step (default 1, quick 0.25)")
    parser.add_argument("--window-s", type=float, default=None, help="measurement window (default 120, quick 40)")
    parser.add_argument("--settle-s", type=float, default=None, help="wait after joining (default: a round interval)")
    parser.add_argument("--decode", choices=("one", "all", "none"), default="one", help="who decodes the updates")
    parser.add_argument("--variants", type=int, default=None, help="encoded outer gradients per fragment (4, quick 2)")
    common.add_set_option(parser, "[run] overrides, e.g. checkpoint_every=1000,merge=mean")
    parser.add_argument("--search", action="store_true", help="find the largest fleet the syncer sustains")
    parser.add_argument("--start-learners", type=int, default=2, help="search: the first fleet size")
    parser.add_argument("--max-learners", type=int, default=None, help="search: the largest (default 16, quick 8)")
    parser.add_argument("--refine", type=int, default=1, help="search: bisection steps after the first failure")
    parser.add_argument("--min-rate", type=float, default=0.95, help="kept up: rounds/s >= this x offered")
    parser.add_argument("--max-latency-s", type=float, default=None, help="kept up: p99 latency (default: H/P x step)")
    parser.add_argument("--max-missed", type=float, default=0.05, help="kept up: share of pushes that missed a round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the run directory (syncer log, metrics)")
    parser.add_argument("--tmp", default=None, help="where the run directory (and checkpoints) go, e.g. /dev/shm")
    parser.add_argument("--shards", type=int, default=1, help="syncer processes (shards) of the run")


def load_config(args: argparse.Namespace) -> LoadConfig:
    """The run's configuration from the command line (quick mode: shorter steps and window)."""
    quick = args.quick
    window = (
        args.window_s if args.window_s is not None else (30.0 if quick and args.search else 40.0 if quick else 120.0)
    )
    most = args.max_learners if args.max_learners is not None else (8 if quick else 16)
    return LoadConfig(
        shape=args.model,
        H=args.H,
        fragments=args.fragments,
        step_time=args.step_time if args.step_time is not None else (0.25 if quick else 1.0),
        procs=max(1, args.procs),
        decode=args.decode,
        variants=args.variants if args.variants is not None else (2 if quick else 4),
        window_s=window,
        settle_s=args.settle_s,
        declared=max(most if args.search else args.learners, 1),
        overrides=common.overrides(args.set),
        seed=args.seed,
        keep=args.keep,
        tmp=args.tmp,
        shards=max(1, args.shards),
    )


SHARD_COLUMNS = ["learners", "shard", *COLUMNS[1:15], "loop_cores", "zmq_cores", *COLUMNS[15:]]


def level_row(level: dict[str, Any], cfg: LoadConfig, offered: float | None = None) -> dict[str, Any]:
    """The table's row of one measured fleet size (or of one shard's part of it: no generator,
    no join time, `offered` its own fragments' rate)."""
    st, sy, gen = level["stats"], level["syncer"], level.get("generator")
    offered = cfg.schedule.offered_rate if offered is None else offered
    return {
        "learners": level["learners"],
        "rounds": st["rounds"],
        "offered/s": offered,
        "rounds/s": st["achieved_rate"],
        "rate_ratio": st["achieved_rate"] / offered,
        "Mparams/s": st["params_per_s"] / 1e6,
        "contrib/round": st["contributors_mean"],
        "lat_p50_s": st["latency"]["p50"],
        "lat_p99_s": st["latency"]["p99"],
        "clear_p99_s": st["latency_clear"]["p99"],
        "sent_p99_s": st["sent_latency"]["p99"],
        "merge_p50_s": st["merge_s"]["p50"],
        "merge_p99_s": st["merge_s"]["p99"],
        "missed": f"{st['missed']}/{st['replies']}",
        "syncer_cpu": sy["cpu_cores"],
        "loop_cores": sy["threads"]["loop"],
        "zmq_cores": sy["threads"]["zmq"],
        "cpu_s/round": sy["cpu_s_per_round"],
        "rss_MB": sy["rss_mb_max"],
        "hwm_MB": sy["hwm_mb"],
        "ckpt_s": sy["checkpoints"]["share"] * cfg.window_s,
        "gen_cpu": gen["cpu_cores"] if gen else "-",
        "gen_lag_p99_s": gen["lag"]["p99"] if gen else "-",
        "reconnects": gen["links"]["reconnects"] if gen else "-",
        "join_s": level.get("join_s", "-"),
        "verdict": "kept up" if not level["problems"] else "BEHIND",
    }


def level_rows(level: dict[str, Any], cfg: LoadConfig) -> list[dict[str, Any]]:
    """One fleet size's rows: the whole syncer, then (sharded) each shard's own."""
    if "shards" not in level:
        return [level_row(level, cfg)]
    rows = [{**level_row(level, cfg), "shard": "all"}]
    for part in level["shards"]:
        row = level_row({**part, "learners": level["learners"]}, cfg, shard_offered(cfg, part["fragments"]))
        rows.append({**row, "shard": str(part["shard"])})
    return rows


def shard_offered(cfg: LoadConfig, owned: list[int]) -> float:
    """Rounds per second a shard owning `owned` is offered: its fragments' share of the fleet's."""
    return core.Schedule(cfg.H, len(owned), cfg.step_time).offered_rate


def judge(level: dict[str, Any], cfg: LoadConfig, rule: core.StopRule) -> None:
    """`problems` of the whole syncer and of each shard (against its own offered rate)."""
    level["problems"] = rule.problems(core.WindowStats(**level["stats"]), cfg.schedule.offered_rate)
    for part in level.get("shards", []):
        part["problems"] = rule.problems(core.WindowStats(**part["stats"]), shard_offered(cfg, part["fragments"]))


def run_level(fleet: LoadFleet, n: int, rule: core.StopRule) -> dict[str, Any]:
    """Grow (or shrink) the fleet to n learners, measure one window, judge it."""
    join_s = fleet.resize(n)
    level = fleet.measure(n)
    level["join_s"] = join_s
    judge(level, fleet.cfg, rule)
    row = level_row(level, fleet.cfg)
    print(
        f"  {n} learners: {row['rounds']} rounds, {row['rounds/s']:.4f}/s of {row['offered/s']:.4f} offered, "
        f"latency p99 {_s(row['lat_p99_s'])}, missed {row['missed']}, syncer {row['syncer_cpu']:.2f} cores: "
        f"{row['verdict']}{' (' + '; '.join(level['problems']) + ')' if level['problems'] else ''}",
        flush=True,
    )
    return level


def search(
    fleet: LoadFleet, rule: core.StopRule, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], int, dict[str, Any] | None]:
    """Levels 2, 4, 8, ... until the syncer falls behind, then bisect: the levels, the largest size
    it sustained, and why the search stopped early (a shard died at that size: the levels before
    it are kept and reported, and that size counts as not sustained)."""
    history: list[tuple[int, bool]] = []
    levels: list[dict[str, Any]] = []
    while (n := core.next_learners(history, args.start_learners, fleet.cfg.declared, args.refine)) is not None:
        try:
            level = run_level(fleet, n, rule)
        except SyncerDied as exc:
            print(f"  {n} learners: stopped: {exc}", flush=True)
            history.append((n, False))
            return levels, core.sustained(history), {"learners": n, "error": str(exc).splitlines()[0]}
        levels.append(level)
        history.append((n, not level["problems"]))
    return levels, core.sustained(history), None


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def report(
    args: argparse.Namespace, cfg: LoadConfig, levels: list[dict[str, Any]], best: int | None, extra: dict[str, Any]
) -> None:
    """The table, the search's answer, and the JSON (every level in full)."""
    sched = cfg.schedule
    params = core.param_count(core.manifest(cfg.shape))
    rows = [row for level in levels for row in level_rows(level, cfg)]
    shards = f", {cfg.shards} syncer shards" if cfg.shards > 1 else ""
    title = (
        f"Syncer under load: {cfg.shape} ({params / 1e6:.0f} M params), H = {cfg.H}, P = {cfg.fragments}, "
        f"step {cfg.step_time:g} s, window {cfg.window_s:g} s{shards}"
    )
    common.print_table(title, rows, SHARD_COLUMNS if cfg.shards > 1 else COLUMNS)
    if best is not None:
        print(f"largest fleet the syncer kept up with: {best} learners (searched up to {cfg.declared})")
    if extra.get("stopped"):
        print(f"the search stopped at {extra['stopped']['learners']} learners: {extra['stopped']['error']}")
    payload = {
        "benchmark": "loadgen",
        "quick": args.quick,
        "config": asdict(cfg),
        "model": {"shape": cfg.shape, "params": params},
        "offered": {
            "rounds_per_s": sched.offered_rate,
            "params_per_s": sched.offered_params_per_s(params),
            "round_interval_s": sched.round_interval_s,
        },
        "sustained": best,
        "levels": levels,
        "rows": rows,
        **extra,
    }
    print(f"wrote {common.shown(common.write_json(args.out, payload))}")


def main() -> None:
    args = common.parse_args("loadgen", __doc__, _extra)
    torch.set_num_threads(1)
    cfg = load_config(args)
    sched = cfg.schedule
    latency = args.max_latency_s if args.max_latency_s is not None else sched.round_interval_s
    rule = core.StopRule(latency, args.min_rate, args.max_missed)
    print(
        f"{cfg.shape}: {core.param_count(core.manifest(cfg.shape)) / 1e6:.1f} M parameters, P = {cfg.fragments}, "
        f"H = {cfg.H}, step {cfg.step_time:g} s: one round every {sched.round_interval_s:.2f} s; "
        f"{cfg.procs} worker processes; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    load_before, began = os.getloadavg(), time.monotonic()
    with LoadFleet(cfg) as fleet:
        start = fleet.start()
        up = "syncer" if cfg.shards == 1 else f"{cfg.shards} syncer shards"
        print(f"  {up} up, blobs encoded in {start['blobs_s']:.1f} s (run directory {fleet.dir})", flush=True)
        if args.search:
            levels, best, stopped = search(fleet, rule, args)
        else:
            try:
                levels, best, stopped = [run_level(fleet, args.learners, rule)], None, None
            except SyncerDied as exc:
                print(exc, file=sys.stderr)
                raise SystemExit(f"bench/loadgen.py: {args.learners} learners: {str(exc).splitlines()[0]}") from None
        sizes = fleet.sizes
    extra = {
        "fragment_sizes": sizes,
        "rule": asdict(rule),
        "start": start,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "wall_s": time.monotonic() - began,
        "stopped": stopped,
    }
    report(args, cfg, levels, best, extra)


if __name__ == "__main__":
    main()
