"""Benchmark: a learner's training throughput against a plain PyTorch loop, on CPU and CUDA.

What the Decoupled DiLoCo machinery costs a learner: tokens per second of a **real learner
process** in a real fleet (`dldctl up`, one learner and the syncer, H = 32, 4 fragments, int4,
quorum 1, overlap on) against, in the same run, a **plain PyTorch loop** that trains the same
model on the same data with the same AdamW, gradient clipping and batch, on the same device and
number of torch threads: forward, backward, clip, step, nothing else (it reads the loss only at
the end). Both are timed from the first step to the last, same step count:

    learner tokens/s = tokens / train_s      (the learner's own `finished` record: wall time of its
                                              loop, pushes, applied replies and heartbeats included)
    plain tokens/s   = tokens / loop seconds (torch.cuda.synchronize() before the clock stops)
    ratio            = learner / plain       (1.0 = the machinery is free)

On CUDA a third loop reads the loss every step like the learner does (`float(loss)`: the host
waits for the GPU once per step), to tell that cost from the rest. Also from the learner's
record: `blocked` = the share of its loop spent outside the train step
(taking the outer gradient, copying it to the CPU, applying replies), `compute` the rest.

Cases: CPU (one torch thread, as in the fleet benchmarks) and, where `torch.cuda.is_available()`,
CUDA (`device = "cuda"`), from small to gpt2-124m.

    .venv/bin/python bench/learner_throughput.py            # full: every case of each device
    .venv/bin/python bench/learner_throughput.py --quick    # fewer cases and steps
    .venv/bin/python bench/learner_throughput.py --devices cuda
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.fleet import BenchRun, diloco_run, local_host
from syncer.common.settings import settings_from_dict
from workload import WorkloadContext, build_workload

# (model, seq_len, batch_size, steps, quick steps) per device; threads per device below
CASES: dict[str, list[tuple[str, int, int, int, int]]] = {
    "cpu": [("gpt-tiny", 32, 8, 400, 150), ("gpt-small", 128, 16, 150, 60)],
    "cuda": [("gpt-small", 128, 64, 600, 200), ("gpt-medium", 256, 32, 400, 200), ("gpt2-124m", 512, 16, 100, 50)],
}
QUICK = {"cpu": ("gpt-small",), "cuda": ("gpt-medium", "gpt2-124m")}
THREADS = {"cpu": 1, "cuda": 2}


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", default=None, help="comma-separated; default cpu, plus cuda where available")


def settings(model: str, seq_len: int, batch: int, steps: int) -> dict[str, Any]:
    """The fleet's [run] table for one case (evaluation only at the end of the budget)."""
    return diloco_run(
        32, model=model, seq_len=seq_len, batch_size=batch, steps=steps, warmup=10, eval_every=steps, eval_batches=2
    )


def plain_loop(run: dict[str, Any], device: str, threads: int, read_loss: bool = False) -> dict[str, Any]:
    """The same model, data, AdamW and clipping, trained by a bare loop in this process; with
    `read_loss` it reads the loss every step, as the learner does (on CUDA: a sync per step)."""
    torch.set_num_threads(threads)
    full = settings_from_dict(dict(run)).to_dict()
    ctx = WorkloadContext(
        settings=full,
        learner_index=0,
        shards=1,
        batch_size=int(full["batch_size"]),
        device=torch.device(device),
        seed=int(full["seed"]),
    )
    wl = build_workload(ctx)
    opt = torch.optim.AdamW(wl.model.parameters(), lr=full["lr"], weight_decay=full["weight_decay"])
    steps, tokens = int(full["steps"]), 0
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        batch = wl.next_batch()
        loss = wl.loss(wl.model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(wl.model.parameters(), full["grad_clip"])
        opt.step()
        tokens += wl.tokens(batch)
        if read_loss:
            float(loss.detach())
    final = float(loss.detach())
    _sync(device)
    seconds = time.perf_counter() - t0
    params = sum(p.numel() for p in wl.model.parameters())
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "final_loss": final,
        "parameters": params,
        "device_name": name,
    }


