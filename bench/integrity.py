"""Benchmark: the global model under every fault class (issue 18), next to the same fleet without it.

One fleet (gpt-tiny, 3 learners, H = 16, dldctl's defaults, constant inner lr so that runs of
different lengths compare at equal tokens) on the built-in local host, run once without faults
(30% longer than the longest class, so that its curve reaches a faster run's tokens: a run past
its end is not judged) and once per fault class, one fault a run, injected `--at` seconds after the whole fleet
trains. The syncer scores the global model every `global_eval_every` (here 8) outer steps on the
fixed held-out batches (syncer/evaluator.py); those scores, each with the merged tokens of the
state it scored, are the curve. Per class:

- **final vs clean**: the final model's held-out loss (`bench.evaluate` on final_model.pt) against
  the fault-free run's at the same merged tokens: its curve there (a line through the 9 nearest
  scores), put on final_model.pt's scale by the clean run's own final against its curve (down's
  last merges and the other evaluator). Target: within 2%. Also **last scores vs clean**: the mean
  of the syncer's own last 5 scores before `down` against the clean curve at their mean tokens
  (one evaluator, no final flush). The `clean_repeat` class (no fault, run first) is the noise
  floor, judged against the clean run; every other class against the mean of both clean runs;
- **worst after / before**: the worst score after the fault against the last one before it.
  Target: at most 5% above;
- **above bound**: scores after the fault above that bound (what a checkpoint could have held);
  the quality guard's trips and rollbacks;
- **back**: seconds from the fault until a score is at or below the pre-fault one again, and
  whether the fleet was back to full quorum at the end without any command.

Fault classes (`--faults` picks some; the durations are `--quick`'s in brackets): none (the clean
run repeated); learner kill -9;
learner pause 60 s [20]; learner partition 120 s [30]; syncer kill -9; syncer down 30 s, 120 s
[60] and 600 s [skipped]; five syncer kills 3 s apart; syncer hung (SIGSTOP) 60 s [20]; disk
full for 30 s [15] (the dldctl home on a 512 MB tmpfs, filled by a file then deleted);
supervisor kill -9; every checkpoint corrupt (then a syncer kill, with `on_no_checkpoint =
"from-learner"`; with the default "refuse" the syncer waits for the operator by design); a
sharded syncer (`[syncer] shards = 2`) without a fault, and with shard 1 killed -9, both judged
against the same unsharded clean run (a sharded run's scores are shard 0's, of the model of both
shards' newest checkpoints: syncer/shardscore.py); a learner gone bad (`bad_*`, bench/badlearner.py:
its own columns and targets, against one more run, the fleet without that learner); and
`monkey_hetero`, the false positives: 2 learners at full and 2 at half speed under the chaos monkey
for 10 minutes, judged by quarantines alone (target: none).

    .venv/bin/python bench/integrity.py --quick                       # ~40 min on 2 cores
    .venv/bin/python bench/integrity.py                               # every class, full durations, ~75 min
    .venv/bin/python bench/integrity.py --faults syncer_down_30,disk_full
    .venv/bin/python bench/integrity.py --quick --rescore bench/results/integrity.json   # the table again
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

# stdlib since 3.11; mypy checks as 3.10 (pyproject's python_version), which has none
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import badlearner, common
from bench.fleet import BenchRun, Plan, diloco_run, local_host, read_jsonl, run_diloco
from dldctl.rundir import RunDir
from dldctl.runstate import RunState

LEARNERS = 3
TARGET_FINAL, TARGET_WORST = 0.02, 0.05
Fault = Callable[[BenchRun, threading.Event, float], str]  # (fleet, stop, seconds) -> what was done
SYNCER = "[syncer]"  # a class's extra settings under this key are the inventory's [syncer] table


def _dl(fleet: BenchRun, *args: str) -> str:
    proc = fleet.dl(*args, "--force", check=False, timeout=120)
    return f"dldctl {' '.join(args)} -> {proc.returncode}"


def _state(fleet: BenchRun) -> RunState:
    assert fleet.run_dir is not None
    return RunDir(fleet.run_dir).read_state()


def syncer_hang(fleet: BenchRun, stop: threading.Event, seconds: float) -> str:
    pid = int(fleet.status()["syncer"]["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        stop.wait(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    return f"SIGSTOP syncer pid {pid} for {seconds:g} s"


def syncer_kills(fleet: BenchRun, stop: threading.Event, _seconds: float) -> str:
    done = 0
    while done < 5 and not stop.is_set():
        if fleet.kill("syncer"):
            done += 1
            stop.wait(3.0)
        else:
            stop.wait(0.5)
    return f"{done} syncer kills 3 s apart"


def disk_full(fleet: BenchRun, stop: threading.Event, seconds: float) -> str:
    filler = fleet.home / "filler"
    with open(filler, "wb") as fh:
        block = b"\0" * (1 << 20)
        try:
            while True:
                fh.write(block)
        except OSError:
            pass
    try:
        stop.wait(seconds)
    finally:
        filler.unlink()
    return f"the home's file system full for {seconds:g} s"


def supervisor_kill(fleet: BenchRun, _stop: threading.Event, _seconds: float) -> str:
    record = _state(fleet).supervisor
    assert record is not None, "the run has no supervisor recorded"
    pid = record.pid
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILL supervisor pid {pid}"


def corrupt_checkpoints(fleet: BenchRun, stop: threading.Event, _seconds: float) -> str:
    assert fleet.run_dir is not None
    files = sorted((fleet.run_dir / "checkpoints").glob("*"))
    for path in files:
        if path.is_file():
            path.write_bytes(b"not a checkpoint" * 16)
    fleet.kill("syncer")
    return f"{len(files)} checkpoint files overwritten, then the syncer killed"


def monkey(fleet: BenchRun, stop: threading.Event, seconds: float) -> str:
    res = fleet.monkey(20.0, seconds, 1, "kill,pause,slow,partition", stop)
    return f"chaos monkey, a fault every 20 s for {seconds:g} s: {res['injected']} injected"


def faults(quick: bool) -> dict[str, tuple[Fault, float, dict[str, Any]]]:
    """name -> (fault, its duration in seconds, extra [run] settings)."""
    q = lambda full, short: short if quick else full
    out: dict[str, tuple[Fault, float, dict[str, Any]]] = {
        "clean_repeat": (lambda f, s, d: "no fault: the clean run again (run-to-run noise)", 0.0, {}),
        "learner_kill": (lambda f, s, d: _dl(f, "chaos", "kill", "learner-1"), 0.0, {}),
        "learner_pause": (
            lambda f, s, d: _dl(f, "chaos", "pause", "learner-1", "--duration", f"{d:g}s"),
            q(60, 20),
            {},
        ),
        "learner_partition": (
            lambda f, s, d: _dl(f, "chaos", "partition", "learner-1", "--duration", f"{d:g}s"),
            q(120, 30),
            {},
        ),
        "syncer_kill": (lambda f, s, d: _dl(f, "chaos", "kill", "syncer"), 0.0, {}),
        "syncer_down_30": (lambda f, s, d: _dl(f, "chaos", "kill", "syncer", "--down-for", f"{d:g}s"), 30.0, {}),
        "syncer_down_120": (lambda f, s, d: _dl(f, "chaos", "kill", "syncer", "--down-for", f"{d:g}s"), q(120, 60), {}),
        "syncer_kills_5": (syncer_kills, 15.0, {}),
        "syncer_hang": (syncer_hang, q(60, 20), {}),
        "disk_full": (disk_full, q(30, 15), {}),
        "supervisor_kill": (supervisor_kill, 0.0, {}),
        "checkpoints_corrupt": (corrupt_checkpoints, 0.0, {"on_no_checkpoint": "from-learner"}),
        # a sharded syncer (2 shards on this machine), against the same unsharded clean run
        "sharded": (lambda f, s, d: "no fault: [syncer] shards = 2", 0.0, {SYNCER: {"shards": 2}}),
        "shard_kill": (lambda f, s, d: _dl(f, "chaos", "kill", "syncer-1"), 0.0, {SYNCER: {"shards": 2}}),
    }
    out.update(badlearner.classes(60.0))
    out["monkey_hetero"] = (monkey, 600.0, {})  # the 10 minutes, quick or not
    if not quick:
        out["syncer_down_600"] = (lambda f, s, d: _dl(f, "chaos", "kill", "syncer", "--down-for", f"{d:g}s"), 600.0, {})
    return out


def _extra(parser: Any) -> None:
    parser.add_argument("--faults", default="", help="comma-separated fault classes (default: all)")
    parser.add_argument("--at", type=float, default=None, help="seconds after training starts (default 60, quick 40)")
    parser.add_argument(
        "--settle", type=float, default=None, help="seconds after the fault ends (default 90, quick 45)"
    )
    parser.add_argument(
        "--rescore",
        type=Path,
        default=None,
        metavar="JSON",
        help="recompute the table from an earlier run's results file (no fleet is run)",
    )
    parser.add_argument(
        "--reuse",
        type=Path,
        default=None,
        metavar="JSON",
        help="the clean runs (and the fleet without the bad learner) of an earlier results file; the classes run",
    )
    parser.add_argument(
        "--anew",
        default="",
        metavar="NAMES",
        help="with --reuse: these references (clean, clean_repeat, without) run again all the same",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a [run] setting for every run, clean included (TOML value), e.g. --set max_carry=-1",
    )


OVERRIDES: dict[str, Any] = {}  # --set


def base_run() -> dict[str, Any]:
    return {
        **diloco_run(16, lr_schedule="constant", global_eval_every=8),  # dldctl's default outer optimizer
        **OVERRIDES,
    }


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` pairs, each value read as TOML (`--set max_carry=-1`, `--set merge="mean"`)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"error: --set {item!r}: expected KEY=VALUE, e.g. --set max_carry=-1")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError as exc:
            raise SystemExit(
                f"error: --set {item!r}: the value is not TOML ({exc}); quote strings: key='\"x\"'"
            ) from None
    return out


def plan_for(name: str, fault: Fault | None, seconds: float, extra: dict[str, Any], at: float, settle: float) -> Plan:
    def chaos(fleet: BenchRun, start: float, stop: threading.Event) -> dict[str, Any]:
        if stop.wait(max(0.0, start + at - time.time())):
            return {"t": None}
        t = time.time()
        detail = fault(fleet, stop, seconds) if fault is not None else "none"
        return {"t": t, "detail": detail}

    extra = dict(extra)
    syncer = extra.pop(SYNCER, None)
    hosts = [local_host("here", LEARNERS)]
    if name == "monkey_hetero":  # 2 at full speed, 2 at half
        hosts = [local_host("fast", 2), local_host("slow", 2, throttle=2.0)]
    elif name == "without":  # the fleet without its bad learner
        hosts = [local_host("here", LEARNERS - 1)]
    learners = sum(h["learners"] for h in hosts)
    return Plan(
        f"i-{name}",
        {**base_run(), **extra},
        hosts,
        learners,
        duration_s=at + seconds + settle,
        chaos=chaos if fault is not None else None,
        inspect=_scores,
        timeout_s=at + seconds + settle + 600,
        home_tmpfs_mb=512 if name == "disk_full" else None,
        syncer=syncer,
    )


def _scores(fleet: BenchRun) -> dict[str, Any]:
    assert fleet.run_dir is not None
    metrics = read_jsonl(fleet.run_dir / "metrics.jsonl")
    samples = [m for m in metrics if m.get("kind") == "sample"]
    kinds = ("quarantined", "contribution_rejected", "probation")
    return {
        "scores": [m for m in metrics if m.get("kind") == "global_eval"],
        "quorum": [(m["t"], m.get("quorum_live")) for m in samples],
        "events": [e for e in read_jsonl(fleet.run_dir / "events.jsonl") if e.get("kind") in kinds],
        "learner_loss": [(m["t"], {k: v.get("loss") for k, v in m.get("learners", {}).items()}) for m in samples],
    }


def at_tokens(curve: list[dict[str, Any]], tokens: float, near: int = 9) -> float | None:
    """The clean run's global loss at `tokens` merged: a least-squares line through its `near`
    scores closest in tokens (one score is ~1% noisy from one to the next), evaluated there.
    None past the curve's end by more than its last gap."""
    pts = sorted((m["tokens_merged"], m["loss"]) for m in curve if m.get("good") is not False)  # None: unguarded
    if len(pts) < 2 or tokens > pts[-1][0] + (pts[-1][0] - pts[-2][0]):
        return None
    local = sorted(pts, key=lambda xy: abs(xy[0] - tokens))[:near]
    mx = sum(x for x, _ in local) / len(local)
    my = sum(y for _, y in local) / len(local)
    sxx = sum((x - mx) ** 2 for x, _ in local)
    slope = sum((x - mx) * (y - my) for x, y in local) / sxx if sxx > 0 else 0.0
    return my + slope * (tokens - mx)


