"""Benchmark baseline: torchft's fault-tolerant DiLoCo on the learners' model and data, under kills.

torchft 0.2.0 (`pip install torchft==0.2.0`, a benchmark-only dependency) trains the same
workload as the project's fleets (`bench.fleet.diloco_run(H)`: gpt-tiny, seq 32, batch 8 per
replica, AdamW with the learners' lr / weight decay / grad clip / warmup, H inner steps between
two syncs of a fragment, 4 fragments) as a real torchft job on this machine, 127.0.0.1 only:

- torchft's Lighthouse (`torchft_lighthouse --bind 127.0.0.1:PORT --min_replicas 1`, heartbeat
  and join timeouts of 2 s instead of 5 s / 60 s: on one host a dead replica is noticed fast);
- one replica group per learner (4 groups, 1 rank each): `bench/torchft_worker.py`, a
  `torchft.Manager` with `ProcessGroupGloo` and `torchft.local_sgd.DiLoCo(sync_every=H)` over the
  fragments, outer SGD(lr 0.7, momentum 0.9, Nesterov) per fragment (torchft's example; note
  that dldctl's own default is (0.6, 0.8), `RunSettings.outer_lr` / `outer_momentum`), each
  group in its own session, one torch thread; group g trains on data shard g of 4;
- the kill schedule of `bench.ddp_baseline.failure_schedule(D, mtbf, seed)` (a Poisson process)
  with victims drawn by `random.Random(seed)` as the other baselines draw them; at each time the
  victim's process group gets SIGKILL and is restarted `restart_delay_s` later: it boots, trains
  H/fragments steps on its fresh model, then rejoins at its first quorum, where torchft heals it
  from a live peer over its HTTP checkpoint transport (model, AdamW state, every fragment's
  global parameters and outer momentum), discarding its own stale steps.

**Measured**, over a window from the moment every group has done its first inner step to D
seconds later (start-up excluded, every restart inside the window counted; kill times count from
the window's start):
- tokens committed: the inner-step tokens of every fragment sync that committed (torchft's
  `should_commit`), summed over replicas; a replica that healed at a sync credits nothing for it.
  Committed tokens/s over the window; tokens trained (and per s) for comparison;
- eval loss: the final global model (every fragment's last committed parameters) of group 0, or
  of the live group with the most committed outer steps, saved as final_model.pt and scored by
  `bench.evaluate.eval_loss` on the learners' held-out batches (the same function for every
  strategy); a curve of group 0's held-out loss and the committed tokens about every 10 s;
- per kill: seconds to the victim's next first step and to its heal (rejoined through torchft).

The first incarnations start training together (a go file, once every group's Manager is up):
with min_replicas 1 the Lighthouse would otherwise form the first quorum with whoever asked
first and heal the rest one by one. On a 2-core host the 4 replicas share 2 cores, so a dead
replica's share goes to the survivors and committed tokens/s hardly drops under kills: read it
with the committed fraction, the failed syncs and the rejoin times. Each group's files (progress,
logs of every incarnation, final model) are in OUT/replica-G/, the Lighthouse's log in OUT/.
The processes are started, killed, restarted and stopped by `bench.torchft_job.Job`.

    .venv/bin/python bench/torchft_diloco.py --quick       # 2 x 30 s windows (one kill), ~1.5 min on 2 cores
    .venv/bin/python bench/torchft_diloco.py               # 2 x 100 s windows, kills mean 20 s apart, ~4 min
    .venv/bin/python bench/torchft_diloco.py --duration 60 --H 64 --mtbf 15 --seed 2
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.torchft_job import LIGHTHOUSE_OPTS, Job, tail

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
BOOT_TIMEOUT_S = 240.0  # launch -> every group has trained a step
STOP_GRACE_S = 30.0  # stop file -> every live worker has saved its model and exited
REPLICAS = 4


# --------------------------------------------------------------------------- pure helpers


def kill_plan(schedule: Sequence[float], replicas: int, seed: int) -> list[tuple[float, int]]:
    """(time, victim) per kill: victims drawn with random.Random(seed), one draw per kill in
    order, as `bench.ddp_baseline.run_ddp` and `bench.fleet.BenchRun.run_kills` draw them."""
    rng = random.Random(seed)
    return [(float(t), rng.randrange(replicas)) for t in sorted(schedule)]


def window_start(events: list[dict[str, Any]], replicas: int) -> float | None:
    """Unix time at which every group has done its first inner step (None until then)."""
    firsts: dict[int, float] = {}
    for e in events:
        if e.get("event") == "start":
            g = int(e["group"])
            firsts[g] = min(firsts.get(g, e["time"]), e["time"])
    return max(firsts.values()) if len(firsts) >= replicas else None


def trained_in(events: list[dict[str, Any]], start: float, end: float) -> int:
    """Tokens trained inside [start, end]: per incarnation, its counter at the last event up to
    `end` minus at the last sync before `start` (0 if none: the steps before its first sync count,
    as the first sync inside the window credits them). Steps after an incarnation's last event are
    lost with it and not counted."""
    total = 0
    by_life: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        by_life.setdefault((int(e["group"]), int(e["incarnation"])), []).append(e)
    for life in by_life.values():
        life.sort(key=lambda e: e["time"])
        upto = [e["tokens_trained"] for e in life if e["time"] <= end]
        before = [e["tokens_trained"] for e in life if e["time"] < start and e["event"] == "sync"]
        total += (upto[-1] if upto else 0) - (before[-1] if before else 0)
    return total


def committed_in(events: list[dict[str, Any]], start: float, end: float) -> int:
    """Tokens credited by committed syncs inside [start, end], summed over replicas."""
    return sum(int(e.get("credited", 0)) for e in events if e.get("event") == "sync" and start <= e["time"] <= end)


def curve(events: list[dict[str, Any]], start: float, end: float) -> list[dict[str, Any]]:
    """Group 0's held-out evals up to `end`: t since the window start, committed tokens so far
    (all replicas, from the window start), eval loss."""
    points = []
    for e in sorted(events, key=lambda e: e["time"]):
        if e.get("event") == "eval" and int(e["group"]) == 0 and e["time"] <= end:
            points.append(
                {
                    "t": e["time"] - start,
                    "tokens": committed_in(events, start, e["time"]),
                    "eval_loss": e["eval_loss"],
                    "manager_step": e.get("manager_step"),
                }
            )
    return points


def rejoins(kills: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kill: seconds to the victim's next first step, to its heal, to its first committed sync."""
    out = []
    for k in kills:
        later = [
            e
            for e in events
            if int(e["group"]) == k["victim"] and e["time"] > k["time"] and int(e["incarnation"]) > k["incarnation"]
        ]

        def first(pred: Any, later: list[dict[str, Any]] = later, k: dict[str, Any] = k) -> float | None:
            times = [e["time"] for e in later if pred(e)]
            return min(times) - k["time"] if times else None

        out.append(
            {
                **k,
                "to_first_step_s": first(lambda e: e["event"] == "start"),
                "to_heal_s": first(lambda e: e["event"] == "heal"),
                "to_commit_s": first(lambda e: e["event"] == "sync" and e.get("committed")),
            }
        )
    return out


