"""Benchmark: the full `dldctl simulate goodput` sweep (5 chip counts x 5 learner counts).

Measures, in one run on this machine:
- the core sweep (dldctl.sim.montecarlo.sweep) with the default fleet parameters;
- the same sweep end to end through the CLI (`python -m dldctl simulate goodput --sweep ... --plot`),
  interpreter start-up and PNG included: this is the number the issue's 30 s target is about;
- the baseline: a naive per-chip simulation (every chip draws its own exponential lifetimes in a
  Python loop) of the smallest fleet, its result checked against the event-based one, and its
  cost extrapolated to every chip the full sweep simulates.

Prints a table and writes bench/results/simulate_sweep.json (with the machine, command and time).

    .venv/bin/python bench/simulate_sweep.py [--seeds 10] [--hours 24]
    .venv/bin/python bench/simulate_sweep.py --quick      # 3 seeds
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common
from dldctl.sim.goodput import ELASTIC, FleetParams, elastic_timeline
from dldctl.sim.montecarlo import monte_carlo, sweep

CHIPS = [150_000, 300_000, 600_000, 1_200_000, 2_400_000]
LEARNERS = [1, 2, 4, 8, 16]
TARGET_S = 30.0


def time_core(base: FleetParams, seeds: list[int]) -> tuple[float, list]:
    start = time.perf_counter()
    results = sweep(base, CHIPS, LEARNERS, seeds)
    return time.perf_counter() - start, results


def time_cli(seeds: int, hours: float) -> float:
    """The sweep as an operator runs it, start-up and plot included."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "dldctl",
            "simulate",
            "goodput",
            "--sweep",
            "chips=" + ",".join(map(str, CHIPS)),
            "--learners",
            ",".join(map(str, LEARNERS)),
            "--seeds",
            str(seeds),
            "--hours",
            f"{hours:g}",
            "--plot",
            str(Path(tmp) / "sweep.png"),
            "--json",
        ]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"CLI sweep failed: {proc.stderr.strip()}")
    return wall


def naive_failure_times(chips: int, mtbi_s: float, horizon_s: float, rng: random.Random) -> np.ndarray:
    """Every chip on its own: exponential lifetimes until the horizon, one Python loop per chip."""
    out = []
    for _ in range(chips):
        t = rng.expovariate(1.0 / mtbi_s)
        while t < horizon_s:
            out.append(t)
            t += rng.expovariate(1.0 / mtbi_s)
    return np.sort(np.array(out))


def naive_baseline(base: FleetParams, seeds: list[int]) -> dict:
    """Elastic job on the smallest fleet, failures drawn chip by chip; same accounting after."""
    # Per-chip exponential lifetimes are the constant-rate process: compare at rate_cv = 0.
    fleet = replace(base, chips=CHIPS[0], rate_cv=0.0)
    goodputs, start = [], time.perf_counter()
    for seed in seeds:
        t = naive_failure_times(fleet.chips, fleet.mtbi_s, fleet.horizon_s, random.Random(seed))
        lost = np.random.default_rng(seed).uniform(0.0, fleet.step_time_s, size=t.size)
        unit = elastic_timeline(fleet.chips, fleet.reconfig_s, fleet, t, lost)
        goodputs.append(unit.useful_chip_s / (fleet.chips * fleet.horizon_s))
    wall = time.perf_counter() - start
    per_chip_s = wall / (fleet.chips * len(seeds))
    # The full sweep simulates each chip count once per strategy run: data-parallel, elastic,
    # and DiLoCo at every learner count, for every seed.
    chip_runs = sum(CHIPS) * (2 + len(LEARNERS)) * len(seeds)
    return {
        "method": "naive per-chip exponential draws (Python loop), elastic accounting",
        "chips": fleet.chips,
        "seeds": len(seeds),
        "wall_s": wall,
        "per_chip_us": per_chip_s * 1e6,
        "goodput_mean": float(np.mean(goodputs)),
        "event_goodput_same_fleet": monte_carlo(fleet, seeds, [ELASTIC])[0].goodput.mean,
        "estimated_full_sweep_s": per_chip_s * chip_runs,
    }


def print_table(results: list, seeds: int) -> None:
    labels: dict[str, dict[int, float]] = {}
    for s in results:
        label = f"DiLoCo M={s.learners}" if s.learners else s.strategy.replace("_", " ")
        labels.setdefault(label, {})[s.chips] = s.goodput.mean
    print(f"goodput, mean of {seeds} seeds")
    print(f"{'strategy':<24}" + "".join(f"{n:>12,}" for n in CHIPS))
    for label, cells in labels.items():
        print(f"{label:<24}" + "".join(f"{cells[n]:>12.3f}" for n in CHIPS))


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=None, help="Monte Carlo seeds (default 10, quick 3)")
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--baseline-seeds", type=int, default=3)


def main(argv: list[str] | None = None) -> None:
    args = common.parse_args("simulate_sweep", __doc__, _extra, argv)
    args.seeds = args.seeds or (3 if args.quick else 10)
    seeds = list(range(args.seeds))
    base = FleetParams(chips=max(CHIPS), learners=max(LEARNERS), horizon_s=args.hours * 3600.0)

    core_s, results = time_core(base, seeds)
    cli_s = time_cli(args.seeds, args.hours)
    baseline = naive_baseline(base, list(range(args.baseline_seeds)))
    event_goodput = baseline["event_goodput_same_fleet"]
    failures = sum(s.failures.mean * s.failures.n for s in results)

    print_table(results, args.seeds)
    print()
    print(f"{'measure':<44}{'seconds':>10}")
    print(f"{'core sweep (' + str(args.seeds) + ' seeds)':<44}{core_s:>10.2f}")
    print(f"{'CLI sweep end to end, with --plot':<44}{cli_s:>10.2f}")
    print(f"{'target':<44}{TARGET_S:>10.2f}")
    print(f"{'baseline: naive per-chip, ' + format(CHIPS[0], ',') + ' chips':<44}{baseline['wall_s']:>10.2f}")
    print(f"{'baseline extrapolated to the full sweep':<44}{baseline['estimated_full_sweep_s']:>10.1f}")
    print(
        f"failures simulated: {failures:,.0f}; CLI / target = {cli_s / TARGET_S:.3f}; "
        f"naive elastic goodput {baseline['goodput_mean']:.3f} vs event-based {event_goodput:.3f} "
        "(both at a constant failure rate)"
    )

    payload = {
        "benchmark": "simulate_sweep",
        "chips": CHIPS,
        "learners": LEARNERS,
        "seeds": args.seeds,
        "hours": args.hours,
        "core_wall_s": core_s,
        "cli_wall_s": cli_s,
        "target_s": TARGET_S,
        "cli_ratio_to_target": cli_s / TARGET_S,
        "failures_simulated": failures,
        "event_goodput_smallest_elastic": event_goodput,
        "baseline": baseline,
        "quick": args.quick,
        "numpy": np.__version__,
        "results": [s.to_dict() for s in results],
    }
    common.write_json(args.out, payload)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
