"""Benchmark: the wall-clock race across emulated wide-area sites (bench/sites.py).

The same model and data, trained three ways by 4 sites (network namespaces, one learner or rank
each) whose links are capped at 1 Gbit/s, 100 Mbit/s and 10 Mbit/s per site, each direction:

- data-parallel: torchrun with gloo, one rank per site (`--nnodes 4`, rank 0's store in site 1),
  every step's fp32 gradients all-reduced across the shaped links (bench/ddp_worker.py, "flat":
  an explicit all-reduce after backward, so every second of it is plainly blocked time);
- synchronous DiLoCo: `dldctl up` over SSH into the sites, `quorum = 4`, `overlap = false`;
- Decoupled DiLoCo: the same with the tuning guide's recipe (dldctl's defaults: int4, H = 32,
  quorum 1, overlap, grace, the syncer's round clock, rebase).

The syncer runs in the operator's (root) namespace; each site reaches it over its own capped
veth, and the syncer's own egress to all the sites shares one more cap at the same rate (an ifb:
its link to the fleet is the busiest). Sites talk to each other (the data-parallel ring) through
the operator's namespace, which forwards for that run (ip_forward is restored after); that run
has no aggregate cap, which would turn its ring into one shared hub. Bandwidth is emulated, latency
is not (this kernel has no netem): the links add at most ~50 ms of queueing.

Each run gets the same wall-clock window, counted from its first training step (data-parallel:
the first step of rank 0; DiLoCo: `up --wait` returning once the fleet merges), so start-up is
not raced. Measured: the eval loss over wall-clock (data-parallel: rank 0's held-out eval every
few steps; DiLoCo: the syncer's score of the global model, `global_eval`), the time to reach
data-parallel's final eval loss at 1 Gbit/s (the target), the bytes each site's link carried
(its veth's counters), peak (1 s) and mean utilisation of the busiest link, and the learners'
share of time blocked on communication.

    .venv/bin/python bench/race.py --quick      # 3 rates x 3 ways, 40 s windows (~12 min)
    .venv/bin/python bench/race.py              # 120 s windows (~30 min): BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import overrides
from bench.ddp_baseline import WORKER, job_env, read_progress
from bench.fleet import WORKLOAD, diloco_run
from bench.sites import Sites, rate_bits
from dldctl.testing import DldctlHome, inventory_text
from syncer.common.settings import LINK_PRESETS

RATES = ("1gbit", "100mbit", "10mbit")
SITES = 4
SETTINGS: dict[str, Any] = {**WORKLOAD, "model": "gpt-small", "seq_len": 64, "batch_size": 8, "eval_batches": 8}
FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
RESULTS = ROOT / "bench" / "results"


@contextmanager
def forwarding() -> Iterator[None]:
    """The root namespace forwards between the sites' veths for the race, then as it was."""
    before = FORWARD.read_text().strip()
    FORWARD.write_text("1")
    try:
        yield
    finally:
        FORWARD.write_text(before)


class Meter(threading.Thread):
    """Each site's link counters every second: totals, and the busiest second of the busiest link."""

    def __init__(self, sites: Sites) -> None:
        super().__init__(daemon=True)
        self.sites, self.stop = sites, threading.Event()
        self.first = {h.name: sites.counters(h) for h in sites.hosts}
        self.peak_bits = 0.0

    def run(self) -> None:
        last = dict(self.first)
        while not self.stop.wait(1.0):
            for h in self.sites.hosts:
                now = self.sites.counters(h)
                busiest = max(now[k] - last[h.name][k] for k in ("tx_bytes", "rx_bytes")) * 8.0
                self.peak_bits, last[h.name] = max(self.peak_bits, busiest), now

    def finish(self, window_s: float, rate: str) -> dict[str, Any]:
        self.stop.set()
        self.join(timeout=5)
        links = {}
        for h in self.sites.hosts:
            now = self.sites.counters(h)
            links[h.name] = {k: now[k] - self.first[h.name][k] for k in ("tx_bytes", "rx_bytes")}
        busiest = max(max(v.values()) for v in links.values())
        cap = rate_bits(rate)
        return {
            "link_bytes": links,
            "bytes_total": sum(sum(v.values()) for v in links.values()),
            "peak_util": self.peak_bits / cap,
            "mean_util": busiest * 8.0 / max(window_s, 1e-9) / cap,
        }


