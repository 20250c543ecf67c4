"""Benchmark: the data ledger (issue 50): every unit of an epoch merged once, no mixture bias.

The syncer owns the data cursor (`data_order = "ledger"`, the default): the train tokens are
cut into sequences, each epoch orders them by a seeded permutation cut into work units, the
syncer hands unit ids out and a unit is merged once every fragment merged a push naming it.
`data_order = "shards"` (the old behaviour, the baseline) has learner i sample random windows
of its own contiguous shard. gpt-tiny, H = 16, 4 fragments, batch 8, seq_len 64, bytes.

1. **Exactly once.** 2 fast and 2 half-speed learners (`throttle = 2`) train one epoch of the
   built-in corpus's first N bytes (sized so that an epoch takes about 3 min here) under chaos:
   a seeded random learner killed every ~20 s on average, one `learner add` a third of the way
   into the epoch, the syncer killed once half-way (`checkpoint_s = 1`; the supervisor restarts
   it from its checkpoint). Until epoch 1 is merged, or any epoch is (status `epochs_done >= 1`),
   or epoch 1 stalls (over 90% merged, no progress for 30 s). Epoch 1's units still open then
   (from status, and which ones from the last checkpoint before `down`); from the final
   checkpoint's ledger: units of epoch 1 never merged (target 0) and partly merged; from the
   learners' own `units.jsonl`: units trained more than once, and whether a `units_requeued`
   event named each between its trainings (unexplained: target 0); off-ledger tokens, the
   lost/reissued counters.
2. **No mixture bias.** A text file of two halves, ASCII text then the same text with every
   byte + 128; 4 learners, the two of host "slow" (learner-2, learner-3: with shards they
   hold the second half) at `throttle = 3`; the same `duration` with either order. The final
   model is scored on held-out ASCII text not in the file (kind A) and the same text + 128
   (kind B): loss per kind and their ratio (target with the ledger: within 3%); with the ledger,
   each half's share of the merged units' sequences (target 50% +- 1%).
3. **Quality.** The same two runs: held-out loss on both kinds together, ledger vs shards.
4. **Cost.** The syncer's median round time (`round` records' `merge_s`) and the learners'
   blocked share (their `finished` records), ledger vs shards (target within 1%). Two fleets of
   one order differ by a few percent on a shared machine, so the full run does two pairs in ABBA
   order (ledger, shards, shards, ledger), compares the pairs' mean medians and reports how far
   the two shards fleets are apart. The ledger's own bookkeeping runs after a round's update
   has left (SyncerCore.settle); its CPU time per round is the status's `data.bookkeeping_s`.

    .venv/bin/python bench/data_ledger.py            # full: ~15 min on 2 cores
    .venv/bin/python bench/data_ledger.py --quick    # ~5 min (a shorter epoch and runs)
    .venv/bin/python bench/data_ledger.py --only mixture
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common, evaluate
from bench.fleet import BenchRun, diloco_run, local_host, read_jsonl
from bench.fleet_summary import blocked_share, finished_learners
from syncer import checkpoint
from syncer.datadesk import parse_ranges
from workload.data import Corpus, eval_batches, load_corpus, split
from workload.units import UnitPlan

LEARNERS, H, SEQ_LEN, BATCH = 4, 16, 64, 8
EPOCH_BYTES = 12_000_000  # all of the built-in corpus: one epoch ~3 min of this fleet on 2 quiet cores
MIX_S = 100.0  # the mixture runs' `duration`
MIX_BYTES = 6_000_000  # the two-kind file
HELD_OUT = 1 << 16  # held-out bytes of each kind
EVAL_COUNT = 64  # held-out batches of each kind
KILL_EVERY_S = 20.0  # mean gap between learner kills (exponential, seeded)
STALL_FROM, STALL_S = 0.9, 30.0  # epoch 1 over 90% merged and no progress for 30 s: stop, report
RATIO_TARGET, SHARE_TARGET, COST_TARGET = 0.03, 0.01, 0.01
MET = {True: "MET", False: "MISSED"}
KEEP = bool(os.environ.get("DLD_BENCH_KEEP"))  # keep the fleets' homes (bench/fleet.py)


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epoch-bytes", type=int, default=None, help=f"part 1 data (default {EPOCH_BYTES:,})")
    parser.add_argument("--duration", type=float, default=None, help="mixture runs' duration s (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("once", "mixture"), default=None)
    parser.add_argument("--pairs", type=int, default=None, help="mixture pairs, ABBA order (default 2; quick 1)")


def base_run(data: Path, seed: int, **extra: Any) -> dict[str, Any]:
    """The [run] table: the fleet benchmarks' workload at seq_len 64, H = 16, on `data`."""
    return diloco_run(H, seq_len=SEQ_LEN, batch_size=BATCH, data=str(data), seed=seed, eval_every=500, **extra)


