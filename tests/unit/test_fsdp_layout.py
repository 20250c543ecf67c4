"""The pure part of the FSDP2 layout (learner/fsdp.py), without processes: row ranges follow
torch.chunk, the local plans of all ranks cover every element of every fragment exactly once, a
rank's local vector is the bits of the full one at its spans, an empty local fragment gathers to
an empty fp32 vector, and shard_model's units keep tied weights in one unit.
(The collectives on real gloo ranks: tests/integration/test_fsdp_layout.py.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.fsdp import LocalPlan, ShardLayout, Span, blocks, localize, row_range, tensor_rows
from syncer.wire import fragments as F
from syncer.wire.fragments import TensorSpec
from workload import gpt

FAST = settings(max_examples=60, deadline=None, derandomize=True)
_shape = st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=3).map(tuple)


def chunk_ranges(rows: int, world: int) -> list[tuple[int, int]]:
    """What torch.chunk (FSDP2's sharding of dim 0) gives each rank, empty chunks appended."""
    out, start = [], 0
    for piece in torch.arange(rows).chunk(world) if rows else ():
        out.append((start, start + len(piece)))
        start += len(piece)
    return out + [(rows, rows)] * (world - len(out))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_row_ranges_are_torch_chunks(world: int) -> None:
    for rows in range(40):
        assert [row_range(rows, r, world) for r in range(world)] == chunk_ranges(rows, world), rows


def test_row_range_edges() -> None:
    assert row_range(1, 0, 2) == (0, 1) and row_range(1, 1, 2) == (1, 1)  # a 1-row tensor: rank 1 empty
    assert [row_range(5, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    with pytest.raises(ValueError, match="outside"):
        row_range(4, 2, 2)


def shards(full: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """What FSDP2 leaves rank `rank` of each tensor: its rows (a scalar counts as one row)."""
    out = {}
    for name, t in full.items():
        r0, r1 = row_range(t.shape[0] if t.dim() else 1, rank, world)
        out[name] = t[r0:r1] if t.dim() else t
    return out


def check_layout(specs: list[TensorSpec], count: int, world: int) -> None:
    """Every rank's local vector is the full vector at its spans; the spans tile the full vector."""
    plan = F.plan(specs, count)
    full = {s.name: torch.randn(s.shape, dtype=torch.float64) for s in specs}  # fp64: gather casts
    assert tensor_rows(plan) == {s.name: s.shape[0] if s.shape else 1 for s in specs}
    for p in range(plan.count):
        whole = plan.gather(p, full)
        covered = torch.zeros(whole.numel(), dtype=torch.int64)
        for rank in range(world):
            local_plan, spans = localize(plan, rank, world)
            local = local_plan.gather(p, shards(full, rank, world))
            assert local.dtype == torch.float32 and local.numel() == local_plan.numel(p)
            cut = [whole[s.full : s.full + s.numel] for s in spans[p]]
            assert torch.equal(local, torch.cat(cut) if cut else whole[:0])
            for s in spans[p]:
                covered[s.full : s.full + s.numel] += 1
        assert bool((covered == 1).all()), (p, covered)


@FAST
@given(shapes=st.lists(_shape, min_size=1, max_size=8), data=st.data())
def test_local_plans_tile_every_fragment(shapes: list[tuple[int, ...]], data: st.DataObject) -> None:
    specs = [TensorSpec(f"t{i}", s) for i, s in enumerate(shapes)]
    count = data.draw(st.integers(min_value=1, max_value=len(specs)))
    check_layout(specs, count, data.draw(st.integers(min_value=1, max_value=5)))


@pytest.mark.parametrize("count", [1, 4, 8, 13])
@pytest.mark.parametrize("world", [2, 3])
def test_gpt_tiny_layout(count: int, world: int) -> None:
    specs = [TensorSpec(n, s) for n, s in gpt.param_shapes("gpt-tiny", block_size=32)]
    check_layout(specs, count, world)


def test_a_local_plan_is_rebased_and_reoffset() -> None:
    # t0: 6 rows of 2 split into [0, 3) (with t1) and [3, 6); world 4: chunk 2, rank 1 holds rows
    # [2, 4) of t0 and none of t1's single row
    plan = F.plan([TensorSpec("t0", (6, 2)), TensorSpec("t1", (1, 3))], 2)
    local_plan, spans = localize(plan, 1, 4)
    pieces = [piece for frag in local_plan.fragments for piece in frag]
    assert [(pc.name, pc.start, pc.stop, pc.offset) for pc in pieces] == [("t0", 0, 1, 0), ("t0", 1, 2, 0)]
    full_pieces = {(pc.start, pc.stop): pc for frag in plan.fragments for pc in frag if pc.name == "t0"}
    assert full_pieces[(0, 3)].offset == 0 and full_pieces[(3, 6)].offset == 0
    # row 2 is the last row of piece [0, 3): full offset 2 * 2; row 3 the first of [3, 6)
    assert spans == ((Span(0, 4, 2),), (Span(0, 0, 2),))


def test_an_empty_local_fragment_gathers_to_an_empty_fp32_vector() -> None:
    # a (1, 8) tensor alone in its fragment: rank 1 of 2 holds none of its rows
    plan = F.plan([TensorSpec("w", (2, 4)), TensorSpec("one", (1, 8))], 2)
    assert [[pc.name for pc in frag] for frag in plan.fragments] == [["w"], ["one"]]
    local_plan, spans = localize(plan, 1, 2)
    assert isinstance(local_plan, LocalPlan) and local_plan.fragments[1] == () and spans[1] == ()
    assert local_plan.numel(1) == 0 and local_plan.sizes() == [4, 0]
    tensors = {"w": torch.ones(1, 4, dtype=torch.float16), "one": torch.ones(0, 8)}
    empty = local_plan.gather(1, tensors)
    assert empty.shape == (0,) and empty.dtype == torch.float32
    local_plan.scatter(1, empty, tensors)  # nothing to write, nothing raised
    assert torch.equal(local_plan.gather(0, tensors), torch.ones(4))


def test_units_are_the_blocks_innermost_first_and_the_tied_head_stays_in_the_root() -> None:
    model = gpt.build("gpt-tiny", block_size=16)
    h = model.transformer["h"]
    assert isinstance(h, torch.nn.ModuleList)
    assert blocks(model) == [h[1], h[0]]  # wte = lm_head is no ModuleList entry: the root's


class Tied(torch.nn.Module):
    """A ModuleList entry sharing its weight with the root's head, beside an untied entry, and a
    nested list (its entries come before the outer entry that holds them)."""

    def __init__(self) -> None:
        super().__init__()
        first = torch.nn.Linear(3, 3)
        self.layers = torch.nn.ModuleList([first, torch.nn.Linear(3, 3)])
        self.head = torch.nn.Linear(3, 3)
        self.head.weight = first.weight
        inner = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)]), torch.nn.Linear(2, 2))
        self.outer = torch.nn.ModuleList([inner, torch.nn.ReLU(), torch.nn.ModuleList([torch.nn.Linear(1, 1)])])


def test_tied_entries_are_left_to_the_root_and_nested_entries_come_first() -> None:
    m = Tied()
    inner = m.outer[0]
    assert isinstance(inner, torch.nn.Sequential) and isinstance(inner[0], torch.nn.ModuleList)
    nested = m.outer[2]
    assert isinstance(nested, torch.nn.ModuleList)
    found = blocks(m)
    assert m.layers[0] not in found and m.layers[1] in found  # tied to head / untied
    assert m.outer[1] not in found and nested not in found  # no parameters / a container
    assert found.index(inner[0][0]) < found.index(inner) and nested[0] in found


def test_a_layout_of_an_unsharded_model_is_refused_before_any_collective() -> None:
    model = gpt.build("gpt-tiny", block_size=16)
    manifest = [TensorSpec(n, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = F.plan(manifest, 4)
    with pytest.raises(ValueError, match=r"transformer\.wte\.weight is not sharded \(not a DTensor\)"):
        ShardLayout(plan, dict(model.named_parameters()))
    with pytest.raises(ValueError, match=r"transformer\.wte\.weight of the fragment plan is not among"):
        ShardLayout(plan, {"transformer.wpe.weight": dict(model.named_parameters())["transformer.wpe.weight"]})