def pick_final(finals: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The final model to score: the most committed outer steps, then the lowest group (0)."""
    return min(finals, key=lambda f: (-int(f["manager_step"]), int(f["group"])), default=None)


def summarize(
    events: list[dict[str, Any]], start: float, end: float, kills: list[dict[str, Any]], restarts: int
) -> dict[str, Any]:
    """The window's numbers from the workers' events (JSON-ready)."""
    window = max(1e-9, end - start)
    committed, trained = committed_in(events, start, end), trained_in(events, start, end)
    syncs = [e for e in events if e.get("event") == "sync" and start <= e["time"] <= end]
    done = rejoins(kills, events)
    heals = [k["to_heal_s"] for k in done if k["to_heal_s"] is not None]
    return {
        "window_s": end - start,
        "tokens_committed": committed,
        "tokens_trained": trained,
        "tokens_per_s": committed / window,
        "tokens_trained_per_s": trained / window,
        "committed_fraction": committed / trained if trained else None,
        "syncs": len(syncs),
        "syncs_committed": sum(1 for e in syncs if e.get("committed")),
        "heals": sum(1 for e in events if e.get("event") == "heal" and start <= e["time"] <= end),
        "kills": done,
        "restarts": restarts,
        "mean_rejoin_s": sum(heals) / len(heals) if heals else None,
        "curve": curve(events, start, end),
    }


def read_events(out_dir: Path, replicas: int) -> list[dict[str, Any]]:
    """Every complete JSON line of every group's progress.jsonl, by time."""
    events = []
    for g in range(replicas):
        try:
            lines = (out_dir / f"replica-{g}" / "progress.jsonl").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                events.append(json.loads(line))
            except ValueError:
                pass  # a torn last line (the writer was killed mid-write)
    return sorted(events, key=lambda e: e["time"])


# --------------------------------------------------------------------------- one run


def write_config(
    out_dir: Path,
    settings: dict[str, Any],
    replicas: int,
    fragments: int,
    eval_every_s: float,
    outer: tuple[float, float],
    throttle: float = 1.0,
) -> Path:
    config = out_dir / "config.json"
    config.write_text(
        json.dumps(
            {
                "settings": {k: v for k, v in settings.items() if k != "name"},
                "replicas": replicas,
                "fragments": fragments,
                "stop_file": str(out_dir / "stop"),
                "go_file": str(out_dir / "go"),
                "eval_every_s": eval_every_s,
                "outer_lr": outer[0],
                "outer_momentum": outer[1],
                "min_replicas": LIGHTHOUSE_OPTS["min_replicas"],
                "throttle": throttle,
            },
            indent=1,
        )
    )
    return config


def _wait_start(job: Job, deadline: float, delay_s: float) -> tuple[float, int]:
    """Until every group has trained a step: (window start, unexpected exits meanwhile). Once
    every group's Manager is up, the go file lets them all start training together."""
    crashed = 0
    while True:
        events = read_events(job.out_dir, job.replicas)
        if len({e["group"] for e in events if e["event"] == "boot"}) >= job.replicas:
            (job.out_dir / "go").touch()
        start = window_start(events, job.replicas)
        if start is not None:
            return start, crashed
        if time.time() > deadline:
            raise TimeoutError(
                f"torchft replicas not all training after {BOOT_TIMEOUT_S:g} s: "
                f"{tail(job.out_dir / 'replica-0' / 'worker-0.log')}"
            )
        crashed += job.tend(delay_s)
        if crashed > 2 * job.replicas:
            raise RuntimeError(f"torchft workers keep exiting: {tail(job.out_dir / 'replica-0' / 'worker-0.log')}")
        time.sleep(0.2)


def _window(
    job: Job, start: float, end: float, plan: list[tuple[float, int]], delay_s: float, deadline: float
) -> tuple[list[dict[str, Any]], int]:
    """Kill on schedule and restart until `end`: (kills done, unexpected exits)."""
    kills: list[dict[str, Any]] = []
    crashed = 0
    pending = list(plan)
    while time.time() < end:
        if time.time() > deadline:
            raise TimeoutError("run_torchft: timeout_s reached")
        while pending and time.time() >= start + pending[0][0]:
            done = job.kill(pending[0][1], delay_s)
            if done is None:
                break  # the victim is restarting: try again next poll
            kills.append({**done, "t": done["time"] - start, "scheduled_t": pending.pop(0)[0]})
        crashed += job.tend(delay_s)
        time.sleep(0.05)
    return kills, crashed


def _stop(job: Job) -> float:
    """Ask every worker to save its model and exit; wait for them (at most STOP_GRACE_S)."""
    stopped = time.time()
    (job.out_dir / "stop").touch()
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(p.alive() for p in job.workers.values()):
        time.sleep(0.1)
    return stopped


def _final_model(out_dir: Path, replicas: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Score the chosen replica's final global model with bench.evaluate (copied to OUT/final_model.pt)."""
    from bench import evaluate

    finals = []
    for g in range(replicas):
        try:
            finals.append(json.loads((out_dir / f"replica-{g}" / "final.json").read_text()))
        except (OSError, ValueError):
            pass
    chosen = pick_final(finals)
    if chosen is None:
        return {"eval_loss": None, "final_group": None, "final_manager_step": None}
    shutil.copyfile(out_dir / f"replica-{chosen['group']}" / "final_model.pt", out_dir / "final_model.pt")
    return {
        "eval_loss": evaluate.eval_file(out_dir / "final_model.pt", settings),
        "final_group": chosen["group"],
        "final_manager_step": chosen["manager_step"],
        "finals": len(finals),
    }


def run_torchft(
    settings: dict,
    replicas: int,
    out_dir: Path,
    *,
    duration_s: float,
    kill_schedule: Sequence[float] = (),
    seed: int = 0,
    restart_delay_s: float = 0.5,
    eval_every_s: float = 10.0,
    timeout_s: float | None = None,
    fragments: int | None = None,
    outer: tuple[float, float] = (OUTER_LR, OUTER_MOMENTUM),
    throttle: float = 1.0,
) -> dict:
    """Run torchft DiLoCo for a window of `duration_s` under `kill_schedule` (see the module docstring).

    `settings`: a `[run]` table (bench.fleet.diloco_run); `fragments` defaults to its "fragments".
    `out_dir` receives the run's files (a previous run's are removed). `throttle` > 1: each
    replica waits (throttle - 1) x its step's compute, as a dldctl learner host's throttle. Every
    process started here is stopped before this returns or raises (also on Ctrl-C).
    """
    out_dir = Path(out_dir).resolve()
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    fragments = int(fragments or settings.get("fragments") or 1)
    config = write_config(out_dir, settings, replicas, fragments, eval_every_s, outer, throttle)
    launched = time.time()
    deadline = launched + (timeout_s if timeout_s is not None else duration_s + BOOT_TIMEOUT_S + 120)
    job = Job(out_dir, config, replicas)
    try:
        job.start()
        start, crashed = _wait_start(job, min(deadline, launched + BOOT_TIMEOUT_S), restart_delay_s)
        plan = kill_plan(kill_schedule, replicas, seed)
        kills, more = _window(job, start, start + duration_s, plan, restart_delay_s, deadline)
        end = _stop(job)
    finally:
        leftovers = job.close()
    events = read_events(out_dir, replicas)
    res = summarize(events, start, end, kills, restarts=len(kills) + crashed + more)
    res.update(_final_model(out_dir, replicas, settings))
    res.update(
        {
            "unexpected_exits": crashed + more,
            "boot_s": start - launched,
            "kill_schedule": list(kill_schedule),
            "seed": seed,
            "replicas": replicas,
            "H": int(settings["H"]),
            "fragments": fragments,
            "outer": {"lr": outer[0], "momentum": outer[1], "nesterov": True},
            "lighthouse": LIGHTHOUSE_OPTS,
            "restart_delay_s": restart_delay_s,
            "settings": settings,
            "torchft": _version(),
            "pids_alive_after": leftovers,
            "out_dir": str(out_dir),
        }
    )
    return {**res, "clean_tokens_per_s": res["tokens_per_s"]} if not kill_schedule else res


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchft")
    except PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- CLI


def _extra(parser: Any) -> None:
    parser.add_argument("--duration", type=float, default=None, help="window D in seconds (default 100, quick 30)")
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument("--mtbf", type=float, default=20.0, help="mean seconds between kills (0 = no kills)")
    parser.add_argument("--seed", type=int, default=1, help="kill schedule and victim seed")
    parser.add_argument("--replicas", type=int, default=REPLICAS)
    from bench import common

    common.add_set_option(parser, "[run] overrides, e.g. fragments=1")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs' files here")


def schedule_for(duration: float, mtbf: float, seed: int, quick: bool) -> list[float]:
    """failure_schedule(duration, mtbf, seed); --quick: one kill mid-window, as ddp_baseline --quick."""
    from bench.ddp_baseline import failure_schedule

    if mtbf <= 0:
        return []
    return [round(0.5 * duration, 3)] if quick else failure_schedule(duration, mtbf, seed)


def row(case: str, r: dict[str, Any]) -> dict[str, Any]:
    return {
        "case": case,
        "window_s": r["window_s"],
        "kills": len(r["kills"]),
        "restarts": r["restarts"],
        "tokens committed": r["tokens_committed"],
        "tokens trained": r["tokens_trained"],
        "committed tok/s": r["tokens_per_s"],
        "trained tok/s": r["tokens_trained_per_s"],
        "syncs ok/all": f"{r['syncs_committed']}/{r['syncs']}",
        "rejoin s": r["mean_rejoin_s"] if r["mean_rejoin_s"] is not None else "-",
        "eval loss": r["eval_loss"] if r["eval_loss"] is not None else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    from bench import common
    from bench.fleet import diloco_run

    args = common.parse_args("torchft_diloco", __doc__, _extra, argv)
    duration = args.duration or (30.0 if args.quick else 100.0)
    settings = diloco_run(args.H, **common.overrides(args.set))
    schedule = schedule_for(duration, args.mtbf, args.seed, args.quick)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="torchft_diloco_"))
    try:
        clean = run_torchft(settings, args.replicas, workdir / "clean", duration_s=duration, seed=args.seed)
        failing = (
            run_torchft(
                settings, args.replicas, workdir / "kills", duration_s=duration, kill_schedule=schedule, seed=args.seed
            )
            if schedule
            else None
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    rows = [row("torchft DiLoCo, no failures", clean)]
    ratio = failing["tokens_per_s"] / clean["tokens_per_s"] if failing and clean["tokens_per_s"] else None
    if failing is not None:
        rows.append(row(f"torchft DiLoCo, {len(schedule)} kills", failing))
    common.print_table(
        f"torchft {clean['torchft']} DiLoCo: {args.replicas} replica groups, {settings['model']}, "
        f"H={args.H}, {clean['fragments']} fragments, window {duration:g} s, kills at {schedule}",
        rows,
    )
    if ratio is not None:
        print(f"committed tokens/s under kills = {ratio:.2f} x clean")
    common.write_json(
        args.out,
        {
            "benchmark": "torchft_diloco",
            "quick": args.quick,
            "duration_s": duration,
            "mtbf_s": args.mtbf,
            "seed": args.seed,
            "schedule": schedule,
            "settings": settings,
            "clean_tokens_per_s": clean["tokens_per_s"],
            "kills_vs_clean": ratio,
            "rows": rows,
            "runs": {"clean": clean, "kills": failing},
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