def run_dp(sites: Sites, wall_s: float, work: Path, eval_every: int = 10, first_step_s: float = 180) -> dict[str, Any]:
    """Data-parallel across the sites: one torchrun agent (one rank) inside each namespace; its
    window starts at its first step, which may take `first_step_s` (DDP's first broadcast of the
    model and the first all-reduce cross the links)."""
    out = work / "dp"
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.json"
    doc = {"settings": SETTINGS, "duration_s": wall_s + 60.0, "started_at": time.time(), "eval_every": eval_every}
    config.write_text(json.dumps({**doc, "checkpoint_every_s": 1e9, "threads": 1, "reducer": "flat"}))
    env = {**job_env(1), "GLOO_SOCKET_IFNAME": "eth0"}
    master = sites.hosts[0].address
    procs = []
    for rank, h in enumerate(sites.hosts):
        argv = ["ip", "netns", "exec", h.namespace, sys.executable, "-m", "torch.distributed.run"]
        argv += [f"--nnodes={SITES}", f"--node-rank={rank}", "--nproc-per-node=1", f"--master-addr={master}"]
        argv += ["--master-port=29533", "--max-restarts=0", str(WORKER), "--config", str(config), "--out", str(out)]
        log = open(out / f"rank{rank}.log", "wb")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True), log))
    try:
        start = _wait_for(lambda: _first(read_progress(out), "start"), first_step_s, "data-parallel's first step")
        meter = Meter(sites)
        meter.start()
        time.sleep(max(0.0, start + wall_s - time.time()))
        links = meter.finish(wall_s, sites.rates["site1"])
        events = read_progress(out)
    finally:
        for proc, log in procs:
            _stop_group(proc)
            log.close()
    evals = [(e["time"] - start, e["eval_loss"]) for e in events if e.get("event") == "eval" and e["time"] >= start]
    last = events[-1] if events else {}
    compute, blocked = float(last.get("compute_s", 0.0)), float(last.get("blocked_s", 0.0))
    return {"curve": evals, "blocked_share": blocked / (compute + blocked) if compute + blocked else None, **links}


def _first(events: list[dict[str, Any]], kind: str) -> float | None:
    times = [e["time"] for e in events if e.get("event") == kind]
    return min(times) if times else None


def _wait_for(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"no {what} within {timeout:.0f} s")


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the agent's process group, then SIGKILL (ours: started with start_new_session)."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def fleet_settings(strategy: str) -> dict[str, Any]:
    """The [run] table of a DiLoCo strategy: synchronous, the recipe (dldctl's defaults), or the
    recipe with `link = "thin"` (THIN: the preset's own keys, as the inventory loader fills them in)."""
    words = strategy.split()  # trailing KEY=VALUE words: settings on top ("Decoupled DiLoCo thin H=16")
    on_top = overrides([w for w in words if "=" in w])  # typed like [run]; an unknown key is refused
    strategy = " ".join(w for w in words if "=" not in w)
    common = {**SETTINGS, "global_eval_every": 4, "warm_spares": False, "heartbeat_s": 0.5}
    H = int(on_top.pop("H", 32))
    if strategy == "synchronous DiLoCo":
        return diloco_run(H, quorum=SITES, overlap=False, outer_lr=0.7, outer_momentum=0.9, **common, **on_top)
    if strategy == THIN:
        return diloco_run(H, **{**common, **LINK_PRESETS["thin"], "link": "thin", **on_top})
    return diloco_run(H, **common, **on_top)


def home_name(strategy: str) -> str:
    """A strategy's directory and run name: its first word and any after "DiLoCo" ("decoupled-thin-h16")."""
    words = strategy.lower().replace("=", "").split()
    return "-".join([words[0], *words[2:]])


def fleet_start(samples: list[dict[str, Any]]) -> float | None:
    """When the fleet took its first step: the first sample in which a learner trained, less the
    time its steps took at its rate (the learners report their step and tokens/s)."""
    for sample in samples:
        learners = [v for v in (sample.get("learners") or {}).values() if v.get("step") and v.get("tokens_per_s")]
        if learners:
            return float(sample["t"]) - max(v["tokens"] / v["tokens_per_s"] for v in learners)
    return None


def fleet_curve(evals: list[dict[str, Any]], start: float, wall_s: float) -> list[tuple[float, float]]:
    """The global model's scores from the fleet's first step, within the window."""
    return [(r["t"] - start, r["loss"]) for r in evals if start <= r["t"] <= start + wall_s]


