"""A learner that is itself a data-parallel job: an island of ranks under torchrun.

Every rank trains the same model on its own batches, with DDP (`island = "ddp"`: every rank
holds the whole model) or FSDP2 (`island = "fsdp"`: every rank holds a shard, learner/fsdp.py);
gloo on CPU, NCCL on GPU. Only rank 0 talks to the syncer. After every inner step rank 0
broadcasts one small header ([stop, n, fragment, version, ...]) and then the values of the global
fragments it applies, so every rank applies exactly the same fragments at exactly the same step
and the ranks never drift apart. Under FSDP a rank keeps only its part of each full fragment it
receives (one fragment at a time), its marks are its shards' marks, and a pushed fragment's outer
gradient is gathered from every rank's part onto rank 0 (`ShardLayout.gather_full`): no rank ever
holds more than a fragment of the full model beyond its shard. If a rank dies, torchrun stops the
island and the supervisor restarts it whole.
"""

from __future__ import annotations

import datetime
import gc
import os
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from learner.outer import OuterState

Applies = list[tuple[int, int, torch.Tensor]]  # (fragment, version, value on the device)


class Island:
    """This rank's place in its island, and the collectives the trainer needs."""

    def __init__(self, rank: int, world: int, local_rank: int, device: torch.device, fsdp: bool = False) -> None:
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.device = device
        self.fsdp = fsdp  # island = "fsdp": the model is sharded across the ranks
        self.stopped = False  # every rank has seen rank 0's stop (see close)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device_name: str, mode: str = "ddp") -> Island:
        """Join the process group torchrun set up (env:// rendezvous); `mode` is the host's island."""
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        cuda = device_name.startswith("cuda")
        backend = "nccl" if cuda else "gloo"
        device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        # a dead peer must fail the collective, not hang it for gloo's default 30 minutes
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
        return cls(rank, world, local_rank, device, fsdp=mode == "fsdp")

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DDP around the model (gradients averaged across the island in backward()), or the
        model sharded in place by FSDP2 (gradients reduce-scattered)."""
        if self.fsdp:
            from learner import fsdp

            fsdp.shard_model(model, self.device)
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.local_rank] if self.device.type == "cuda" else None
        return DDP(model, device_ids=ids)

    def share_start(self, values: list[torch.Tensor], step: int = 0) -> int:
        """Rank 0's fetched global state (tensors are filled in place) and resume step, on every rank."""
        for t in values:
            dist.broadcast(t, src=0)
        counter = torch.tensor([step], dtype=torch.int64, device=self.device)
        dist.broadcast(counter, src=0)
        return int(counter)

    def share_fragments(
        self, full: Callable[[int], torch.Tensor] | None, sizes: list[int], part: Any
    ) -> list[torch.Tensor]:
        """FSDP's start: rank 0's full global fragments (`full(p)`, any device), one at a time,
        each rank keeping only its part (`part(p, value)`)."""
        out = []
        for p, n in enumerate(sizes):
            value = full(p).to(self.device) if full is not None else torch.empty(n, device=self.device)
            dist.broadcast(value, src=0)
            out.append(part(p, value))
        return out

    def share_step(self, step: int) -> int:
        counter = torch.tensor([step], dtype=torch.int64, device=self.device)
        dist.broadcast(counter, src=0)
        return int(counter)

    def share(
        self, stop: bool, applies: Applies, sizes: list[int], pushes: list[int] | None = None
    ) -> tuple[bool, Applies, list[int]]:
        """Rank 0's decision for this step (stop? which fragments to apply, which to push), on
        every rank; `sizes` are the full fragments' sizes. A pushed fragment's mark moves on every
        rank, so that a rebase (local := global + local - mark) lands the same on all of them."""
        count = len(sizes)
        header = torch.zeros(2 + 3 * count, dtype=torch.int64, device=self.device)
        if self.leader:
            header[0], header[1] = int(stop), len(applies)
            for i, (p, version, _) in enumerate(applies):
                header[2 + 2 * i], header[3 + 2 * i] = p, version
            for p in pushes or []:
                header[2 + 2 * count + p] = 1
        dist.broadcast(header, src=0)
        stop, n = bool(header[0]), int(header[1])
        pushed = [p for p in range(count) if int(header[2 + 2 * count + p])]
        self.stopped = stop
        out: Applies = []
        for i in range(n):
            p, version = int(header[2 + 2 * i]), int(header[3 + 2 * i])
            value = applies[i][2] if self.leader else torch.empty(sizes[p], device=self.device)
            dist.broadcast(value, src=0)
            out.append((p, version, value))
        return stop, out, pushed

    def follow(self, trainer: Any) -> int:
        """The loop of a rank other than 0: train, then do what rank 0 says."""
        trainer.build()
        sizes = trainer.plan.sizes()
        if self.fsdp:
            values = self.share_fragments(None, sizes, trainer.to_local)
            trainer.resume(self.share_step(0))
        else:
            values = [torch.empty(n, device=self.device) for n in sizes]
            trainer.resume(self.share_start(values))
        s = trainer.s
        outer = OuterState.start(
            trainer.outer_plan, s.H, s.alpha, [(0, v) for v in values], trainer.params, rebase=s.rebase
        )
        opt = trainer.optimizer()
        while True:
            trainer._train_step(opt, outer)
            stop, applies, pushed = self.share(False, [], sizes)
            for p, version, value in applies:
                outer.apply(p, version, trainer.to_local(p, value), trainer.params)
            for p in pushed:  # rank 0 sent it: the work up to here is no longer local-only
                trainer.outer_full(p, outer.take_outer_gradient(p, trainer.params)[0])  # FSDP: our part of it
            if trainer.step % s.eval_every == 0:
                trainer.evaluate() if self.fsdp else self.identical(trainer.params)  # FSDP: a collective forward
            if stop:
                if self.fsdp:  # rank 0's last pushes gather every rank's part (Trainer._finish)
                    for p in range(outer.plan.count):
                        if outer.counters[p].steps:
                            trainer.outer_full(p, outer.take_outer_gradient(p, trainer.params)[0])
                return 0

    def identical(self, params: dict[str, torch.Tensor]) -> bool:
        """Whether every rank holds bit-identical parameters (crc32s compared across ranks)."""
        crc = 0
        for t in params.values():
            crc = zlib.crc32(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().data, crc)
        mine = torch.tensor([crc], dtype=torch.int64, device=self.device)
        everyone = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine)
        return len({int(t) for t in everyone}) == 1

    def close(self) -> None:
        """Leave the process group. Once every rank has seen rank 0's stop, they first wait for each
        other: rank 1 tearing gloo down while rank 0 still sent its last fragments aborted rank 1
        ("terminate called without an active exception") and torchrun failed the island. Without
        that stop (an error, a failed join) there is no barrier: a rank may be inside a collective.
        The trainer drops its model first (Trainer.release)."""
        if not dist.is_initialized():
            return
        if self.stopped:
            dist.barrier()
        gc.collect()  # FSDP modules sit in reference cycles: a mesh alive at exit aborted ~6% of exits
        dist.destroy_process_group()
