"""Which syncer shard owns which fragment: a pure, deterministic function of the fragment sizes
and the number of shards, computed alike by every learner and every shard.

A sharded syncer is S processes; shard s owns a balanced subset of the run's P fragments (largest
fragment first into the lightest shard, ties to the lower index) and is, to its learners, a whole
syncer of those fragments: it numbers them 0..k-1 in the order of their global index (its
"local" fragments), so rounds, versions, state transfer and checkpoints work per shard unchanged.
Its welcome names the global fragments it owns; a learner that computed another map is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from syncer.wire.fragments import FragmentPlan, TensorSpec, manifest_from_json, plan


@dataclass(frozen=True)
class ShardMap:
    """Owner shard of every global fragment, and each shard's fragments in local order."""

    owner: tuple[int, ...]  # owner[p]: the shard of global fragment p
    shards: int

    def owned(self, shard: int) -> tuple[int, ...]:
        """Global indices of shard `shard`'s fragments, in local order (ascending)."""
        return tuple(p for p, s in enumerate(self.owner) if s == shard)

    def local(self, p: int) -> tuple[int, int]:
        """(shard, local index) of global fragment p."""
        s = self.owner[p]
        return s, self.owned(s).index(p)

    def loads(self, sizes: Sequence[int]) -> list[int]:
        """Values per shard."""
        out = [0] * self.shards
        for p, s in enumerate(self.owner):
            out[s] += sizes[p]
        return out


def assign(sizes: Sequence[int], shards: int) -> ShardMap:
    """Balanced owners of fragments of `sizes` over `shards` shards (deterministic); ValueError
    when there are fewer fragments than shards (a shard with nothing to own)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if shards > len(sizes):
        raise ValueError(f"cannot spread {len(sizes)} fragments over {shards} shards: set fragments >= shards")
    loads = [0] * shards
    owner = [0] * len(sizes)
    for p in sorted(range(len(sizes)), key=lambda q: (-sizes[q], q)):
        s = min(range(shards), key=lambda i: (loads[i], i))
        owner[p] = s
        loads[s] += sizes[p]
    return ShardMap(tuple(owner), shards)


def sub_plan(plan: FragmentPlan, owned: Sequence[int]) -> FragmentPlan:
    """The plan of one shard: the global plan's fragments `owned`, renumbered 0..k-1."""
    return FragmentPlan(tuple(plan.fragments[p] for p in owned))


def shard_plan(specs: Sequence[TensorSpec], count: int, shard: int = 0, shards: int = 1) -> FragmentPlan:
    """The fragment plan of shard `shard` of `shards` (the run's plan when unsharded): the layout
    of that shard's checkpoint vectors."""
    full = plan(specs, count)
    return full if shards == 1 else sub_plan(full, assign(full.sizes(), shards).owned(shard))


def checkpoint_label(shard: int, state: Mapping[str, Any]) -> str:
    """How a sharded model names the checkpoint one shard's part came from: "shard 1: ckpt-0002-000000780"
    (its epoch and outer steps; the file name less its time)."""
    return f"shard {shard}: ckpt-{int(state['epoch']):04d}-{int(state['outer_steps']):09d}"


def assemble(
    states: Iterable[Mapping[str, Any]], count: int, into: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The whole model of `count` shards' checkpoint states (shard s's the s-th): each shard's
    vectors scattered into the parameters by its plan (into `into`'s tensors, else new ones), and
    the version of every global fragment. States may come one at a time (a generator that loads
    each): none is kept past its turn. ValueError when a state is not shard s of `count` of the
    first one's run and model."""
    tensors, versions, first, owner, full = into, [0], ("", None), ShardMap((), count), FragmentPlan(())
    for s, state in enumerate(states):
        if s == 0:
            first = (state["run_id"], state["manifest"])
            manifest = manifest_from_json(first[1])
            full = plan(manifest, int(state["fragments"]))
            owner, versions = assign(full.sizes(), count), [0] * full.count
            if tensors is None:
                tensors = {spec.name: torch.zeros(spec.shape, dtype=torch.float32) for spec in manifest}
        if (state["run_id"], state["manifest"]) != first or tuple(state.get("shard", (0, 1))) != (s, count):
            raise ValueError(f"not the checkpoint of shard {s} of {count} of run {first[0]}'s model")
        owned, layout = owner.owned(s), sub_plan(full, owner.owned(s))
        assert tensors is not None  # made with the first state
        for q, p in enumerate(owned):
            layout.scatter(q, state["theta"][q], tensors)
            versions[p] = int(state["versions"][q])
    if tensors is None:
        raise ValueError("no checkpoint state to assemble")
    return tensors, versions