def rebuild_fleets(runs: dict[str, dict[str, Any]], workdir: Path, wall_s: float) -> None:
    """The DiLoCo curves of an earlier race again, from its run directories (curves counted from
    the fleet's first step, as `run_fleet` counts them now)."""
    for key, res in runs.items():
        rate, strategy = key.split("|")
        if strategy == STRATEGIES[0]:
            continue
        (run_dir,) = (workdir / rate / home_name(strategy) / "home" / "runs").iterdir()
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        start = fleet_start([r for r in records if r.get("kind") == "sample"])
        if start is not None:
            res["curve"] = fleet_curve([r for r in records if r.get("kind") == "global_eval"], start, wall_s)


def run_fleet(
    sites: Sites, strategy: str, wall_s: float, work: Path, on_start: Callable[[], object] | None = None
) -> dict[str, Any]:
    """A DiLoCo fleet in the sites through the real `dldctl up` over SSH; `on_start` is called
    once it trains, before its window (bench/pilot_runs.py thins the links there)."""
    home = work / home_name(strategy)
    run = {"name": home.name, **fleet_settings(strategy)}
    syncer = f'\n[syncer]\nbind = "0.0.0.0"\nadvertise = "{sites.advertise}"\n\n'
    inv = home / "inventory.toml"
    home.mkdir(parents=True, exist_ok=True)
    inv.write_text(inventory_text(run) + syncer + sites.inventory_hosts(work / "remote"))
    with DldctlHome(home / "home") as dl:
        dl("up", str(inv), "-d", "--wait", "--timeout", "300", timeout=420)
        meter = Meter(sites)
        meter.start()
        start = _wait_for(lambda: fleet_start(dl.metrics("sample")), 60, "the fleet's first step")
        if on_start is not None:
            on_start()
            start = time.time()
        time.sleep(max(0.0, start + wall_s - time.time()))
        links = meter.finish(wall_s, sites.rates["site1"])
        snap = dl.status()
        curve = fleet_curve(dl.metrics("global_eval"), start, wall_s)
        dl.down()
    blocked = [r.get("blocked_frac") for r in snap.get("learners", []) if r.get("blocked_frac") is not None]
    return {"curve": curve, "blocked_share": sum(blocked) / len(blocked) if blocked else None, **links}


STRATEGIES = ("data-parallel", "synchronous DiLoCo", "Decoupled DiLoCo")
THIN = "Decoupled DiLoCo thin"  # link = "thin" (bench/race_thin.py: the race at 1 Mbit/s)


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first time the curve is at or below `target` (None: not within the window)."""
    return next((t for t, loss in curve if loss is not None and loss <= target), None)


def final_loss(curve: list[tuple[float, float]]) -> float | None:
    return curve[-1][1] if curve else None


def rows(runs: dict[str, dict[str, Any]], wall_s: float) -> list[dict[str, Any]]:
    """One row per rate and strategy. The target at a rate is data-parallel's final eval loss at
    that rate (where its window ended); `DP 1gbit target` is its final loss on the fastest link."""
    best_target = final_loss(runs.get(f"{RATES[0]}|data-parallel", {}).get("curve", []))
    out = []
    for key, res in runs.items():
        rate, strategy = key.split("|")
        dp = runs.get(f"{rate}|data-parallel", {}).get("curve", [])
        target = final_loss(dp)
        reach = time_to(res["curve"], target) if target is not None else None
        dp_reach = time_to(dp, target) if target is not None else None
        fast = time_to(res["curve"], best_target) if best_target is not None else None
        out.append(
            {
                "rate": rate,
                "strategy": strategy,
                "eval loss at window end": final_loss(res["curve"]),
                "DP's final loss here": target,
                "time to it s": reach,
                "x sooner than DP": _speedup(dp_reach, reach, wall_s),
                "time to DP 1gbit target s": fast,
                "GB moved": res["bytes_total"] / 1e9,
                "peak util": res["peak_util"],
                "mean util": res["mean_util"],
                "blocked": res["blocked_share"],
            }
        )
    return out


def _speedup(dp_reach: float | None, reach: float | None, wall_s: float) -> str | None:
    """DP's time to the target over ours; '>= W/ours' when DP never got there in the window."""
    if reach is None or reach <= 0:
        return None
    if dp_reach is None:
        return f">= {wall_s / reach:.1f}"
    return f"{dp_reach / reach:.1f}"


