"""The real runs that `bench/sim_from_run.py` fits on and predicts (issue 53): collected once, kept.

Two families, each run's directory copied (its records only: events, metrics, config, inventory,
state) under `--out` (default `$TMPDIR/dld-pilot-runs`), with `runs.json` saying what each was:

- **goodput** (`--goodput`): the local fleet (half its learners on a host throttled to half speed,
  gpt-tiny as bench/fleet.py's WORKLOAD, H = 32) under the chaos monkey (`dldctl chaos monkey
  --actions kill,pause --fault-duration 5s`) for `--window` seconds from the whole fleet's first
  step: 4 learners with a fault every 10, 20 and 40 s on average, and 2 and 6 learners at 20 s.
  Each run has its own monkey seed.
- **wire** (`--wire`): Decoupled DiLoCo in bench/race.py's 4 network-namespace sites (gpt-small,
  the defaults, SSH into each site) with every site's link capped at 100, 10 and 1 Mbit/s, for
  `--race-window` seconds from the first step.

    .venv/bin/python bench/pilot_runs.py --goodput --wire       # ~40 min on 2 cores
    .venv/bin/python bench/pilot_runs.py --goodput --window 60   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fleet import BenchRun, Plan, diloco_run, local_host, run_diloco

KEEP = ("events.jsonl", "metrics.jsonl", "config.json", "inventory.json", "inventory.toml", "state.json")
# (name, learners, mean seconds between faults, monkey seed)
GOODPUT_RUNS = (
    ("m4_mtbf20", 4, 20.0, 21),
    ("m4_mtbf10", 4, 10.0, 11),
    ("m4_mtbf40", 4, 40.0, 41),
    ("m2_mtbf20", 2, 20.0, 22),
    ("m6_mtbf20", 6, 20.0, 26),
)
# (rate per site, whether the syncer's egress to all sites shares one cap at that rate, as in
# bench/race.py): at 1 Mbit/s a shared cap holds every learner's join (the full state, ~10 MB
# each, through one 1 Mbit/s link) past `up --wait`'s 5 minutes, so there only the sites' own
# links are capped
RACE_RATES = (("100mbit", True), ("10mbit", True), ("1mbit", False))
JOIN_RATE = "100mbit"  # the 1 Mbit/s run joins at this rate, then its links drop to 1 Mbit/s
FAULT_S = 5.0
ACTIONS = "kill,pause"


def copy_run(run_dir: Path, dest: Path) -> None:
    """A run's records (not its checkpoints, models or logs) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in KEEP:
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, dest / name)


def _only_run(home: Path) -> Path:
    (run_dir,) = [p for p in (home / "runs").iterdir() if p.is_dir()]
    return run_dir


def goodput_run(name: str, learners: int, mtbf: float, seed: int, window: float, out: Path) -> dict[str, Any]:
    """One local fleet under the monkey; its records copied to out/name."""
    fast = learners // 2
    hosts = [local_host("fast", fast), local_host("slow", learners - fast, throttle=2.0)]

    def chaos(fleet: BenchRun, start: float, stop: threading.Event) -> dict[str, Any]:
        return fleet.monkey(mtbf, window, seed, ACTIONS, stop, fault_duration=FAULT_S)

    def keep(fleet: BenchRun) -> str:
        copy_run(_only_run(fleet.home), out / name)
        return str(out / name)

    plan = Plan(name, diloco_run(32), hosts, learners=learners, duration_s=window, chaos=chaos, inspect=keep)
    res = run_diloco(plan)
    return {
        "family": "goodput",
        "learners": learners,
        "mtbf_s": mtbf,
        "seed": seed,
        "actions": ACTIONS,
        "fault_s": FAULT_S,
        "window": res["window"],
        "injected": (res.get("chaos") or {}).get("injected"),
        "eval_loss": res["eval_loss"],
        "dir": res["inspect"],
    }


def wire_runs(window: float, out: Path, rates: set[str]) -> dict[str, Any]:
    """Decoupled DiLoCo in the race's sites at each rate; records copied to out/race_<rate>."""
    from bench import race
    from bench.sites import Sites

    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"dld-pilot-race-{os.getpid()}"
    done: dict[str, Any] = {}
    try:
        for rate, shared in RACE_RATES:
            if rates and rate not in rates:
                continue
            cap = rate if shared else None
            if shared:
                with Sites(work / f"sites-{rate}", race.SITES, rate=rate, operator_rate=cap, prefix="dlp") as sites:
                    res = race.run_fleet(sites, race.STRATEGIES[2], window, work / rate)
            else:  # a join (the full state) at 1 Mbit/s outlasts `up --wait`: join faster, then thin
                with Sites(work / f"sites-{rate}", race.SITES, rate=JOIN_RATE, prefix="dlp") as sites:
                    res = thinned_fleet(sites, rate, window, work / rate)
            name = f"race_{rate}"
            copy_run(_only_run(work / rate / "decoupled" / "home"), out / name)
            info = {"family": "wire", "rate": rate, "syncer_link": "same" if shared else "none", "window_s": window}
            done[name] = {**info, "dir": str(out / name), **res}
            print(f"{name}: blocked {res['blocked_share']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return done


def thinned_fleet(sites: Any, rate: str, window: float, work: Path) -> dict[str, Any]:
    """bench/race.py's Decoupled DiLoCo fleet, every site's link set to `rate` once it trains."""
    from bench import race

    def thin() -> None:
        for h in sites.hosts:
            sites.set_rate(h, rate)

    return {**race.run_fleet(sites, race.STRATEGIES[2], window, work, on_start=thin), "joined_at": JOIN_RATE}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--goodput", action="store_true", help="the local fleets under the monkey")
    parser.add_argument("--wire", action="store_true", help="Decoupled DiLoCo in the sites at 100, 10, 1 Mbit/s")
    parser.add_argument("--window", type=float, default=240.0, help="seconds under the monkey per run")
    parser.add_argument("--race-window", type=float, default=150.0, help="seconds of training per race run")
    parser.add_argument("--only", default="", help="comma-separated goodput run names")
    parser.add_argument("--rates", default="", help="comma-separated race rates (default: all)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "dld-pilot-runs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    index = args.out / "runs.json"
    runs: dict[str, Any] = json.loads(index.read_text()) if index.exists() else {}
    only = {n for n in args.only.split(",") if n}
    if args.goodput:
        for name, learners, mtbf, seed in GOODPUT_RUNS:
            if only and name not in only:
                continue
            runs[name] = goodput_run(name, learners, mtbf, seed, args.window, args.out)
            index.write_text(json.dumps(runs, indent=1))
            print(f"{name}: goodput {runs[name]['window']['goodput']:.3f}, {runs[name]['injected']} faults", flush=True)
    if args.wire:
        runs.update(wire_runs(args.race_window, args.out, {r for r in args.rates.split(",") if r}))
        index.write_text(json.dumps(runs, indent=1))
    print(f"wrote {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