# --------------------------------------------------------------------------- data files


def ascii_text() -> np.ndarray:
    """The built-in corpus's bytes below 128 (a NUL-free ASCII text stream)."""
    tokens = np.asarray(load_corpus("builtin").tokens)
    return tokens[(tokens < 128) & (tokens > 0)]


def mixture_file(path: Path, size: int) -> tuple[int, np.ndarray]:
    """Write ASCII text, then the same text with every byte + 128, `size` bytes in all, split so
    that the train region (all but the eval tail) is half each kind: shard 2 of 4 starts at the
    second kind. Returns (first token of kind B, held-out ASCII text that is not in the file)."""
    text = ascii_text()
    if len(text) < size + HELD_OUT:
        raise SystemExit(f"the built-in corpus has {len(text)} ASCII bytes: too few for {size:,}")
    _, (ev0, _) = split(Corpus(range(size), 256, "bench"), shards=1)  # type: ignore[arg-type]
    half = ev0 // 2
    body = np.concatenate([text[:half], text[: size - half] + 128]).astype(np.uint8)
    path.write_bytes(body.tobytes())
    return half, text[size : size + HELD_OUT].copy()


# --------------------------------------------------------------------------- 1. exactly once


def chaos(fleet: BenchRun, start: float, stop: threading.Event, seed: int, mean_gap: float) -> list[dict[str, Any]]:
    """Kill a seeded random learner every `mean_gap` s on average; `learner add` once a third of
    epoch 1 is merged, kill the syncer once half of it is. Returns what was done, when."""
    rng = random.Random(seed)
    learners = [f"learner-{i}" for i in range(LEARNERS)]
    done: list[dict[str, Any]] = []
    next_kill = start + rng.expovariate(1.0 / mean_gap)
    target = rng.choice(learners)
    share, checked, added, synced = 0.0, 0.0, False, False
    note = lambda action: done.append({"t": time.time() - start, "action": action, "epoch_share": share})
    while not stop.wait(0.5):
        now = time.time()
        if now - checked >= 2.0:
            share, checked = _epoch_share(fleet), now
        if now >= next_kill and fleet.kill(target):
            note(f"kill {target}")
            next_kill, target = time.time() + rng.expovariate(1.0 / mean_gap), rng.choice(learners)
        if share >= 1 / 3 and not added:
            added = (
                fleet.dl("learner", "add", "--host", "fast", "--count", "1", check=False, timeout=180).returncode == 0
            )
            note(f"learner add ({'done' if added else 'refused'})")
            learners.append(f"learner-{len(learners)}")
        if share >= 1 / 2 and not synced and fleet.kill("syncer"):
            synced = True
            note("kill syncer")
    return done


class EpochWatch:
    """When part 1 ends: epoch 1 merged (the samples' `data_epoch` moves on), any epoch merged
    (`epoch_done`, status `epochs_done >= 1`), or epoch 1 stalled: over STALL_FROM merged and
    its share unchanged for STALL_S (units that can only close when their holder ends)."""

    def __init__(self, fleet: BenchRun) -> None:
        self.fleet, self.share, self.since = fleet, -1.0, time.time()

    def ended(self) -> str | None:
        share = _epoch_share(self.fleet)
        if share >= 1.0:
            return "epoch 1 merged"
        if self.fleet.events("epoch_done"):
            return "an epoch_done event: " + str(self.fleet.events("epoch_done")[0]["detail"])[:40]
        if share != self.share:
            self.share, self.since = share, time.time()
        elif share >= STALL_FROM and time.time() - self.since >= STALL_S:
            return f"epoch 1 stalled at {share:.2%} merged for {STALL_S:g} s"
        return None


def _epoch_share(fleet: BenchRun) -> float:
    """Epoch 1's merged share in the latest sample (1 once epoch 2 is under way)."""
    for s in reversed(fleet.samples()):
        if "data_epoch" in s:
            return 1.0 if s["data_epoch"] > 1 else float(s["data_merged_share"])
    return 0.0