def verdict(table: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, each MET or MISSED with the measured numbers."""
    by = {(r["rate"], r["strategy"]): r for r in table}

    def ratio(rate: str, strategy: str) -> float | None:
        value = (by.get((rate, strategy)) or {}).get("x sooner than DP")
        return float(str(value).lstrip(">= ")) if value else None

    dec_10, sync_10 = by.get(("10mbit", STRATEGIES[2]), {}), by.get(("10mbit", STRATEGIES[1]), {})
    key = "time to DP 1gbit target s"  # a target both DiLoCos reach: time to it, synchronous over decoupled
    vs_sync = sync_10[key] / dec_10[key] if dec_10.get(key) and sync_10.get(key) else None
    blocked = [r["blocked"] for r in table if r["strategy"] == STRATEGIES[2] and r["blocked"] is not None]
    return {
        "decoupled >= 10x sooner than DP at 100mbit": ratio("100mbit", STRATEGIES[2]),
        "decoupled >= 10x sooner than DP at 10mbit": ratio("10mbit", STRATEGIES[2]),
        "decoupled >= 2x sooner than synchronous at 10mbit": vs_sync,
        "decoupled blocked < 2% at every rate": max(blocked) if blocked else None,
    }


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(RATES), figsize=(5 * len(RATES), 4), sharey=True)
    for ax, rate in zip(axes, RATES, strict=True):
        for strategy in STRATEGIES:
            curve = runs.get(f"{rate}|{strategy}", {}).get("curve", [])
            ax.plot([t for t, _ in curve], [loss for _, loss in curve], label=strategy)
        ax.set_title(f"{rate} per site")
        ax.set_xlabel("wall-clock s (from the first step)")
    axes[0].set_ylabel("held-out eval loss")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(table: list[dict[str, Any]]) -> None:
    cols = list(table[0])
    print(" | ".join(cols))
    for r in table:
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 s windows instead of 120 s")
    parser.add_argument("--window", type=float, default=None, help="seconds of training per run")
    parser.add_argument("--rates", default=",".join(RATES))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rescore", type=Path, default=None, help="recompute the table of an earlier result")
    parser.add_argument("--workdir", type=Path, default=None, help="with --rescore: its runs, to rebuild curves")
    args = parser.parse_args(argv)
    if args.rescore:
        return rescore(args.rescore, args.workdir)
    wall = args.window or (40.0 if args.quick else 120.0)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"dld-race-{os.getpid()}"
    runs: dict[str, dict[str, Any]] = {}
    for rate in args.rates.split(","):
        with Sites(work / f"dp-sites-{rate}", SITES, rate=rate, prefix="dlr") as sites, forwarding():
            runs[f"{rate}|{STRATEGIES[0]}"] = run_dp(sites, wall, work / rate)
        # the syncer's own link is capped too: all its egress to the sites shares one `rate`
        with Sites(work / f"sites-{rate}", SITES, rate=rate, operator_rate=rate, prefix="dlr") as sites:
            for strategy in STRATEGIES[1:]:
                runs[f"{rate}|{strategy}"] = run_fleet(sites, strategy, wall, work / rate)
        print(f"{rate}: done", flush=True)
    table = rows(runs, wall)
    print_table(table)
    result = {"window_s": wall, "settings": SETTINGS, "rows": table, "verdict": verdict(table), "runs": runs}
    print(json.dumps(result["verdict"], indent=1))
    out = args.out or RESULTS / f"race{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps(result, indent=1))
    plot(runs, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def rescore(path: Path, workdir: Path | None) -> int:
    """The table, verdict and plot of a result file again, from its curves (no run); with
    `workdir`, the DiLoCo curves rebuilt from its run directories first."""
    result = json.loads(path.read_text())
    runs = {k: {**v, "curve": [tuple(p) for p in v["curve"]]} for k, v in result["runs"].items()}
    if workdir is not None:
        rebuild_fleets(runs, workdir, float(result["window_s"]))
        result["runs"] = runs
    table = rows(runs, float(result["window_s"]))
    result.update(rows=table, verdict=verdict(table))
    print_table(table)
    print(json.dumps(result["verdict"], indent=1))
    path.write_text(json.dumps(result, indent=1))
    plot(runs, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
