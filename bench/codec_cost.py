"""Benchmark: what each codec costs in CPU, on a real outer gradient and in the syncer's round (issue 52).

1. **Encode and decode** of a real gpt-small outer gradient (the model trained H = 32 AdamW
   steps on the built-in corpus from its initial weights; initial - final, 0.83 M values), per
   codec: int4 (the baseline), none, 2bit and topk, zstd on. Encode is what a learner does per
   push (2bit/topk: with the error-feedback residual, learner/feedback.py), decode what the
   syncer and every learner do per blob. MB/s of the fp32 values the blob stands for, one
   thread, CPU time; bits per value on the wire and the relative error of one round trip.
2. **The syncer's round** (bench/syncer_throughput.py's real `SyncerCore`, 4 learners, gpt-small,
   default settings), each codec for pushes and updates alike: round time per fragment on one
   core and its ratio to int4's, same run (int4 with the native kernel, as production runs it,
   and with the torch round step, which is what every other codec takes).

    .venv/bin/python bench/codec_cost.py [--quick] [--out PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.syncer_throughput import Rounds, build_core, global_model, outer_gradient
from learner.feedback import ErrorFeedback
from syncer.common.settings import RunSettings
from syncer.wire import codec, quant
from workload.data import builtin_corpus
from workload.gpt import GPT, config_for

MODEL, SEQ, BATCH, H = "gpt-small", 32, 8, 32
CODECS = ("int4", "none", "2bit", "topk")


def real_outer_gradient(steps: int = H, seed: int = 0) -> torch.Tensor:
    """initial - final of gpt-small after `steps` AdamW steps on the built-in corpus, flat."""
    torch.manual_seed(seed)
    model = GPT(config_for(MODEL, block_size=SEQ))
    start = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    tokens = torch.from_numpy(builtin_corpus().tokens[: 1 << 20].astype("int64"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        at = torch.randint(0, tokens.numel() - SEQ - 1, (BATCH,), generator=g)
        x = torch.stack([tokens[i : i + SEQ] for i in at])
        y = torch.stack([tokens[i + 1 : i + SEQ + 1] for i in at])
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return start - torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def block_of(mode: str, s: RunSettings) -> int:
    return quant.wire_block(mode, s.block, s.topk_keep)


def coding(delta: torch.Tensor, mode: str, repeat: int) -> dict[str, Any]:
    """Encode (through error feedback, as a learner pushes) and decode MB/s, size and error."""
    block, fb = block_of(mode, RunSettings()), ErrorFeedback()
    enc = common.measure(lambda: fb.encode(0, delta, mode, block, True), repeat=repeat, warmup=1)
    blob = codec.encode(delta, mode, block)
    dec = common.measure(lambda: codec.decode(blob, expect_numel=delta.numel()), repeat=repeat, warmup=1)
    err = float((codec.decode(blob) - delta).norm() / delta.norm())
    nbytes = 4 * delta.numel()
    return {
        "codec": mode,
        "bits/value": 8 * len(blob) / delta.numel(),
        "x fewer than int4": 0.0,
        "round-trip error": err,
        "encode MB/s": common.mb_per_s(nbytes, enc.cpu.median),
        "decode MB/s": common.mb_per_s(nbytes, dec.cpu.median),
        "encode ms": 1e3 * enc.cpu.median,
        "decode ms": 1e3 * dec.cpu.median,
    }


def round_time(mode: str, native: bool, repeat: int) -> dict[str, Any]:
    """Median CPU ms per fragment round of a 4-learner syncer in `mode` (pushes and updates)."""
    from bench.syncer_throughput import KERNEL

    s = RunSettings(model=MODEL, fragments=4, H=64, round_clock="learner", compression=mode)  # type: ignore[arg-type]
    core = build_core(MODEL, s, KERNEL if native else None)
    blobs = []
    for p, theta in enumerate(global_model(core).theta):
        shared = torch.randn(theta.numel(), generator=torch.Generator().manual_seed(1000 + p)) * 3e-4
        row = [
            codec.encode(outer_gradient(theta.numel(), 10 * p + m, shared), mode, block_of(mode, s)) for m in range(4)
        ]
        blobs.append(row)
    rounds = Rounds(core, blobs, s.H)
    timing = common.measure(rounds, repeat=repeat, warmup=1)
    return {
        "codec": mode,
        "round step": "native" if native and mode in ("int4", "int8") else "torch",
        "round ms/fragment": 1e3 * timing.cpu.median / s.fragments,
        "spread": timing.cpu.spread,
    }


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args("codec_cost", __doc__, None, argv)
    torch.set_num_threads(1)
    repeat = 3 if args.quick else 9
    delta = real_outer_gradient()
    coded = [coding(delta, mode, repeat) for mode in CODECS]
    for r in coded:
        r["x fewer than int4"] = coded[0]["bits/value"] / r["bits/value"]
    common.print_table(f"Codecs on a real {MODEL} outer gradient ({delta.numel():,} values, H = {H}), one core", coded)
    rounds = [round_time("int4", True, repeat), round_time("int4", False, repeat)]
    rounds += [round_time(mode, False, repeat) for mode in CODECS[1:]]
    for r in rounds:
        r["x int4 (native)"] = r["round ms/fragment"] / rounds[0]["round ms/fragment"]
    common.print_table(f"The syncer's round, 4 learners, {MODEL}, one core (CPU time)", rounds)
    common.write_json(args.out, {"benchmark": "codec_cost", "model": MODEL, "coding": coded, "rounds": rounds})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