def tail(scores: list[dict[str, Any]], n: int = 5) -> tuple[float, float] | None:
    """(mean merged tokens, mean loss) of the last `n` scores: the run's end, less one score's noise."""
    last = scores[-n:]
    if not last:
        return None
    return sum(m["tokens_merged"] for m in last) / len(last), sum(m["loss"] for m in last) / len(last)


def reference(cleans: list[dict[str, Any]], tokens: float, final: bool) -> float | None:
    """The fault-free runs' global loss at `tokens` merged, averaged over the clean runs whose
    curves reach it (`final`: each put on final_model.pt's scale by its own final, see `row`)."""
    values = []
    for clean in cleans:
        at = at_tokens(clean["inspect"]["scores"], tokens)
        end = at_tokens(clean["inspect"]["scores"], clean["tokens_merged"])
        if at is not None and final:
            at = at * clean["eval_loss"] / end if end and clean.get("eval_loss") else None
        if at is not None:
            values.append(at)
    return sum(values) / len(values) if values else None  # a shorter clean run may not reach `tokens`


def row(name: str, res: dict[str, Any], cleans: list[dict[str, Any]]) -> dict[str, Any]:
    """One fault class against the clean runs (see the module docstring)."""
    scores = sorted(res["inspect"]["scores"], key=lambda m: m.get("taken_at", m["t"]))
    t_fault = (res.get("chaos") or {}).get("t") or res["training_started"]
    before = [m for m in scores if m.get("taken_at", m["t"]) < t_fault]
    after = [m for m in scores if m.get("taken_at", m["t"]) >= t_fault]
    pre = before[-1]["loss"] if before else None
    worst = max((m["loss"] for m in after), default=None)
    bound = pre * (1 + TARGET_WORST) if pre is not None else None
    back = next((m.get("taken_at", m["t"]) - t_fault for m in after if pre is not None and m["loss"] <= pre), None)
    final = res["eval_loss"]
    # final_model.pt is scored by bench.evaluate after down's last merges, the curve by the
    # syncer: the clean run's own final against its curve puts the two on one scale
    clean_at = reference(cleans, res["tokens_merged"], final=True)
    end = tail(scores)  # the syncer's own last scores, before down's final merges
    end_clean = reference(cleans, end[0], final=False) if end else None
    # the fleet's quorum when the window ended (down's own samples, learners leaving, come later)
    live = [q for t, q in res["inspect"]["quorum"] if t <= res["training_ended"]]
    out = {
        "fault": name,
        "tokens merged": res["tokens_merged"],
        "final": final,
        "clean at equal tokens": clean_at,
        "final vs clean": None if final is None or not clean_at else final / clean_at - 1,
        "last scores vs clean": None if end is None or not end_clean else end[1] / end_clean - 1,
        "before": pre,
        "worst after": worst,
        "worst vs before": None if worst is None or not pre else worst / pre - 1,
        "above bound": sum(1 for m in after if bound is not None and m["loss"] > bound),
        "guard trips": sum(1 for m in scores if m.get("good") is False),  # a sharded run's are None: unguarded
        "back s": back,
        "full quorum at end": bool(live) and live[-1] == LEARNERS,
        "detail": (res.get("chaos") or {}).get("detail"),
    }
    out["met"] = bool(
        out["final vs clean"] is not None
        and out["final vs clean"] <= TARGET_FINAL
        and (out["worst vs before"] is None or out["worst vs before"] <= TARGET_WORST)
        and out["full quorum at end"]
    )
    return out