def plain_loop_apart(run: dict[str, Any], device: str, threads: int, read_loss: bool = False) -> dict[str, Any]:
    """`plain_loop` in a fresh process: this one never holds the GPU (a GPU in exclusive-process
    mode would refuse the learner a context), and the learner's run starts from a clean device."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(plain_loop, run, device, threads, read_loss).result()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def learner_run(run: dict[str, Any], device: str, threads: int) -> dict[str, Any]:
    """One real learner process in a real fleet; its `finished` record."""
    with BenchRun("throughput") as fleet:
        fleet.up(run, [local_host("here", 1, device=device, threads=threads)])
        try:
            fleet.wait_for(
                lambda: _finished(fleet) is not None,
                120 + 2.0 * int(run["steps"]),
                "the learner to finish its steps",
                every=0.5,
            )
        except TimeoutError:
            _show_logs(fleet)
            raise
        record = _finished(fleet)
        fleet.down()
    assert record is not None
    record["tokens_per_s"] = record["tokens"] / record["train_s"]
    record["blocked_frac"] = record["blocked_s"] / record["train_s"]
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
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not there yet, or being written


def case(device: str, model: str, seq_len: int, batch: int, steps: int) -> dict[str, Any]:
    """Plain loop first (it warms nothing the learner process could reuse), then the learner."""
    run = settings(model, seq_len, batch, steps)
    threads = THREADS["cuda" if device.startswith("cuda") else "cpu"]
    print(f"  {device} {model} seq {seq_len} batch {batch}: {steps} steps ...", flush=True)
    plain = plain_loop_apart(run, device, threads)
    synced = plain_loop_apart(run, device, threads, read_loss=True) if device.startswith("cuda") else None
    print(f"    plain loop {plain['tokens_per_s']:,.0f} tok/s; now the learner", flush=True)
    ours = learner_run(run, device, threads)
    row = {
        "device": device,
        "device_name": plain["device_name"],
        "model": model,
        "parameters": plain["parameters"],
        "seq_len": seq_len,
        "batch": batch,
        "steps": steps,
        "threads": threads,
        "plain_tok_s": plain["tokens_per_s"],
        "learner_tok_s": ours["tokens_per_s"],
        "ratio": ours["tokens_per_s"] / plain["tokens_per_s"],
        "blocked": ours["blocked_frac"],
        "plain_read_loss_tok_s": synced["tokens_per_s"] if synced else None,
        "plain": plain,
        "plain_read_loss": synced,
        "learner": ours,
    }
    print(
        f"    plain {row['plain_tok_s']:,.0f} tok/s, learner {row['learner_tok_s']:,.0f} tok/s, "
        f"ratio {row['ratio']:.3f}, blocked {row['blocked']:.1%}",
        flush=True,
    )
    return row


def devices(arg: str | None) -> list[str]:
    """The devices to run: the argument, or cpu plus cuda where torch sees a GPU."""
    if arg:
        return [d.strip() for d in arg.split(",") if d.strip()]
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("learner_throughput", __doc__, _extra, argv)
    rows = []
    for device in devices(args.devices):
        kind = "cuda" if device.startswith("cuda") else "cpu"
        for model, seq_len, batch, steps, quick_steps in CASES[kind]:
            if args.quick and model not in QUICK[kind]:
                continue
            rows.append(case(device, model, seq_len, batch, quick_steps if args.quick else steps))
    common.print_table(
        "Learner throughput: a real learner process vs a plain PyTorch loop",
        rows,
        [
            "device",
            "model",
            "parameters",
            "seq_len",
            "batch",
            "steps",
            "plain_tok_s",
            "plain_read_loss_tok_s",
            "learner_tok_s",
            "ratio",
            "blocked",
        ],
    )
    gpu = next((r["device_name"] for r in rows if r["device"].startswith("cuda")), None)
    common.write_json(
        args.out,
        {"benchmark": "learner_throughput", "quick": args.quick, "gpu": gpu, "torch": torch.__version__, "rows": rows},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