def run_once(root: Path, size: int, seed: int, timeout: float) -> dict[str, Any]:
    """Part 1: one epoch under chaos; the audit of its ledger and the learners' logs."""
    data = root / "prefix.txt"
    size = data.write_bytes(np.asarray(load_corpus("builtin").tokens[:size]).tobytes())
    run = base_run(data, seed, checkpoint_s=1.0)  # a syncer restart retrains what merged since its checkpoint
    hosts = [local_host("fast", 2), local_host("slow", 2, throttle=2.0)]
    with BenchRun("ledger-once", keep=KEEP) as fleet:
        fleet.up(run, hosts)
        start = fleet.wait_training(LEARNERS)
        stop, box = threading.Event(), []
        worker = threading.Thread(target=lambda: box.append(chaos(fleet, start, stop, seed, KILL_EVERY_S)))
        worker.start()
        try:
            reason = fleet.wait_for(EpochWatch(fleet).ended, timeout, "epoch 1 merged", every=1.0)
        except TimeoutError:
            reason = f"time limit ({timeout:g} s)"  # reported: the audit says what was not merged
        epoch_s = time.time() - start
        stop.set()
        worker.join(timeout=200)
        status = fleet.status().get("data") or {}
        down_t = time.time()
        fleet.down()
        assert fleet.run_dir is not None
        state, problems = checkpoint.load_latest(fleet.run_dir / "checkpoints")
        events = fleet.events()
        out = audit(fleet.run_dir, (state or {}).get("data") or {}, events)
        out["before_down"] = open_before(fleet.run_dir / "checkpoints", down_t, out["units"])
        samples = fleet.samples()
    out |= {"epoch_s": epoch_s, "stop_reason": reason, "data_bytes": size, "status_data": status}
    done = [s["t"] - start for s in samples if s.get("data_epoch", 1) > 1 and s["t"] - start <= epoch_s]
    out |= {"epoch1_done_s": done[0] if done else None}
    out |= {"checkpoint_problems": problems, "chaos": box[0] if box else None, "seed": seed}
    out["event_counts"] = dict(collections.Counter(e.get("kind") for e in events))
    out["epoch_done_events"] = [e["detail"] for e in events if e.get("kind") == "epoch_done"]
    return out


def open_before(directory: Path, t: float, count: int) -> dict[str, Any]:
    """Epoch 1's units still open in the newest checkpoint written before `t` (the stop): who
    held them, the fragments that had merged or been handed a push naming them."""
    for path in checkpoint.list_checkpoints(directory):
        if int(path.stem.rsplit("-", 1)[1]) < t * 1e3:
            ledger = checkpoint.read(path).get("data") or {}
            held = sorted((int(u), x) for u, x in ledger.get("open", {}).items() if int(u) < count)
            keys = ("learner", "inc", "merged", "carried", "carried_on", "missed")
            units = {str(u): dict(zip(keys, x)) for u, x in held[:40]}
            return {"checkpoint": path.name, "closed": ledger["closed"].get("0"), "open": len(held), "units": units}
    return {}


def closed_uids(ledger: dict[str, Any]) -> set[int]:
    """Units closed (merged or partly): below the cursor, neither open nor queued again."""
    open_, queued = {int(u) for u in ledger["open"]}, {int(u) for u in ledger["requeue"]}
    return {u for u in range(int(ledger["next_uid"])) if u not in open_ and u not in queued}


def trainings(run_dir: Path) -> dict[int, list[tuple[float, str, str]]]:
    """unit -> [(t, learner, incarnation)] from every learner's own units.jsonl, in time order."""
    out: dict[int, list[tuple[float, str, str]]] = collections.defaultdict(list)
    for path in sorted(run_dir.glob("**/units.jsonl")):
        for rec in read_jsonl(path):
            out[int(rec["unit"])].append((float(rec["t"]), str(rec.get("learner", path.parent.name)), str(rec["inc"])))
    return {u: sorted(v) for u, v in out.items()}