def judged(name: str, res: dict[str, Any], runs: dict[str, Any], seconds: float) -> dict[str, Any]:
    """`row`, and for a bad learner its own columns and targets (the bad learner may be out at
    the end by design); the monkey's false positives by quarantines alone."""
    if name == "monkey_hetero":
        events = (res.get("inspect") or {}).get("events", [])
        quarantines = sum(1 for e in events if e["kind"] == "quarantined")
        rejected = sum(1 for e in events if e["kind"] == "contribution_rejected")
        return {
            "fault": name,
            "quarantines": quarantines,
            "rejection events": rejected,
            "met": not quarantines,
        }
    out = row(name, res, references(name, runs))
    if name.startswith("bad_"):
        out.update(badlearner.columns(name, res, seconds, runs.get("without")))
        out.update(versus_without(res, runs))
        # for the rest of the run the best a fleet can do is to shut the bad learner out: it is
        # the fleet without it from then on, whose constant-lr plateau is higher than the whole
        # fleet's (BENCHMARKS.md); so a rest class is held to the fleet without it at equal tokens
        final = out["final vs without"] if name.endswith("_rest") else out["final vs clean"]
        out["met"] = bool(
            out["bad met"]
            and final is not None
            and final <= TARGET_FINAL
            and (out["worst vs before"] is None or out["worst vs before"] <= TARGET_WORST)
        )
    return out


