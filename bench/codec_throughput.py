"""Benchmark: codec throughput and compression ratio per mode (none, bf16, int8, int4).

For each tensor and mode, single thread (`torch.set_num_threads(1)`), CPU time:
- encode MB/s and decode MB/s, in MB of fp32 input per second (`codec.encode` / `codec.decode`,
  quantization + packing + zstd, and back, with every check a receiver makes);
- compression ratio = fp32 bytes / blob bytes, and zstd's own share of it (packed payload bytes /
  compressed payload bytes);
- max |decode(encode(x)) - x| / max |x|.

Tensors: an outer-gradient-like synthetic one (Gaussian noise, 0.1% outliers x20, the size of a
gpt-medium fragment) and a real outer gradient: gpt-small's parameters before minus after a few
AdamW steps on random tokens (`workload.gpt`).

Baselines, same run, same bytes: `clone()` of the fp32 tensor (memcpy), and zstd level 1 on the
raw fp32 bytes (compress / decompress, and its ratio).

    .venv/bin/python bench/codec_throughput.py [--quick] [--out PATH]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from syncer.wire import codec
from workload.gpt import build

BLOCK = 128
SYNTHETIC_NUMEL = 2_752_512  # the largest gpt-medium fragment (fragments = 4)


def synthetic(numel: int, seed: int = 0) -> torch.Tensor:
    """An outer-gradient-like tensor: N(0, 1e-3) plus 0.1% outliers 20x larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 1e-3
    idx = torch.randint(0, numel, (max(1, numel // 1000),), generator=g)
    x[idx] *= 20.0
    return x


def real_delta(steps: int, seed: int = 0) -> torch.Tensor:
    """gpt-small's flat parameters before minus after `steps` AdamW steps (an outer gradient)."""
    torch.manual_seed(seed)
    model = build("gpt-small")
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        idx = torch.randint(0, 256, (8, 65), generator=g)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return before - after


def _timed(fn: Callable[[], object], repeat: int) -> common.Timing:
    return common.measure(fn, repeat=repeat, warmup=1)


def mode_row(name: str, x: torch.Tensor, mode: str, repeat: int, memcpy_mbs: float) -> dict:
    """Encode/decode speed, ratio and error of one mode on one tensor."""
    n = x.numel()
    nbytes = 4 * n
    blob = codec.encode(x, mode, BLOCK)
    y = codec.decode(blob, expect_numel=n)
    t_enc = _timed(lambda: codec.encode(x, mode, BLOCK), repeat)
    t_dec = _timed(lambda: codec.decode(blob, expect_numel=n), repeat)
    payload = len(blob) - codec._HEADER.size
    enc, dec = common.mb_per_s(nbytes, t_enc.cpu.median), common.mb_per_s(nbytes, t_dec.cpu.median)
    return {
        "tensor": name,
        "mode": mode,
        "encode_MB/s": enc,
        "decode_MB/s": dec,
        "encode_spread": t_enc.cpu.spread,
        "decode_spread": t_dec.cpu.spread,
        "ratio": nbytes / len(blob),
        "zstd_gain": codec.raw_length(mode, n, BLOCK) / payload,
        "max_err/absmax": float((y - x).abs().max() / x.abs().max()),
        "encode/memcpy": enc / memcpy_mbs,
        "decode/memcpy": dec / memcpy_mbs,
        "encode": t_enc.to_dict(),
        "decode": t_dec.to_dict(),
        "blob_bytes": len(blob),
    }


def baseline_rows(name: str, x: torch.Tensor, repeat: int) -> tuple[list[dict], float]:
    """memcpy (clone) and zstd level 1 on the raw fp32 bytes; returns the rows and memcpy MB/s."""
    nbytes = 4 * x.numel()
    t_copy = _timed(x.clone, max(repeat, 10))
    raw = x.numpy().tobytes()
    cctx, dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    packed = cctx.compress(raw)
    t_zc = _timed(lambda: cctx.compress(raw), repeat)
    t_zd = _timed(lambda: dctx.decompress(packed), repeat)
    memcpy = common.mb_per_s(nbytes, t_copy.cpu.median)
    rows = [
        {
            "tensor": name,
            "mode": "memcpy (clone)",
            "encode_MB/s": memcpy,
            "decode_MB/s": memcpy,
            "encode_spread": t_copy.cpu.spread,
            "decode_spread": t_copy.cpu.spread,
            "ratio": 1.0,
            "zstd_gain": 1.0,
            "max_err/absmax": 0.0,
            "encode/memcpy": 1.0,
            "decode/memcpy": 1.0,
            "encode": t_copy.to_dict(),
        },
        {
            "tensor": name,
            "mode": "zstd-1 on fp32",
            "encode_MB/s": common.mb_per_s(nbytes, t_zc.cpu.median),
            "decode_MB/s": common.mb_per_s(nbytes, t_zd.cpu.median),
            "encode_spread": t_zc.cpu.spread,
            "decode_spread": t_zd.cpu.spread,
            "ratio": nbytes / len(packed),
            "zstd_gain": nbytes / len(packed),
            "max_err/absmax": 0.0,
            "encode/memcpy": common.mb_per_s(nbytes, t_zc.cpu.median) / memcpy,
            "decode/memcpy": common.mb_per_s(nbytes, t_zd.cpu.median) / memcpy,
            "encode": t_zc.to_dict(),
            "decode": t_zd.to_dict(),
        },
    ]
    return rows, memcpy


def main() -> None:
    args = common.parse_args("codec_throughput", __doc__)
    torch.set_num_threads(1)
    repeat = 7 if args.quick else 101
    tensors = {
        f"synthetic {SYNTHETIC_NUMEL / 1e6:.2f}M": synthetic(SYNTHETIC_NUMEL),
        "gpt-small outer grad": real_delta(steps=5 if args.quick else 20),
    }
    rows = []
    for name, x in tensors.items():
        base, memcpy = baseline_rows(name, x, repeat)
        rows.extend(base)
        rows.extend(mode_row(name, x, mode, repeat, memcpy) for mode in codec.MODES)
    columns = [
        "tensor",
        "mode",
        "encode_MB/s",
        "decode_MB/s",
        "encode_spread",
        "decode_spread",
        "ratio",
        "zstd_gain",
        "max_err/absmax",
        "encode/memcpy",
        "decode/memcpy",
    ]
    common.print_table(
        f"Codec throughput, 1 thread, block {BLOCK} (MB of fp32 per CPU second, median of {repeat})", rows, columns
    )
    common.write_json(
        args.out,
        {
            "benchmark": "codec_throughput",
            "quick": args.quick,
            "block": BLOCK,
            "numel": {k: v.numel() for k, v in tensors.items()},
            "rows": rows,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
