"""Benchmark: what zstd costs in CPU and saves in bytes on quantized payloads (the `[run] zstd` setting).

For each tensor and mode (int4, int8, bf16, block 128), single thread, CPU time:

- the payload as the codec packs it (scales + codes) and its size after zstd at level 1 (what the
  codec writes), and at the first of the faster negative levels, -1, for comparison (`gain` = payload
  bytes / compressed bytes);
- zstd alone: compress and decompress of that payload (MB of fp32 input per second, so the rows
  compare with the codec's other work), and its CPU time per push (one compress at the learner,
  one decompress at the syncer);
- the whole codec either way (`[run] zstd = true` / `false`): a learner's encode (`codec.encode`),
  the syncer's decode of a push (`codec.decode_quantized` with the native kernel: checks, int4
  codes kept packed), a learner's decode of an update (`codec.decode`: fp32 values);
- `break_even_Mbit/s`: the link rate below which zstd pays for itself on a push: bytes saved x 8 /
  (compress + decompress CPU time). On a faster link, sending the payload without zstd delivers
  it sooner (compression and transfer one after the other, as a push's are).

Tensors: the synthetic outer gradient of bench/codec_throughput.py (N(0, 1e-3) plus 0.1% outliers
x20, a gpt-medium fragment) and a real one (gpt-small's parameters before minus after 20 AdamW
steps). Baseline, same run: `clone()` of the fp32 tensor (memcpy).

    .venv/bin/python bench/zstd_tradeoff.py [--quick] [--out PATH]
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.codec_throughput import SYNTHETIC_NUMEL, real_delta, synthetic
from syncer import native
from syncer.wire import codec

BLOCK = 128
MODES = ("int4", "int8", "bf16")
LEVELS = (1, -1)  # 1 is what the codec writes; -1, the first "fast" level, for comparison
KERNEL = native.load()


def level_rows(name: str, x: torch.Tensor, mode: str, repeat: int) -> list[dict]:
    """zstd alone on the codec's payload of x, at each level: size and speed."""
    n, nbytes = x.numel(), 4 * x.numel()
    raw = codec.payload_here(x, mode, BLOCK).numpy().tobytes()
    rows = []
    for level in LEVELS:
        cctx, dctx = zstandard.ZstdCompressor(level=level, write_content_size=True), zstandard.ZstdDecompressor()
        packed = cctx.compress(raw)
        t_c = common.measure(partial(cctx.compress, raw), repeat=repeat)
        t_d = common.measure(partial(dctx.decompress, packed), repeat=repeat)
        cpu_s = t_c.cpu.median + t_d.cpu.median
        saved = len(raw) - len(packed)
        rows.append(
            {
                "tensor": name,
                "mode": mode,
                "level": level,
                "payload_B/value": len(raw) / n,
                "zstd_B/value": len(packed) / n,
                "gain": len(raw) / len(packed),
                "compress_MB/s": common.mb_per_s(nbytes, t_c.cpu.median),
                "decompress_MB/s": common.mb_per_s(nbytes, t_d.cpu.median),
                "zstd_ms/push": 1e3 * cpu_s,
                "break_even_Mbit/s": max(0.0, 8 * saved / cpu_s / 1e6),  # 0: zstd never pays
                "compress": t_c.to_dict(),
                "decompress": t_d.to_dict(),
            }
        )
    return rows


def codec_rows(name: str, x: torch.Tensor, mode: str, repeat: int, memcpy_mbs: float) -> list[dict]:
    """The whole codec with and without zstd: a learner's encode, the syncer's and a learner's decode."""
    n, nbytes = x.numel(), 4 * x.numel()
    rows = []
    for zstd in (True, False):
        blob = codec.encode(x, mode, BLOCK, zstd=zstd)
        t_enc = common.measure(partial(codec.encode, x, mode, BLOCK, zstd), repeat=repeat)
        t_push = common.measure(partial(codec.decode_quantized, blob, n, KERNEL), repeat=repeat)
        t_update = common.measure(partial(codec.decode, blob, n), repeat=repeat)
        enc, push, upd = (common.mb_per_s(nbytes, t.cpu.median) for t in (t_enc, t_push, t_update))
        rows.append(
            {
                "tensor": name,
                "mode": mode,
                "zstd": zstd,
                "blob_B/value": len(blob) / n,
                "ratio": nbytes / len(blob),
                "encode_MB/s": enc,
                "syncer_decode_MB/s": push,
                "learner_decode_MB/s": upd,
                "encode/memcpy": enc / memcpy_mbs,
                "syncer_decode/memcpy": push / memcpy_mbs,
                "encode": t_enc.to_dict(),
                "syncer_decode": t_push.to_dict(),
                "learner_decode": t_update.to_dict(),
            }
        )
    return rows


def main() -> None:
    args = common.parse_args("zstd_tradeoff", __doc__)
    torch.set_num_threads(1)
    repeat = 7 if args.quick else 41
    tensors = {
        f"synthetic {SYNTHETIC_NUMEL / 1e6:.2f}M": synthetic(SYNTHETIC_NUMEL),
        "gpt-small outer grad": real_delta(20),
    }
    levels, codecs, baselines = [], [], []
    for name, x in tensors.items():
        t_copy = common.measure(x.clone, repeat=max(repeat, 10))
        memcpy = common.mb_per_s(4 * x.numel(), t_copy.cpu.median)
        baselines.append({"tensor": name, "memcpy_MB/s": memcpy, "memcpy": t_copy.to_dict()})
        for mode in MODES:
            levels += level_rows(name, x, mode, repeat)
            codecs += codec_rows(name, x, mode, repeat, memcpy)
    common.print_table(
        f"zstd on the codec's payload (CPU time, median of {repeat}; MB/s of fp32 input)",
        levels,
        [
            "tensor",
            "mode",
            "level",
            "payload_B/value",
            "zstd_B/value",
            "gain",
            "compress_MB/s",
            "decompress_MB/s",
            "zstd_ms/push",
            "break_even_Mbit/s",
        ],
    )
    common.print_table(
        "The codec with and without zstd (setting run.zstd)",
        codecs,
        ["tensor", "mode", "zstd", "blob_B/value", "ratio", "encode_MB/s", "syncer_decode_MB/s", "learner_decode_MB/s"],
    )
    print(
        "break_even_Mbit/s: below this link rate zstd (level 1: what the codec writes) delivers a push sooner; "
        f"above it, raw payloads do. Native kernel: {'yes' if KERNEL is not None else 'no (' + native.problem + ')'}"
    )
    payload = {"benchmark": "zstd_tradeoff", "quick": args.quick, "block": BLOCK, "baselines": baselines}
    common.write_json(args.out, {**payload, "levels": levels, "codec": codecs})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