def versus_without(res: dict[str, Any], runs: dict[str, Any]) -> dict[str, float | None]:
    """The final model against the fleet without the bad learner at equal merged tokens, and that
    fleet's own final against the clean run (what losing a learner costs by itself)."""
    without = runs.get("without")
    if without is None or res.get("eval_loss") is None:
        return {"final vs without": None, "without vs clean": None}
    at = reference([without], res["tokens_merged"], final=True)
    cleans = references("without", runs)
    # both curves where both reach (the fleet without runs as long as the clean one, on 2 learners)
    tokens = min(without["tokens_merged"], *(c["tokens_merged"] for c in cleans))
    ours, theirs = reference([without], tokens, final=False), reference(cleans, tokens, final=False)
    return {
        "final vs without": None if not at else res["eval_loss"] / at - 1,
        "without vs clean": None if not ours or not theirs else ours / theirs - 1,
    }


CLEAN_MARGIN = 0.3  # the clean run trains this much longer than the longest faulted one


def clean_settle(at: float, longest: float, settle: float) -> float:
    """The clean run's settle time: its window `CLEAN_MARGIN` longer than the longest class's, so
    that its curve reaches the tokens of a faulted run on a machine whose speed varies (a run past
    the curve's end is not judged: the benchmark does not extrapolate)."""
    return settle + CLEAN_MARGIN * (at + longest + settle)


