"""FSDP2 islands: the model sharded across the island's ranks, and fragments mapped onto the shards.

An island too big for one device shards its model with FSDP2 (`fully_shard`): every parameter
becomes a DTensor placed `Shard(0)` on a 1-D mesh over the island's ranks. The syncer, the
other learners and the wire still speak the full layout: `syncer/wire/fragments.py` cuts the
*full* shapes of the manifest into P fragments, each a flat fp32 vector of pieces (whole tensors
or row ranges [start, stop) along dim 0). This module is the map between the two.

Layout math (torch.chunk semantics, as FSDP2 shards dim 0):

    chunk       = ceil(rows / world)                         rows = shape[0] (a tensor's dim 0)
    rank r owns   [r0, r1) = [min(r * chunk, rows), min((r + 1) * chunk, rows))

so the last ranks may own fewer rows, or none (a (1, n) tensor on 2 ranks: rank 1 owns [1, 1)).
A piece [s, e) of fragment p intersects rank r's rows in [a, b) = [max(s, r0), min(e, r1)); when
a < b that is a local piece [a - r0, b - r0) of rank r's shard. Rows are contiguous in a row-major
tensor, so the intersection is one contiguous run (a `Span`) of both flat vectors:

    full vector   offset piece.offset + (a - s) * row        row = elements per index of dim 0
    local vector  offset sum of the local pieces before it   numel (b - a) * row

The local pieces of every fragment, in model order with their local offsets, form the rank's
`local_plan` (a FragmentPlan over the local shards; a fragment may have no local piece at all).
`ShardLayout.gather_full` all-gathers the ranks' local vectors (padded to the longest, the one
collective gloo and NCCL both have) and lays every rank's spans into the full vector;
`local_part` cuts this rank's spans out of a full vector. Both are pure copies: bit-exact.

Scalar (0-dim) parameters cannot be sharded by FSDP2 (it refuses them); the math treats them as
one row. Tied parameters (GPT's wte = lm_head) must live in one FSDP unit: `shard_model` wraps
only ModuleList entries whose parameters no module outside the entry shares.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

try:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
except ImportError as exc:  # FSDP2 is public from torch 2.6
    raise RuntimeError(
        f"island = 'fsdp' needs torch >= 2.6 (FSDP2's fully_shard); this host has torch {torch.__version__}"
        " (install a newer torch there, or set island = 'ddp')"
    ) from exc

from syncer.wire.fragments import FragmentPlan, Piece


# -- the pure part: row ranges and the local plan ---------------------------------------------------
def row_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [r0, r1) of a `rows`-row tensor that rank `rank` of `world` holds (torch.chunk)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    chunk = -(-rows // world)  # ceil
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def tensor_rows(plan: FragmentPlan) -> dict[str, int]:
    """Rows (dim 0) of every tensor of a plan: its pieces cover [0, rows), in model order."""
    found: dict[str, tuple[int, int]] = {}  # name -> (index, rows)
    for pieces in plan.fragments:
        for piece in pieces:
            _, stop = found.get(piece.name, (piece.index, 0))
            found[piece.name] = (piece.index, max(stop, piece.stop))
    return {name: rows for name, (_, rows) in sorted(found.items(), key=lambda item: item[1][0])}


@dataclass(frozen=True)
class Span:
    """A contiguous run of one fragment's elements that a rank holds: where it lies in the rank's
    local vector and in the full (manifest-layout) vector."""

    local: int
    full: int
    numel: int


class LocalPlan(FragmentPlan):
    """A FragmentPlan over one rank's shards: a fragment may have no local piece on this rank."""

    def gather(self, p: int, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Fragment p's local vector; an empty fp32 vector (on the tensors' device) if none is here."""
        if self.fragments[p]:
            return super().gather(p, tensors)
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        return torch.zeros(0, dtype=torch.float32, device=device)


def localize(plan: FragmentPlan, rank: int, world: int) -> tuple[LocalPlan, tuple[tuple[Span, ...], ...]]:
    """Rank `rank`'s local plan and, per fragment, its spans in the full vector (model order)."""
    rows = tensor_rows(plan)
    fragments: list[tuple[Piece, ...]] = []
    spans: list[tuple[Span, ...]] = []
    for pieces in plan.fragments:
        local: list[Piece] = []
        runs: list[Span] = []
        offset = 0
        for piece in pieces:
            r0, r1 = row_range(rows[piece.name], rank, world)
            a, b = max(piece.start, r0), min(piece.stop, r1)
            if a >= b:
                continue  # none of this piece's rows are on this rank
            cut = Piece(piece.name, piece.index, a - r0, b - r0, piece.row, piece.kind, offset)
            runs.append(Span(offset, piece.offset + (a - piece.start) * piece.row, cut.numel))
            local.append(cut)
            offset += cut.numel
        fragments.append(tuple(local))
        spans.append(tuple(runs))
    return LocalPlan(tuple(fragments)), tuple(spans)


