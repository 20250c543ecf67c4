"""Benchmark: `dldctl simulate --from-run` against held-out real runs (issue 53).

The runs are bench/pilot_runs.py's (collected once; their records kept). Each prediction is the
real command a user runs, on one run's records, for another run's fleet:

- **goodput**: fitted on one local fleet under the chaos monkey (4 learners, 2 at half speed, a
  fault every 10 s: the pilot that sees the most faults, spare waits included), predicting the
  others (a fault every 20 and 40 s; 2 and 6 learners at 20 s):
  `dldctl simulate goodput --from-run FIT --learners M --mtbf X --duration W --seeds 200 --json`,
  where M, X and W are the held-out run's learners, monkey rate and measured window. Measured: the
  held-out run's goodput over its window, as the same reader (dldctl/observe/pilotrun.py) takes
  it for a pilot. Also shown: every run fitted on every other (the matrix), and the prediction
  for the faults the held-out run's own seeded monkey drew (`--monkey-seed S --actions kill,pause`:
  the monkey's schedule, drawn as it draws it; the fit's costs) to separate the
  model's error from the luck of the draw. Target: within 3 points on every held-out run.
- **the wire**: fitted on Decoupled DiLoCo in the race's 4 sites at 100 Mbit/s per site,
  predicting 10 and 1 Mbit/s: `dldctl simulate bandwidth --from-run FIT --link RATE
  --syncer-link same --target-loss L --json` (the race caps the syncer's egress to all sites at the
  same rate). L: data-parallel's final eval loss at 100 Mbit/s in bench/results/race.json.
  Measured: each run's learners' blocked share and time from the first step to L.
  Targets: within 10% (blocked share within 2 points).

    .venv/bin/python bench/pilot_runs.py --goodput --wire     # the runs, ~40 min on 2 cores
    .venv/bin/python bench/sim_from_run.py --runs /tmp/dld-pilot-runs   # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common
from dldctl.observe import pilotrun
from dldctl.rundir import RunDir

FIT = "m4_mtbf10"  # the pilot under the heaviest chaos: 35 faults, 11 kills that waited for a spare
WIRE_FIT = "race_100mbit"
SEEDS = 200


def dldctl(*args: str) -> dict[str, Any]:
    """The real command's JSON answer."""
    cmd = [sys.executable, "-m", "dldctl", *args, "--json"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def measured(path: Path, target: float | None = None) -> pilotrun.Pilot:
    return pilotrun.measure(pilotrun.read(RunDir(path)), target)


def predict(fit: Path, held: pilotrun.Pilot, run: dict[str, Any], *extra: str) -> dict[str, Any]:
    """`simulate goodput --from-run FIT` for the held-out run's fleet, monkey rate and window."""
    h = held.goodput
    args = ["--learners", str(h.learners), "--mtbf", f"{run['mtbf_s']:g}s", "--duration", f"{h.window_s:.1f}s"]
    args += ["--seeds", str(SEEDS), "--per-host", str(max(1, h.learners // 2)), *extra]
    return dict(dldctl("simulate", "goodput", "--from-run", str(fit), *args)["prediction"]["goodput"])


def goodput_rows(runs: dict[str, Any], root: Path) -> list[dict[str, Any]]:
    """One row per (fit, held-out) pair of goodput runs (bench/pilot_runs.py puts half of a fleet
    on each of its two hosts: --per-host is the held-out run's). "its monkey": the prediction for
    the faults the held-out run's seeded monkey drew (`--monkey-seed`, `--actions`)."""
    names = [n for n, r in runs.items() if r["family"] == "goodput"]
    pilots = {n: measured(root / n) for n in names}
    rows = []
    for fit in names:
        for held in names:
            if held == fit:
                continue
            run, h = runs[held], pilots[held].goodput
            pred = predict(root / fit, pilots[held], run)
            own = predict(root / fit, pilots[held], run, "--monkey-seed", str(run["seed"]), "--actions", run["actions"])
            rows.append(
                {
                    "fit": fit,
                    "held out": held,
                    "faults seen": len(pilots[held].faults),
                    "measured": h.goodput,
                    "predicted": pred["mean"],
                    "p10": pred["p10"],
                    "p90": pred["p90"],
                    "error points": 100 * (pred["mean"] - h.goodput),
                    "its monkey": own["mean"],
                    "its monkey error points": 100 * (own["mean"] - h.goodput),
                }
            )
    return rows


def wire_rows(runs: dict[str, Any], root: Path, target: float) -> list[dict[str, Any]]:
    """The wire runs predicted from the fit's records."""
    rows = []
    for name, run in runs.items():
        if run["family"] != "wire" or name == WIRE_FIT:
            continue
        held = measured(root / name, target).wire
        pred = dldctl(
            "simulate",
            "bandwidth",
            "--from-run",
            str(root / WIRE_FIT),
            "--link",
            run["rate"],
            "--syncer-link",
            run.get("syncer_link", "same"),
            "--target-loss",
            f"{target}",
        )["predictions"][0]
        t_meas, t_pred = held.time_to_target_s, pred["time_to_target_s"]
        rows.append(
            {
                "rate": run["rate"],
                "blocked measured": held.blocked,
                "blocked predicted": pred["blocked"],
                "blocked error points": 100 * (pred["blocked"] - held.blocked),
                "time to loss measured s": t_meas,
                "time to loss predicted s": t_pred,
                "time error": (t_pred - t_meas) / t_meas if t_meas and t_pred else None,
            }
        )
    return rows


def verdict(goodput: list[dict[str, Any]], wire: list[dict[str, Any]]) -> dict[str, Any]:
    main = [r for r in goodput if r["fit"] == FIT]
    worst = max((abs(r["error points"]) for r in main), default=None)
    blocked = max((abs(r["blocked error points"]) for r in wire), default=None)
    times = [abs(r["time error"]) for r in wire if r["time error"] is not None]
    return {
        f"goodput fitted on {FIT}: worst error, points (target <= 3)": worst,
        f"goodput fitted on {FIT}, each run's own monkey: worst error, points": max(
            (abs(r["its monkey error points"]) for r in main), default=None
        ),
        f"goodput fitted on {FIT}: held-out runs inside the p10-p90 band": sum(
            1 for r in main if r["p10"] <= r["measured"] <= r["p90"]
        ),
        "every pair: worst error, points": max((abs(r["error points"]) for r in goodput), default=None),
        "wire: worst blocked-share error, points (target <= 2)": blocked,
        "wire: worst time-to-loss error (target <= 10%)": max(times) if times else None,
        "wire: runs that reached the loss": f"{len(times)} of {len(wire)}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "dld-pilot-runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sim_from_run.json")
    args = parser.parse_args(argv)
    runs = json.loads((args.runs / "runs.json").read_text())
    race = json.loads((ROOT / "bench" / "results" / "race.json").read_text())
    target = next(r["DP's final loss here"] for r in race["rows"] if r["rate"] == "100mbit")
    good = goodput_rows(runs, args.runs)
    wire = wire_rows(runs, args.runs, target)
    common.print_table(f"goodput, fitted on {FIT} (the others: JSON)", [r for r in good if r["fit"] == FIT])
    common.print_table(f"the wire, fitted on {WIRE_FIT}; loss {target:.4f}", wire)
    result = {"runs": runs, "target_loss": target, "goodput": good, "wire": wire, "verdict": verdict(good, wire)}
    print(json.dumps(result["verdict"], indent=1))
    common.write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
