"""One rank of the FSDP2 layout test (tests/integration/test_fsdp_layout.py), on gloo over loopback.

Run as `python -m tests.integration.fsdp_worker OUT.json` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. Every rank builds each model (gpt-tiny, a small one with uneven rows) twice from
one seed, a reference left whole and a model sharded by `shard_model`, then checks the layout
against the reference. A check records "" (passed) or what went wrong, and never raises between
collectives: every rank always makes the same collective calls in the same order, so a failed
check cannot hang its peer. The results go to OUT.json ({check: message}); an unexpected
exception ends the rank with a traceback.
"""

from __future__ import annotations

import datetime
import gc
import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from learner.fsdp import ShardLayout, row_range, shard_model
from syncer.wire import fragments as F
from workload import gpt

CPU = torch.device("cpu")
Results = dict[str, str]


def record(results: Results, name: str, ok: bool, detail: str = "") -> None:
    """Keep the first failure of a check (a check may be recorded once per fragment)."""
    if not results.get(name):
        results[name] = "" if ok else (detail or "failed")


def build_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt.build("gpt-tiny", block_size=32)


class Tiny(torch.nn.Module):
    """A (1, 8) row in the root and a Linear(4, 3) in a block. On 2 ranks the row is all rank 0's
    (rank 1's shard is empty) and the Linear's 3 rows split 2 + 1 (rank 1's shard is padded)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 3)])
        self.one = torch.nn.Parameter(torch.randn(1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.blocks[0](x).sum() + (self.one * x.sum()).sum()
        return out


def build_tiny() -> torch.nn.Module:
    torch.manual_seed(1)
    return Tiny()


def setup(factory: Callable[[], torch.nn.Module], count: int) -> tuple[torch.nn.Module, torch.nn.Module, ShardLayout]:
    """(reference, sharded model, its layout) for a plan of `count` fragments."""
    ref, model = factory(), factory()
    shard_model(model, CPU)
    manifest = [F.TensorSpec(n, tuple(p.shape)) for n, p in ref.named_parameters()]
    return ref, model, ShardLayout(F.plan(manifest, count), dict(model.named_parameters()))


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in model.named_parameters()}


def gathered(layout: ShardLayout) -> list[torch.Tensor | None]:
    """Every fragment's full vector on rank 0 (None elsewhere), gathered from the local shards."""
    local = layout.local_params()
    return [layout.gather_full(p, layout.local_plan.gather(p, local)) for p in range(layout.full_plan.count)]


def check_exact(results: Results, tag: str, ref: torch.nn.Module, layout: ShardLayout) -> None:
    """gather_full is the reference's full fragment bit for bit; local_part cuts the local one."""
    rank, plan, ref_params, local = dist.get_rank(), layout.full_plan, full_params(ref), layout.local_params()
    for p, full in enumerate(gathered(layout)):
        want = plan.gather(p, ref_params)
        ok = torch.equal(full, want) if rank == 0 and full is not None else full is None and rank != 0
        record(results, f"{tag}/exact", ok, f"fragment {p} on rank {rank}: {full!r:.80}")
        part = layout.local_part(p, want)
        ok = torch.equal(part, layout.local_plan.gather(p, local)) and part.is_contiguous()
        record(results, f"{tag}/local_part", ok, f"fragment {p} on rank {rank}")


def check_scatter(
    results: Results, tag: str, ref: torch.nn.Module, model: torch.nn.Module, layout: ShardLayout
) -> None:
    """Scattering a changed full fragment's local part changes the sharded model as the
    reference changes: gather_full returns it, and the next forward computes with it (after an
    eval forward, which must not leave stale unsharded parameters behind)."""
    x = example(model)
    with torch.no_grad():
        loss(model, x)  # an eval forward first: FSDP2's root would stay unsharded by default
        plan, ref_params, wanted = layout.full_plan, full_params(ref), []
        for p in range(plan.count):
            changed = plan.gather(p, ref_params) * 2 + (p + 1)
            plan.scatter(p, changed, ref_params)
            layout.local_plan.scatter(p, layout.local_part(p, changed), layout.local_params())
            wanted.append(changed)
        for p, full in enumerate(gathered(layout)):
            ok = full is None if dist.get_rank() else full is not None and torch.equal(full, wanted[p])
            record(results, f"{tag}/scatter", ok, f"fragment {p}")
        a, b = loss(model, x), loss(ref, x)
    record(results, f"{tag}/forward", bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5)), f"{a} vs {b}")