def requeues(events: list[dict[str, Any]]) -> dict[int, list[tuple[float, str]]]:
    """unit -> [(t, target)] of the `units_requeued` events naming it."""
    out: dict[int, list[tuple[float, str]]] = collections.defaultdict(list)
    for e in events:
        if e.get("kind") == "units_requeued" and "units " in str(e.get("detail", "")):
            for uid in parse_ranges(str(e["detail"]).rsplit("units ", 1)[1]):
                why = str(e["detail"]).rsplit("; units ", 1)[0].split("): ")[-1].split(" (")[-1].rstrip(")")
                out[uid].append((float(e["t"]), f"{e.get('target')}: {why}"))
    return out


def audit(run_dir: Path, ledger: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """Epoch 1 by the ledger (never merged, partly) and by the learners (trained twice, and why)."""
    sequences, unit_sequences, seq_len, _ = ledger["dataset"]
    count = UnitPlan(sequences, unit_sequences, seq_len).count
    merged, partial = ledger["closed"].get("0", [0, 0])
    closed = {u for u in closed_uids(ledger) if u < count}
    trained = {u: v for u, v in trainings(run_dir).items() if u < count}
    named = requeues(events)
    multi = {u: v for u, v in trained.items() if len(v) > 1}
    by_count = [u for u, v in multi.items() if len(named.get(u, [])) >= len(v) - 1]
    strict = [u for u, v in multi.items() if _each_retraining_named(v, named.get(u, []))]
    unexplained, odd = sorted(set(multi) - set(by_count)), sorted(set(multi) - set(strict))
    return {
        "units": count,
        "unit_tokens": unit_sequences * seq_len,
        "merged": merged,
        "partial": partial,
        "never_merged": count - merged - partial,
        "not_closed_ids": sorted(set(range(count)) - closed)[:50],
        "closed_never_trained": sorted(closed - set(trained))[:50],
        "trained_twice_or_more": len(multi),
        "trained_twice_share": len(multi) / count if count else None,
        "explained_by_requeue": len(by_count),
        "explained_in_time_order": len(strict),
        "unexplained": len(unexplained),
        "reasons": dict(collections.Counter(named[u][0][1].split(": ", 1)[1] for u in multi if named.get(u))),
        "suspicious": {str(u): {"trained": multi[u], "requeued": named.get(u, [])} for u in odd[:20]},
        "counters": ledger.get("counters", {}),
        "off_ledger_tokens_checkpoint": sum((ledger.get("off_ledger") or {}).values()),
    }


def _each_retraining_named(done: list[tuple[float, str, str]], named: list[tuple[float, str]]) -> bool:
    """Whether between every two trainings of a unit an event put it back to the queue."""
    return all(any(a[0] <= t <= b[0] for t, _ in named) for a, b in itertools.pairwise(done))


# --------------------------------------------------------------------------- 2-4. mixture, quality, cost


def run_mixture(order: str, data: Path, half: int, held: np.ndarray, duration: float, seed: int) -> dict[str, Any]:
    """One run of `order` for `duration` s per learner: losses per kind, half shares, cost."""
    run = base_run(data, seed, data_order=order, duration=duration)
    hosts = [local_host("fast", 2), local_host("slow", 2, throttle=3.0)]
    with BenchRun(f"ledger-mix-{order}", keep=KEEP) as fleet:
        fleet.up(run, hosts)
        start = fleet.wait_training(LEARNERS)
        fleet.wait_for(lambda: finished_learners(fleet, LEARNERS) >= LEARNERS, duration + 300, "learners finished")
        end = time.time()
        summary = fleet.down()
        assert fleet.run_dir is not None
        out = {"order": order, "train_s": end - start, "losses": score(summary["final_model"], run, held)}
        out |= cost(fleet)
        out |= half_shares(fleet, order, half, seed)
    return out


def score(path: str, run: dict[str, Any], held: np.ndarray) -> dict[str, float]:
    """Held-out loss of the final model on kind A (ASCII), kind B (+128), both, and the file's tail."""
    wl = evaluate.workload(run)
    state = evaluate.load_state_dict(path)
    out = {"file_tail": evaluate.eval_loss(state, run, wl)}
    for kind, tokens in {"A": held, "B": (held + 128).astype(np.uint8)}.items():
        batches = eval_batches(tokens, 0, len(tokens), batch_size=BATCH, seq_len=SEQ_LEN, count=EVAL_COUNT)
        out[kind] = evaluate.eval_loss(state, run, dataclasses.replace(wl, eval_batches=batches))
    out["both"] = (out["A"] + out["B"]) / 2
    out["B/A"] = out["B"] / out["A"]
    return out


def finished_records(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each learner's `finished` marker (steps, tokens, busy_s, blocked_s, ...)."""
    marks = {p.parent.name: p.read_text().strip().splitlines() for p in run_dir.glob("learners/*/finished")}
    return {name: json.loads(lines[-1]) for name, lines in sorted(marks.items()) if lines}


def cost(fleet: BenchRun) -> dict[str, Any]:
    """Syncer merge time per round and the learners' blocked share."""
    assert fleet.run_dir is not None
    rounds, samples = fleet.rounds(), fleet.samples()
    merges = [1e3 * r["merge_s"] for r in rounds] or [0.0]
    ledger = max([s.get("data_bookkeeping_s", 0.0) for s in samples] or [0.0])  # CPU s, after the rounds
    fin = finished_records(fleet.run_dir)
    busy, blocked = sum(r["busy_s"] for r in fin.values()), sum(r["blocked_s"] for r in fin.values())
    return {
        "rounds": len(merges),
        "merge_ms_mean": statistics.fmean(merges),
        "merge_ms_median": statistics.median(merges),
        "ledger_cpu_us_per_round": 1e6 * ledger / len(rounds) if rounds else None,
        "in_flight_median": statistics.median([s.get("data_in_flight", 0) for s in samples] or [0]),
        "blocked_share": blocked / (busy + blocked) if busy + blocked else None,
        "blocked_share_samples": blocked_share(samples),
        "tokens_trained": sum(int(r["tokens"]) for r in fin.values()),
        "tokens_by_learner": {k: int(r["tokens"]) for k, r in fin.items()},
    }


def half_shares(fleet: BenchRun, order: str, half: int, seed: int) -> dict[str, Any]:
    """The first half's share of what was trained: by the learners (shards: learners 0-1 hold
    it), and with the ledger of the merged units' sequences and of the trained units'."""
    assert fleet.run_dir is not None
    fin = finished_records(fleet.run_dir)
    total = sum(int(r["tokens"]) for r in fin.values()) or 1
    first = sum(int(r["tokens"]) for k, r in fin.items() if k in ("learner-0", "learner-1"))
    out: dict[str, Any] = {"first_half_share_by_holder": first / total}
    if order != "ledger":
        return out
    state, _ = checkpoint.load_latest(fleet.run_dir / "checkpoints")
    ledger = (state or {}).get("data") or {}
    sequences, unit_sequences, seq_len, _ = ledger["dataset"]
    plan = UnitPlan(sequences, unit_sequences, seq_len, seed)
    trained = [u for u, v in trainings(fleet.run_dir).items() for _ in v]
    out["first_half_share_merged"] = _first_share(plan, sorted(closed_uids(ledger)), half)
    out["first_half_share_trained"] = _first_share(plan, trained, half)
    out["merged_units"] = len(closed_uids(ledger))
    out["counters"] = ledger.get("counters", {})
    return out


def _first_share(plan: UnitPlan, uids: list[int], half: int) -> float | None:
    """Share of these units' sequences that start in the first half (token < `half`)."""
    seqs = np.concatenate([plan.sequences_of(u) for u in uids] or [np.zeros(0, np.int64)])
    return float(np.mean(seqs * plan.seq_len < half)) if len(seqs) else None


# --------------------------------------------------------------------------- report


def once_row(res: dict[str, Any]) -> dict[str, Any]:
    c, st, kills = res["counters"], res["status_data"], [d for d in res["chaos"] or [] if "learner-" in d["action"]]
    return {
        "stop": res["stop_reason"],
        "s": res["epoch_s"],
        "units/epoch": res["units"],
        "open at stop": 0
        if st.get("epoch", 1) > 1
        else st.get("units", 0) - st.get("merged", 0) - st.get("partial", 0),
        "never merged": res["never_merged"],
        "partly merged": res["partial"],
        "trained >1x": res["trained_twice_or_more"],
        "share": res["trained_twice_share"],
        "unexplained": res["unexplained"],
        "off-ledger tokens": st.get("off_ledger_tokens", res["off_ledger_tokens_checkpoint"]),
        "lost": c.get("lost", 0),
        "reissued": c.get("reissued", 0),
        "learner kills": len(kills),
    }


def mixture_row(res: dict[str, Any]) -> dict[str, Any]:
    loss = res["losses"]
    return {
        "order": res["order"],
        "loss A": loss["A"],
        "loss B": loss["B"],
        "B/A": loss["B/A"],
        "loss both": loss["both"],
        "1st half share": res.get("first_half_share_merged", res["first_half_share_by_holder"]),
        "tokens trained": res["tokens_trained"],
        "merge ms (median)": res["merge_ms_median"],
        "merge ms (mean)": res["merge_ms_mean"],
        "rounds": res["rounds"],
        "blocked": res["blocked_share"],
    }


def mixture(root: Path, args: argparse.Namespace, duration: float) -> dict[str, Any]:
    """Parts 2-4: the same fleet and duration with the ledger and with shards."""
    size = MIX_BYTES // 2 if args.quick else MIX_BYTES
    half, held = mixture_file(root / "mixture.txt", size)
    orders = ["ledger", "shards", "shards#2", "ledger#2"][: 2 * (args.pairs or (1 if args.quick else 2))]
    runs = {o: run_mixture(o.split("#")[0], root / "mixture.txt", half, held, duration, args.seed) for o in orders}
    led, sh = runs["ledger"], runs["shards"]
    rounds = {o: statistics.fmean(r["merge_ms_median"] for k, r in runs.items() if k.startswith(o)) for o in orders[:2]}
    return {
        "data_bytes": size,
        "first_half_tokens": half,
        "duration_s": duration,
        "runs": runs,
        "ratio_met": abs(led["losses"]["B/A"] - 1) <= RATIO_TARGET,
        "share_met": abs((led.get("first_half_share_merged") or 0) - 0.5) <= SHARE_TARGET,
        "quality_met": led["losses"]["both"] <= sh["losses"]["both"],
        "merge_time_ratio": rounds["ledger"] / rounds["shards"],  # the pairs' mean medians
        "same_order_spread": abs(sh["merge_ms_median"] / runs["shards#2"]["merge_ms_median"] - 1)
        if "shards#2" in runs
        else None,  # two runs of shards: how far apart two fleets of one order are
        "blocked_diff": (led["blocked_share"] or 0) - (sh["blocked_share"] or 0),
        "round_time_met": rounds["ledger"] / rounds["shards"] - 1 <= COST_TARGET,  # a cost: at most 1% slower
    }


def report(out: dict[str, Any]) -> None:
    if "once" in out:
        common.print_table("1. One epoch under chaos (2 fast, 2 half-speed, +1)", [once_row(out["once"])])
    if mix := out.get("mixture"):
        rows = [{**mixture_row(r), "order": k} for k, r in mix["runs"].items()]
        common.print_table(f"2-4. Two kinds of text, slow learners on kind B, {mix['duration_s']:g} s", rows)
        blocked, cpu = mix["blocked_diff"], mix["runs"]["ledger"]["ledger_cpu_us_per_round"] or 0.0
        print(
            f"ledger: B/A {rows[0]['B/A']:.4f} ({MET[mix['ratio_met']]}), first-half share "
            f"{rows[0]['1st half share']:.4f} ({MET[mix['share_met']]}), both kinds {MET[mix['quality_met']]}; "
            f"median round x{mix['merge_time_ratio']:.3f} ({MET[mix['round_time_met']]}; two shards fleets "
            f"{100 * (mix.get('same_order_spread') or 0):.1f}% apart; the ledger's bookkeeping "
            f"runs after a round's update left: {cpu:.0f} us of CPU a round, not in it), "
            f"blocked {100 * blocked:+.2f} points ({MET[abs(blocked) <= COST_TARGET]})"
        )


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("data_ledger", __doc__, _extra, argv)
    size = args.epoch_bytes or (1_000_000 if args.quick else EPOCH_BYTES)
    duration = args.duration or (45.0 if args.quick else MIX_S)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=common.ROOT)
    out: dict[str, Any] = {"benchmark": "data_ledger", "quick": args.quick, "commit": head.stdout.strip()}
    with tempfile.TemporaryDirectory(prefix="dld-ledger-data-") as tmp:
        if args.only in (None, "once"):
            out["once"] = run_once(Path(tmp), size, args.seed, timeout=200 if args.quick else 420)
        if args.only in (None, "mixture"):
            out["mixture"] = mixture(Path(tmp), args, duration)
    report(out)
    common.write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