def references(name: str, runs: dict[str, Any]) -> list[dict[str, Any]]:
    """The clean runs a class is judged against: the clean run and, once it has run, its repeat
    (two runs halve the reference's own noise); the repeat itself against the clean run only."""
    if name == "clean_repeat" or "clean_repeat" not in runs:
        return [runs["clean"]]
    return [runs["clean"], runs["clean_repeat"]]


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("integrity", __doc__, _extra, argv)
    OVERRIDES.update(parse_sets(args.set))
    at, settle = args.at or (40.0 if args.quick else 60.0), args.settle or (45.0 if args.quick else 90.0)
    table = faults(args.quick)
    chosen = [f for f in args.faults.split(",") if f] or list(table)
    unknown = [f for f in chosen if f not in table]
    if unknown:
        print(f"error: unknown fault class(es) {', '.join(unknown)}; known: {', '.join(table)}", file=sys.stderr)
        return 2
    saved = json.loads(args.rescore.read_text())["runs"] if args.rescore else None
    if args.reuse:  # the references of an earlier run on this code's settings; the classes run anew
        refs = json.loads(args.reuse.read_text())["runs"]
        anew = set(args.anew.split(","))
        saved = {k: v for k, v in refs.items() if k in ("clean", "clean_repeat", "without") and k not in anew}
    longest = max((table[f][1] for f in chosen if f != "monkey_hetero"), default=0.0)
    clean_plan = plan_for("clean", None, longest, {}, at, clean_settle(at, longest, settle))
    runs: dict[str, Any] = {}
    if any(n != "monkey_hetero" for n in chosen):  # the monkey's false positives need no clean run
        runs["clean"] = saved["clean"] if saved and "clean" in saved else run_diloco(clean_plan)
    if any(n.startswith("bad_") for n in chosen):  # the rate and the rest classes' final against it
        # as long as the clean run: its curve must reach a rest class's tokens, as the clean one's
        without = plan_for("without", None, longest, {}, at, clean_settle(at, longest, settle))
        runs["without"] = saved["without"] if saved and "without" in saved else run_diloco(without)
    rows = []
    have: dict[str, Any] = saved or {}
    for name in chosen if not args.rescore else [n for n in chosen if n in have]:
        fault, seconds, extra = table[name]
        runs[name] = have[name] if name in have else run_diloco(plan_for(name, fault, seconds, extra, at, settle))
        rows.append(judged(name, runs[name], runs, seconds))
        print(f"{name}: {rows[-1]}", flush=True)
    common.print_table(
        f"The global model under faults: {LEARNERS} learners, gpt-tiny, H=16, fault at {at:g} s, "
        f"settle {settle:g} s (targets: final within {100 * TARGET_FINAL:g}% of the clean run at "
        f"equal merged tokens, worst score after the fault within {100 * TARGET_WORST:g}% of before)",
        [{k: v for k, v in r.items() if k != "detail"} for r in rows],
    )
    met = sum(1 for r in rows if r["met"])
    print(f"{met} of {len(rows)} fault classes within every target")
    common.write_json(
        args.out,
        {
            "benchmark": "integrity",
            "quick": args.quick,
            "at_s": at,
            "settle_s": settle,
            "settings": base_run(),
            "rows": rows,
            "runs": runs,
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