def example(model: torch.nn.Module) -> torch.Tensor:
    if isinstance(model, Tiny):
        return torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10
    return (torch.arange(2 * 32) * 7 % 256).reshape(2, 32)


def loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(model, Tiny):
        out: torch.Tensor = model(x)
        return out
    _, value = model(x[:, :-1], x[:, 1:])
    assert isinstance(value, torch.Tensor)
    return value


def check_gpt(results: Results, tag: str, count: int) -> None:
    ref, model, layout = setup(build_gpt, count)
    names = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    same = names == [(n, tuple(p.shape)) for n, p in ref.named_parameters()]
    every = dict(model.named_parameters(remove_duplicate=False))
    tied = every["transformer.wte.weight"] is every["lm_head.weight"]
    record(results, f"{tag}/manifest", same and tied, f"tied {tied}, names {names}")
    # 4 fragments: whole tensors; 15: row ranges, some across the rows where rank 1's shard begins
    pieces = [pc for frag in layout.full_plan.fragments for pc in frag]
    parts = [pc for pc in pieces if pc.stop - pc.start != layout.rows[pc.name]]
    split = bool(parts)
    across = any(pc.start < row_range(layout.rows[pc.name], 1, 2)[0] < pc.stop for pc in parts)
    record(results, f"{tag}/split", split == across == (count > 4), f"split {split}, across {across}")
    check_exact(results, tag, ref, layout)
    check_scatter(results, tag, ref, model, layout)


def check_empty(results: Results) -> None:
    """3 fragments: [one], [weight rows 0..1], [weight row 2, bias]; rank 1 holds nothing of the
    first two, and one padded row of the weight and of the bias."""
    ref, model, layout = setup(build_tiny, 3)
    names = [[pc.name for pc in frag] for frag in layout.full_plan.fragments]
    want_names = [["one"], ["blocks.0.weight"], ["blocks.0.weight", "blocks.0.bias"]]
    sizes = layout.local_plan.sizes()
    want = [8, 8, 2] if dist.get_rank() == 0 else [0, 0, 5]  # the root's own parameters come first
    record(results, "empty/layout", names == want_names and sizes == want, f"{names} {sizes}")
    for p in range(3):
        vec = layout.local_plan.gather(p, layout.local_params())
        record(results, "empty/gather", vec.dtype == torch.float32 and vec.numel() == sizes[p], repr(vec))
    check_exact(results, "empty", ref, layout)
    check_scatter(results, "empty", ref, model, layout)


def check_training(results: Results) -> None:
    """One AdamW step (with clipping) under FSDP, every rank on the same batch, lands where the
    same step on the whole reference lands."""
    ref, model, layout = setup(build_gpt, 4)
    before = gathered(layout)
    x = example(model)
    for m in (model, ref):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        opt.zero_grad(set_to_none=True)
        loss(m, x).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
    after, ref_params = gathered(layout), full_params(ref)
    for p, (old, new) in enumerate(zip(before, after)):
        if dist.get_rank() != 0:
            continue
        assert old is not None and new is not None
        want = layout.full_plan.gather(p, ref_params)
        record(results, "train/changed", not torch.equal(old, new), f"fragment {p} did not change")
        close = torch.allclose(new, want, rtol=1e-4, atol=1e-6)
        record(results, "train/matches", close, f"fragment {p}: max diff {float((new - want).abs().max())}")


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results: Results = {}
    try:
        check_gpt(results, "gpt4", 4)
        check_gpt(results, "gpt15", 15)
        check_empty(results)
        check_training(results)
        dist.barrier()
    finally:
        # the sharded models hold their DeviceMesh, in reference cycles: one still alive when the
        # interpreter exits aborts it now and then ("terminate called without an active
        # exception", about 1 exit in 15 on 2 cores), so free them while the group is up
        gc.collect()
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