# -- sharding a model ---------------------------------------------------------------------------------
def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules `shard_model` makes FSDP units of, innermost first: every entry of any
    ModuleList that has parameters, is no container itself, and shares none of its parameters
    with a module outside it (a tied weight must stay in one unit: the root's)."""
    owners: dict[int, list[int]] = {}  # id(parameter) -> ids of the modules that hold it directly
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(id(module))
    found: list[torch.nn.Module] = []
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList):
            continue
        for entry in module:
            if isinstance(entry, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                continue
            inside = {id(m) for m in entry.modules()}
            params = list(entry.parameters())
            if params and all(set(owners[id(p)]) <= inside for p in params):
                found.append(entry)
    return found[::-1]  # modules() is pre-order: reversed, an inner entry comes before its outer


def shard_model(model: torch.nn.Module, device: torch.device) -> None:
    """FSDP2 over the whole default process group (gloo on CPU, NCCL on CUDA): one unit per
    ModuleList entry (transformer blocks), then the root for the rest. Every parameter becomes a
    DTensor sharded Shard(0) on `device`. The root reshards after forward too (FSDP2 keeps the
    root unsharded by default), so after any forward, with or without backward, the shards are
    the only copy and writes into them are seen by the next forward."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


# -- a rank's shards and the full fragments -----------------------------------------------------------
class ShardLayout:
    """This rank's shards of a sharded model, in terms of the full FragmentPlan.

    `plan` is the full plan (from the manifest's full shapes, as every learner and the syncer
    compute it); `params` the sharded model's named parameters (DTensors, Shard(0), one 1-D mesh).
    Collectives run on the mesh's process group; `dst` ranks are ranks of that group (the global
    ranks, for shard_model's mesh over the whole default group)."""

    def __init__(self, plan: FragmentPlan, params: Mapping[str, torch.Tensor]) -> None:
        self.full_plan = plan
        self.rows = tensor_rows(plan)
        self._params = _sharded(self.rows, params)
        mesh = _one_mesh(self._params)
        self.group = mesh.get_group()
        self.rank, self.world = mesh.get_local_rank(), mesh.size()
        self.ranges = {name: row_range(rows, self.rank, self.world) for name, rows in self.rows.items()}
        _check_shards(plan, self._params, self.rows, self.ranges)
        self.device = next(iter(self._params.values())).to_local().device
        self.local_plan, _ = localize(plan, self.rank, self.world)
        self._spans = [localize(plan, r, self.world)[1] for r in range(self.world)]  # [rank][fragment]

    def local_params(self) -> dict[str, torch.Tensor]:
        """name -> this rank's shard: a plain tensor aliasing the parameter's storage (write into
        it in place, under no_grad, to change the parameter). Take it afresh after anything that
        replaces parameters (load_state_dict(assign=True), module.to(...))."""
        with torch.no_grad():
            return {name: param.to_local().detach() for name, param in self._params.items()}

    def full_numel(self, p: int) -> int:
        return self.full_plan.numel(p)

    def local_numel(self, p: int) -> int:
        return self.local_plan.numel(p)

    def gather_full(self, p: int, local_vec: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        """Fragment p's full flat fp32 vector (manifest layout) on rank `dst`, None elsewhere.
        A collective: every rank calls it, for the same fragments in the same order."""
        if local_vec.numel() != self.local_numel(p):
            raise ValueError(f"fragment {p}: {local_vec.numel()} local elements, this rank holds {self.local_numel(p)}")
        longest = max(sum(s.numel for s in spans[p]) for spans in self._spans)
        if longest == 0:  # a fragment of empty tensors: nothing to send (every rank knows it)
            return torch.zeros(0, dtype=torch.float32, device=self.device) if self.rank == dst else None
        send = torch.zeros(longest, dtype=torch.float32, device=self.device)
        send[: local_vec.numel()].copy_(local_vec.reshape(-1))
        received = [torch.empty_like(send) for _ in range(self.world)]
        dist.all_gather(received, send, group=self.group)
        if self.rank != dst:
            return None
        full = torch.empty(self.full_numel(p), dtype=torch.float32, device=self.device)
        for rank, spans in enumerate(self._spans):
            for s in spans[p]:
                full[s.full : s.full + s.numel] = received[rank][s.local : s.local + s.numel]
        return full

    def local_part(self, p: int, full_vec: torch.Tensor) -> torch.Tensor:
        """This rank's local vector of fragment p, cut out of a full one (a new contiguous tensor
        on full_vec's device; no communication)."""
        if full_vec.numel() != self.full_numel(p):
            raise ValueError(
                f"fragment {p}: a full vector of {full_vec.numel()} elements, expected {self.full_numel(p)}"
            )
        flat = full_vec.reshape(-1)
        parts = [flat[s.full : s.full + s.numel] for s in self._spans[self.rank][p]]
        if not parts:
            return torch.zeros(0, dtype=full_vec.dtype, device=full_vec.device)
        return torch.cat(parts)


def _sharded(rows: Mapping[str, int], params: Mapping[str, torch.Tensor]) -> dict[str, DTensor]:
    """The plan's parameters, each checked to be a DTensor sharded Shard(0) on a 1-D mesh."""
    out: dict[str, DTensor] = {}
    for name in rows:
        param = params.get(name)
        if param is None:
            raise ValueError(f"parameter {name} of the fragment plan is not among the model's parameters")
        if not isinstance(param, DTensor):
            raise ValueError(f"parameter {name} is not sharded (not a DTensor): run shard_model on the model first")
        if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
            raise ValueError(f"parameter {name} is placed {param.placements} on a {param.device_mesh.ndim}-D mesh")
        out[name] = param
    return out


def _one_mesh(params: Mapping[str, DTensor]) -> DeviceMesh:
    meshes = {param.device_mesh for param in params.values()}
    if len(meshes) != 1:
        raise ValueError(f"the parameters are sharded over {len(meshes)} device meshes, expected one")
    return meshes.pop()


def _check_shards(
    plan: FragmentPlan,
    params: Mapping[str, DTensor],
    rows: Mapping[str, int],
    ranges: Mapping[str, tuple[int, int]],
) -> None:
    """Every parameter's full shape fits the plan and its local shard holds the rows `row_range` says."""
    row_of = {piece.name: piece.row for pieces in plan.fragments for piece in pieces}
    for name, param in params.items():
        shape = tuple(param.shape)
        if not shape:
            raise ValueError(f"parameter {name} is a scalar: FSDP2 cannot shard it (make it shape (1,))")
        if shape[0] != rows[name] or math.prod(shape[1:]) != row_of[name]:
            raise ValueError(
                f"parameter {name} has shape {shape}, the plan expects {rows[name]} rows of {row_of[name]}"
            )
        r0, r1 = ranges[name]
        local = tuple(param.to_local().shape)
        if local != (r1 - r0, *shape[1:]):
            raise ValueError(
                f"parameter {name} of shape {shape}: this rank holds a shard of shape {local}, "
                f"the plan expects rows [{r0}, {r1}) of {row_of[name]} elements each"
            )
