"""Benchmark: a real learner against the best plain PyTorch loop, same model, recipe and device.

What the Decoupled DiLoCo machinery costs a learner: tokens per second of a **real learner
process** in a real fleet (`dldctl up`, one learner and the syncer, H = 32, 4 fragments, int4,
quorum 1, overlap on) against, in the same run, **the best plain loop** for the same model and
recipe (bench/plain_loop.py: same model, data, AdamW, schedule, clipping and batch; bf16 autocast,
torch.compile and fused AdamW on CUDA; nothing else in the loop), on the same device and number
of torch threads, each in a fresh process. A case is a recipe, `precision` and `compile`, given
to both: the plain loop's arguments and the learner's `[run]` keys.

Both leave their first warmup steps (the compilation) out of the throughput, the same count:
the learner says how many in its `finished` record (`warmup_steps`; learner/recipe.py: 3 steps
compiled, 1 eager), the plain loop is given the same count, times those steps one by one and is
cut where the learner's record says (bench/plain_loop.py: `steady`):

    learner tokens/s = steady_tokens / steady_s   (its `finished` record; a record without
                                                   them: tokens / train_s, and the plain loop
                                                   then counts its whole loop too: basis "whole loop")
    plain tokens/s   = the same for the plain loop, after as many warmup steps
    ratio            = learner / plain            (1.0 = the machinery is free)
    blocked          = blocked_s / steady_s       (the learner's loop outside the train step)
    memory ratio     = peak learner / peak plain  (CUDA: torch.cuda.max_memory_allocated; CPU:
                                                   the process's peak resident set)
    first step s     = process start -> end of the first step (imports, build, join, compile)
    warmup s         = loop start -> end of the warmup steps (the compilation and first steps)

Each case runs the plain loop and the learner alternately `--repeats` times (default 3, 1 with
`--quick`); the table gives the median of the paired ratios and their range, so the noise shows
beside the gap. A learner that ran another recipe than the case's (learner/recipe.py trains
eager where torch.compile fails) fails its row. Every process compiles into a fresh inductor and
triton cache (`--compile-cache fresh`, the cold start a new host sees): no run reuses another's
compilation.

Targets: on CUDA ratio >= 0.97, blocked < 1%, peak memory within 10% of the plain loop's; on
the CPU ratio >= 0.97 for gpt-small. A target whose ratio range spans the limit is "unclear".

    .venv/bin/python bench/learner_throughput.py                    # full: CPU cases, plus CUDA where available
    .venv/bin/python bench/learner_throughput.py --quick            # gpt-small on the CPU, shorter CUDA cases
    .venv/bin/python bench/learner_throughput.py --devices cuda --repeats 1 --budget-s 280
    .venv/bin/python bench/learner_throughput.py --case cuda-gpt2-124m-bf16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common, plain_loop
from bench.fleet import BenchRun, diloco_run, local_host
from bench.plain_loop import Recipe

THREADS = {"cpu": 1, "cuda": 2}  # torch threads of the learner and of the plain loop
BF16_COMPILE, FP32 = Recipe("bf16", True), Recipe("fp32", False)


@dataclass(frozen=True)
class Case:
    """One row: a model at a batch and sequence length, trained with one recipe on one device."""

    name: str
    device: str  # "cpu" | "cuda"
    model: str
    seq_len: int
    batch: int
    steps: int
    quick_steps: int | None  # None: not in --quick
    recipe: Recipe
    targets: tuple[str, ...] = ()  # keys of TARGETS


# CUDA first, the headline first of all: a GPU check that runs out of time keeps what matters most
GPU_TARGETS = ("ratio", "blocked", "memory")
CASES = [
    Case("cuda-gpt2-124m-bf16", "cuda", "gpt2-124m", 1024, 16, 300, 100, BF16_COMPILE, GPU_TARGETS),
    Case("cuda-gpt-medium-bf16", "cuda", "gpt-medium", 256, 32, 1000, 300, BF16_COMPILE, GPU_TARGETS),
    Case("cuda-gpt2-124m-fp32", "cuda", "gpt2-124m", 1024, 16, 100, 40, FP32, GPU_TARGETS),
    Case("cpu-gpt-tiny", "cpu", "gpt-tiny", 32, 8, 400, None, FP32),
    Case("cpu-gpt-small", "cpu", "gpt-small", 128, 16, 300, 60, FP32, ("ratio",)),
]

# name -> (row key, comparison, limit, label)
TARGETS: dict[str, tuple[str, str, float, str]] = {
    "ratio": ("ratio", ">=", 0.97, "ratio >= 0.97"),
    "blocked": ("blocked", "<", 0.01, "blocked < 1%"),
    "memory": ("memory_ratio", "<=", 1.10, "peak memory <= 1.1 x plain"),
}


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", default=None, help="comma-separated; default cpu, plus cuda where available")
    parser.add_argument("--case", default=None, help="comma-separated case names (default: every case of the devices)")
    parser.add_argument("--repeats", type=int, default=None, help="plain/learner pairs per case (default 3, quick 1)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no run that cannot end by then")
    parser.add_argument(
        "--compile-cache",
        choices=("fresh", "shared"),
        default="fresh",
        help="fresh: every process compiles cold into its own cache; shared: the user's inductor cache",
    )


# --------------------------------------------------------------------------- pure parts


def run_table(case: Case, steps: int) -> dict[str, Any]:
    """The fleet's `[run]` table for a case: the recipe's keys, and no evaluation inside the loop."""
    return diloco_run(
        32,
        model=case.model,
        seq_len=case.seq_len,
        batch_size=case.batch,
        steps=steps,
        warmup=10,
        eval_every=steps + 1,
        eval_batches=2,
        **case.recipe.run_keys(),
    )


def learner_steady(record: dict[str, Any]) -> dict[str, Any]:
    """Throughput after the warmup from a learner's `finished` record; a record without the
    steady keys counts its whole loop (basis "whole loop", warmup 0 steps)."""
    if record.get("steady_s") and record.get("steady_tokens") is not None:
        tokens, seconds, basis = record["steady_tokens"], record["steady_s"], "steady"
        warmup, warmup_s = int(record.get("warmup_steps") or 0), record.get("warmup_s")
    else:
        tokens, seconds, basis = record["tokens"], record["train_s"], "whole loop"
        warmup, warmup_s = 0, None
    return {
        "basis": basis,
        "warmup_steps": warmup,
        "warmup_s": warmup_s,
        "steady_tokens": tokens,
        "steady_s": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "blocked": record["blocked_s"] / seconds if seconds > 0 else None,
    }


def recipe_of(record: dict[str, Any]) -> str | None:
    """The recipe the learner says it resolved ("bf16+compile"), None if its record does not say."""
    if "precision" not in record:
        return None
    return Recipe(str(record["precision"]), bool(record.get("compiled"))).label


def pair(plain: dict[str, Any], record: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """One repeat: the learner's record against the plain loop cut at the learner's warmup."""
    ours = learner_steady(record)
    base = plain_loop.steady(plain, ours["warmup_steps"])
    shown_warmup = ours["warmup_steps"] or plain_loop.default_warmup(recipe.compile)  # for the warmup column
    p_mem, l_mem = plain.get("peak_memory_bytes"), record.get("peak_memory_bytes")
    return {
        "basis": ours["basis"],
        "warmup_steps": ours["warmup_steps"],
        "plain_warmup_steps": base["warmup_steps"],
        "plain_tok_s": base["tokens_per_s"],
        "learner_tok_s": ours["tokens_per_s"],
        "ratio": ours["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None,
        "blocked": ours["blocked"],
        "plain_peak_bytes": p_mem,
        "learner_peak_bytes": l_mem,
        "memory_ratio": l_mem / p_mem if l_mem and p_mem else None,
        "plain_first_step_s": plain.get("first_step_s"),
        "learner_first_step_s": record.get("first_step_s"),
        "plain_warmup_s": plain_loop.steady(plain, shown_warmup)["warmup_s"],
        "learner_warmup_s": ours["warmup_s"],
        "learner_recipe": recipe_of(record),
    }


def _median(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarize(pairs: list[dict[str, Any]], targets: tuple[str, ...], recipe: Recipe | None = None) -> dict[str, Any]:
    """A case's repeats: medians of each figure, the range and spread of the paired ratios, the
    targets, and (given the case's `recipe`) whether the learner says it ran that recipe."""
    keys = [k for k in pairs[0] if k not in ("basis", "learner_recipe")]  # the figures
    row: dict[str, Any] = {k: _median([p[k] for p in pairs]) for k in keys}
    ratios = [p["ratio"] for p in pairs if p["ratio"] is not None]
    row["ratio_lo"], row["ratio_hi"] = (min(ratios), max(ratios)) if ratios else (None, None)
    row["noise"] = (max(ratios) - min(ratios)) / statistics.median(ratios) if len(ratios) > 1 else None
    row["basis"] = ", ".join(sorted({p["basis"] for p in pairs}))
    row["learner_recipe"] = ", ".join(sorted({p["learner_recipe"] or "?" for p in pairs}))
    row["targets"] = judge(row, targets)
    if recipe is not None:
        ran = {p["learner_recipe"] for p in pairs} - {None}
        verdict = "not reported" if not ran else "pass" if ran == {recipe.label} else "FAIL"
        row["targets"][f"learner ran {recipe.label}"] = {"value": row["learner_recipe"], "verdict": verdict}
    return row


def judge(row: dict[str, Any], names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Each target: its value, pass / FAIL, or "unclear" where the ratio's range spans the limit,
    or "not reported" where the figure is missing."""
    out = {}
    for name in names:
        key, op, limit, label = TARGETS[name]
        value = row.get(key)
        if value is None:
            out[label] = {"value": None, "limit": limit, "verdict": "not reported"}
            continue
        verdict = "pass" if _holds(value, op, limit) else "FAIL"
        spans = row.get("noise") is not None and _holds(row["ratio_lo"], op, limit) != _holds(
            row["ratio_hi"], op, limit
        )
        if key == "ratio" and spans:
            verdict = "unclear"  # the noise is not below the gap
        out[label] = {"value": value, "limit": limit, "verdict": verdict}
    return out


def _holds(value: float, op: str, limit: float) -> bool:
    return {">=": value >= limit, "<": value < limit, "<=": value <= limit}[op]


def verdict_line(targets: dict[str, dict[str, Any]]) -> str:
    """ "ratio >= 0.97: pass; blocked < 1%: FAIL" (empty: no target for this case)."""
    return "; ".join(f"{label}: {t['verdict']}" for label, t in targets.items())


# --------------------------------------------------------------------------- the runs


@contextlib.contextmanager
def compile_cache(mode: str) -> Iterator[dict[str, str]]:
    """The environment of one process: with "fresh", its own empty inductor and triton caches
    (set in os.environ too while it lasts: the fleet's learner inherits this environment)."""
    if mode != "fresh":
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as tmp:
        env = {"TORCHINDUCTOR_CACHE_DIR": str(Path(tmp, "inductor")), "TRITON_CACHE_DIR": str(Path(tmp, "triton"))}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def learner_run(run: dict[str, Any], device: str, threads: int, timeout: float) -> dict[str, Any]:
    """One real learner process in a real fleet; its `finished` record."""
    with BenchRun("throughput") as fleet:
        fleet.up(run, [local_host("here", 1, device=device, threads=threads)])
        try:
            fleet.wait_for(lambda: _finished(fleet) is not None, timeout, "the learner to finish its steps", every=0.5)
        except TimeoutError:
            _show_logs(fleet)
            raise
        record = _finished(fleet)
        fleet.down()
    assert record is not None
    return record


def _show_logs(fleet: BenchRun) -> None:
    """What a stuck run left: the events and the tails of the learner's and syncer's logs."""
    assert fleet.run_dir is not None
    for event in fleet.events()[-12:]:
        print("   event:", json.dumps(event)[:300])
    for name in ("learner-0", "syncer"):
        path = fleet.run_dir / "logs" / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else "(no log)"
        print(f"   --- {path}:\n" + text[-3000:], flush=True)


def _finished(fleet: BenchRun) -> dict[str, Any] | None:
    assert fleet.run_dir is not None
    path = fleet.run_dir / "learners" / "learner-0" / "finished"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None  # not there yet, or being written


class Deadline:
    """`--budget-s`: how long a run may still take (a run that cannot start is not started)."""

    def __init__(self, budget_s: float | None) -> None:
        self.end = time.monotonic() + budget_s if budget_s else None

    def left(self, wanted: float) -> float:
        """`wanted` seconds, or what is left when that is less; TimeoutError when under 45 s are
        left (too little for a fleet's start, a run and its teardown)."""
        if self.end is None:
            return wanted
        left = self.end - time.monotonic()
        if left < 45:
            raise TimeoutError("the --budget-s is spent")
        return min(wanted, left)


def run_case(case: Case, steps: int, repeats: int, cache: str, deadline: Deadline) -> dict[str, Any]:
    """Plain loop and learner alternately, `repeats` times; the case's row."""
    run, threads = run_table(case, steps), THREADS[case.device]
    timeout = 240 + 2.0 * steps  # start-up, a cold compilation and the steps, generously
    runs = []
    for i in range(repeats):
        print(f"  {case.name}: repeat {i + 1}/{repeats}, {steps} steps: plain loop ...", flush=True)
        with compile_cache(cache) as env:
            spec = {"run": run, "device": case.device, "threads": threads, "recipe": asdict(case.recipe)}
            spec["warmup_steps"] = plain_loop.default_warmup(case.recipe.compile)
            plain = plain_loop.run_apart(spec, deadline.left(timeout), env)
        print(f"    plain loop done ({plain['loop_s']:.1f} s loop); the learner ...", flush=True)
        with compile_cache(cache):
            record = learner_run(run, case.device, threads, deadline.left(timeout))
        one = pair(plain, record, case.recipe)
        runs.append({**one, "plain": plain, "learner": record})
        print(
            f"    plain {one['plain_tok_s']:,.0f} tok/s, learner {one['learner_tok_s']:,.0f} tok/s, "
            f"ratio {one['ratio']:.3f}, blocked {one['blocked'] or 0:.2%} ({one['basis']})",
            flush=True,
        )
    pairs = [{k: v for k, v in r.items() if k not in ("plain", "learner")} for r in runs]
    row = summarize(pairs, case.targets, case.recipe)
    head = {"case": case.name, "device": case.device, "device_name": runs[0]["plain"]["device_name"]}
    head |= {"model": case.model, "parameters": runs[0]["plain"]["parameters"], "recipe": case.recipe.label}
    head |= {"seq_len": case.seq_len, "batch": case.batch, "steps": steps, "threads": threads, "repeats": repeats}
    return {**head, **row, "verdict": verdict_line(row["targets"]), "runs": runs}


# --------------------------------------------------------------------------- the command


def select(args: argparse.Namespace) -> list[tuple[Case, int]]:
    """(case, steps) to run: the devices', the named ones, the quick ones with their quick steps."""
    import torch

    devices = [d.strip() for d in (args.devices or "").split(",") if d.strip()]
    devices = devices or ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    names = {n.strip() for n in (args.case or "").split(",") if n.strip()}
    unknown = names - {c.name for c in CASES}
    if unknown:
        raise SystemExit(f"unknown case(s) {sorted(unknown)}; the cases: {[c.name for c in CASES]}")
    chosen = [c for c in CASES if (c.name in names if names else c.device in devices)]
    if args.quick:
        return [(c, c.quick_steps or c.steps) for c in chosen if names or c.quick_steps is not None]
    return [(c, c.steps) for c in chosen]


THROUGHPUT_COLUMNS = ["case", "recipe", "seq x batch", "steps", "repeats", "plain tok/s", "learner tok/s", "ratio"]
THROUGHPUT_COLUMNS += ["ratio range", "blocked", "basis", "targets"]
START_COLUMNS = ["case", "plain peak MB", "learner peak MB", "memory ratio", "plain first step s"]
START_COLUMNS += ["learner first step s", "plain warmup s", "learner warmup s", "warmup steps", "learner recipe"]


def print_tables(rows: list[dict[str, Any]]) -> None:
    """Throughput, then memory and start-up, one line per case (failed cases say why)."""
    shown = [_display(r) for r in rows]
    common.print_table(
        "Learner throughput: a real learner process vs the best plain loop (same recipe, device, threads)",
        shown,
        THROUGHPUT_COLUMNS,
    )
    common.print_table(
        "Memory and start-up (peak: CUDA allocated, CPU resident set; first step from process start)",
        shown,
        START_COLUMNS,
    )


def _display(row: dict[str, Any]) -> dict[str, Any]:
    if "error" in row:
        return {"case": row["case"], "recipe": row.get("recipe", ""), "targets": f"not measured: {row['error'][:80]}"}
    mb = lambda b: b / 2**20 if b else None
    spread = f"{row['ratio_lo']:.3f}-{row['ratio_hi']:.3f}" if row["noise"] is not None else "-"
    return {
        **{k: row[k] for k in ("case", "recipe", "steps", "repeats", "ratio", "basis", "memory_ratio")},
        "seq x batch": f"{row['seq_len']} x {row['batch']}",
        "plain tok/s": row["plain_tok_s"],
        "learner tok/s": row["learner_tok_s"],
        "ratio range": spread,
        "blocked": f"{row['blocked']:.2%}" if row["blocked"] is not None else "?",
        "targets": row["verdict"] or "-",
        "plain peak MB": mb(row["plain_peak_bytes"]),
        "learner peak MB": mb(row["learner_peak_bytes"]),
        "memory ratio": row["memory_ratio"],
        "plain first step s": row["plain_first_step_s"],
        "learner first step s": row["learner_first_step_s"],
        "plain warmup s": row["plain_warmup_s"],
        "learner warmup s": row["learner_warmup_s"],
        "warmup steps": _steps(row["warmup_steps"], row["plain_warmup_steps"]),
        "learner recipe": row["learner_recipe"],
    }


def _steps(learner: float | None, plain: float | None) -> str:
    """ "3", or "4 (plain 3)" where the plain loop could not be cut at the learner's count."""
    if learner is None:
        return "?"
    return f"{learner:g}" if learner == plain else f"{learner:g} (plain {plain:g})"


def main(argv: list[str] | None = None) -> int:
    import torch

    args = common.parse_args("learner_throughput", __doc__, _extra, argv)
    repeats = args.repeats or (1 if args.quick else 3)
    deadline, rows, failed = Deadline(args.budget_s), [], 0
    for case, steps in select(args):
        try:
            rows.append(run_case(case, steps, repeats, args.compile_cache, deadline))
        except Exception as exc:  # a benchmark goes on to the next case, and says what went wrong
            failed += 1
            print(f"  {case.name}: not measured: {type(exc).__name__}: {exc}", flush=True)
            error, trace = f"{type(exc).__name__}: {exc}", traceback.format_exc()
            rows.append({"case": case.name, "recipe": case.recipe.label, "error": error, "trace": trace})
        gpu = next((r["device_name"] for r in rows if r.get("device") == "cuda"), None)
        payload = {"benchmark": "learner_throughput", "quick": args.quick, "repeats": repeats, "gpu": gpu}
        payload |= {"torch": torch.__version__, "compile_cache": args.compile_cache, "targets": TARGETS, "rows": rows}
        common.write_json(args.out, payload)  # after every case: a run stopped early keeps what it measured
    print_tables(rows)
    print(f"results: {common.shown(args.out)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
