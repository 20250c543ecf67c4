"""Balanced tensor fragmentation: every element in exactly one (fragment, offset), deterministic,
balanced on realistic GPT shapes, big tensors split along dim 0, and a strict JSON manifest.
"""

from __future__ import annotations

import functools
import itertools
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from syncer.wire import fragments as F
from syncer.wire.fragments import TensorSpec
from workload.gpt import param_shapes

FAST = settings(max_examples=100, deadline=None, derandomize=True)
EMBEDDINGS = {"transformer.wte.weight", "transformer.wpe.weight"}

# shape lists: 1..12 tensors of rank 0..3, dims 1..40
_shape = st.lists(st.integers(min_value=1, max_value=40), min_size=0, max_size=3).map(tuple)
_shapes = st.lists(_shape, min_size=1, max_size=12)


def _specs(shapes: list[tuple[int, ...]], kinds: list[str] | None = None) -> list[TensorSpec]:
    kinds = kinds or ["dense"] * len(shapes)
    return [TensorSpec(f"t{i}", s, k) for i, (s, k) in enumerate(zip(shapes, kinds))]


@functools.cache
def _gpt_shapes(name: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(param_shapes(name))


def _gpt_specs(name: str) -> list[TensorSpec]:
    return [TensorSpec(n, s, "embedding" if n in EMBEDDINGS else "dense") for n, s in _gpt_shapes(name)]


def _numbered(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Tensors holding globally unique numbers: element j of the model is the value j."""
    out, start = {}, 0
    for spec in specs:
        out[spec.name] = torch.arange(start, start + spec.numel, dtype=torch.float64).reshape(spec.shape)
        start += spec.numel
    return out


def _assert_exact_cover(specs: list[TensorSpec], plan: F.FragmentPlan) -> None:
    total = sum(s.numel for s in specs)
    tensors = _numbered(specs)
    flats = [plan.gather(p, tensors) for p in range(plan.count)]
    assert [f.numel() for f in flats] == plan.sizes()
    # every element exactly once: the concatenated fragments are a permutation of 0..total-1
    everything = torch.cat(flats).to(torch.int64) if flats else torch.zeros(0, dtype=torch.int64)
    assert everything.numel() == total
    assert torch.equal(torch.sort(everything).values, torch.arange(total))
    # offsets tile each fragment without gaps or overlaps, pieces in model order
    for p in range(plan.count):
        offset = 0
        for piece in plan.fragments[p]:
            assert piece.offset == offset
            offset += piece.numel
        assert offset == plan.numel(p)
        keys = [(pc.index, pc.start) for pc in plan.fragments[p]]
        assert keys == sorted(keys)
    # row ranges of each tensor partition [0, rows)
    for index, spec in enumerate(specs):
        ranges = sorted((pc.start, pc.stop) for frag in plan.fragments for pc in frag if pc.index == index)
        rows = spec.shape[0] if spec.shape else 1
        assert ranges[0][0] == 0 and ranges[-1][1] == rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    # scatter is the inverse of gather: zeros + scatter(all fragments) rebuilds the model
    rebuilt = {spec.name: torch.full(spec.shape, -1.0, dtype=torch.float64) for spec in specs}
    for p in range(plan.count):
        plan.scatter(p, flats[p].to(torch.float64), rebuilt)
    for name, t in tensors.items():
        assert torch.equal(rebuilt[name], t), name


# -- exact cover -----------------------------------------------------------------------------------


@FAST
@given(shapes=_shapes, data=st.data())
def test_property_every_element_in_exactly_one_fragment(shapes: list[tuple[int, ...]], data: st.DataObject) -> None:
    count = data.draw(st.integers(min_value=1, max_value=len(shapes)))
    kinds = data.draw(st.lists(st.sampled_from(F.KINDS), min_size=len(shapes), max_size=len(shapes)))
    specs = _specs(shapes, kinds)
    plan = F.plan(specs, count)
    assert plan.count == count
    _assert_exact_cover(specs, plan)
    assert sum(plan.sizes()) == sum(s.numel for s in specs)
    # the segments carry the kind of their tensor, for the merge rule
    kind_of = {s.name: s.kind for s in specs}
    for p in range(count):
        assert [k for _, _, k in plan.segments(p)] == [kind_of[pc.name] for pc in plan.fragments[p]]
    # deterministic: planning again gives the identical plan
    assert F.plan(specs, count) == plan


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small"])
@pytest.mark.parametrize("count", range(1, 9))
def test_gpt_shapes_exact_cover(name: str, count: int) -> None:
    specs = _gpt_specs(name)
    _assert_exact_cover(specs, F.plan(specs, count))


# -- determinism ---------------------------------------------------------------------------------


def test_gather_scatter_do_not_depend_on_dict_order() -> None:
    specs = _gpt_specs("gpt-tiny")
    plan = F.plan(specs, 4)
    tensors = _numbered(specs)
    reversed_dict = dict(reversed(list(tensors.items())))
    for p in range(4):
        assert torch.equal(plan.gather(p, tensors), plan.gather(p, reversed_dict))


def test_plan_is_a_pure_function_of_the_manifest() -> None:
    specs = _gpt_specs("gpt-small")
    a, b = F.plan(specs, 4), F.plan(list(specs), 4)
    assert a == b
    # a manifest that went through JSON (as it does between learner and syncer) gives the same plan
    again = F.manifest_from_json(json.loads(json.dumps(F.manifest_to_json(specs))))
    assert F.plan(again, 4) == a
    # equal sizes and equal loads are tie-broken by model order and fragment index:
    # t0 -> f0, t1 -> f1, t2 -> f0 (loads equal, lowest index), t3 -> f1
    tie = F.plan(_specs([(4, 4)] * 4), 2)
    assert [pc.name for pc in tie.fragments[0]] == ["t0", "t2"]
    assert [pc.name for pc in tie.fragments[1]] == ["t1", "t3"]


# -- balance -------------------------------------------------------------------------------------


def test_imbalance_of_gpt_shapes_is_bounded(capsys: pytest.CaptureFixture) -> None:
    report = {}
    for name in ("gpt-tiny", "gpt-small"):
        specs = _gpt_specs(name)
        ratios = [F.plan(specs, count).imbalance() for count in range(1, 9)]
        report[name] = ratios
        assert ratios[0] == 1.0
        assert max(ratios) <= 1.5, f"{name}: {ratios}"
    with capsys.disabled():
        for name, ratios in report.items():
            print(f"\nfragment imbalance (max/min) {name}, P=1..8: " + " ".join(f"{r:.3f}" for r in ratios))


def test_imbalance_definition() -> None:
    plan = F.plan(_specs([(10,), (6,), (4,)]), 2)
    assert sorted(plan.sizes()) == [10, 10]
    assert plan.imbalance() == 1.0
    plan = F.plan(_specs([(1, 9), (3,)]), 2)  # a single row cannot be split
    assert sorted(plan.sizes()) == [3, 9] and plan.imbalance() == 3.0


def test_greedy_largest_first_into_lightest() -> None:
    # sizes 5, 4, 3, 3, 3 into 2 fragments: 5->f0, 4->f1, 3->f1 (7), 3->f0 (8), 3->f1 (10)
    plan = F.plan(_specs([(5,), (4,), (3,), (3,), (3,)]), 2)
    assert sorted(pc.name for pc in plan.fragments[0]) == ["t0", "t3"]
    assert sorted(pc.name for pc in plan.fragments[1]) == ["t1", "t2", "t4"]
    assert plan.sizes() == [8, 10]


# -- splitting along dim 0 ----------------------------------------------------------------------


def test_tensor_bigger_than_ideal_fragment_is_split_along_dim0() -> None:
    specs = _specs([(100, 10), (5, 2), (3,), (2,)])  # 1000 + 10 + 3 + 2 = 1015 values, ideal 253.75
    plan = F.plan(specs, 4)
    big = sorted((pc.start, pc.stop) for frag in plan.fragments for pc in frag if pc.name == "t0")
    assert len(big) == math.ceil(1000 / (1015 / 4))  # 4 row ranges of 25 rows each
    assert big == [(0, 25), (25, 50), (50, 75), (75, 100)]
    assert all(pc.row == 10 for frag in plan.fragments for pc in frag if pc.name == "t0")
    assert plan.imbalance() < 1.1
    _assert_exact_cover(specs, plan)


def test_small_tensors_stay_whole() -> None:
    plan = F.plan(_gpt_specs("gpt-small"), 4)
    ideal = sum(plan.sizes()) / 4
    for frag in plan.fragments:
        for pc in frag:
            shape = dict(_gpt_shapes("gpt-small"))[pc.name]
            if math.prod(shape) <= ideal:
                assert (pc.start, pc.stop) == (0, shape[0])


def test_scalar_and_vector_tensors() -> None:
    # 14 values, ideal 14/3: (7,) splits into rows [0,4) [4,7) and (3, 2) into rows [0,2) [2,3)
    # (round half to even); pieces 4, 4, 3, 2, 1 packed greedily give loads 5, 4, 5
    specs = _specs([(), (7,), (3, 2)])
    plan = F.plan(specs, 3)
    _assert_exact_cover(specs, plan)
    assert plan.sizes() == [5, 4, 5]
    assert [(pc.name, pc.start, pc.stop) for pc in plan.fragments[0]] == [("t0", 0, 1), ("t1", 0, 4)]


def test_gather_gives_fp32_and_scatter_writes_in_place() -> None:
    specs = _specs([(4, 3), (5,)])
    plan = F.plan(specs, 2)
    tensors = {s.name: torch.randn(s.shape, dtype=torch.float32) for s in specs}
    ids = {k: id(v) for k, v in tensors.items()}
    for p in range(2):
        flat = plan.gather(p, tensors)
        assert flat.dtype == torch.float32
        plan.scatter(p, flat * 0 + 3.0, tensors)
    assert all(id(v) == ids[k] for k, v in tensors.items())
    assert all(bool((v == 3.0).all()) for v in tensors.values())


# -- errors --------------------------------------------------------------------------------------


def test_errors() -> None:
    specs = _specs([(4,), (4,)])
    with pytest.raises(ValueError, match="cannot cut 2"):
        F.plan(specs, 3)
    with pytest.raises(ValueError, match=">= 1"):
        F.plan(specs, 0)
    with pytest.raises(ValueError, match=">= 1"):
        F.plan(specs, -1)
    with pytest.raises(ValueError, match="unique"):
        F.plan([TensorSpec("a", (2,)), TensorSpec("a", (3,))], 1)
    with pytest.raises(ValueError, match="kind"):
        F.plan([TensorSpec("a", (2,), "sparse")], 1)


# -- manifest JSON -------------------------------------------------------------------------------


def test_manifest_json_round_trip() -> None:
    specs = [*_gpt_specs("gpt-tiny"), TensorSpec("scalar", ())]
    data = F.manifest_to_json(specs)
    assert data[0] == ["transformer.wte.weight", [256, 64], "embedding"]
    assert F.manifest_from_json(json.loads(json.dumps(data))) == specs


@pytest.mark.parametrize(
    "data",
    [
        None,
        {},
        [],
        "x",
        [["a", [2], "dense", 1]],
        [["a", [2]]],
        [[1, [2], "dense"]],
        [("a", [2], "dense")],
        [["a", (2,), "dense"]],
        [["a", [2.0], "dense"]],
        [["a", [-1], "dense"]],
        [["a", [1 << 40], "dense"]],
        [["a", "2", "dense"]],
        [["a", [2], "conv"]],
        [["a", [2], None]],
        ["a"],
    ],
)
def test_manifest_rejects_malformed(data: object) -> None:
    with pytest.raises(ValueError):
        F.manifest_from_json(data)


@FAST
@given(
    data=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=4),
        max_leaves=12,
    )
)
def test_property_manifest_from_json_only_raises_value_error(data: object) -> None:
    try:
        specs = F.manifest_from_json(data)
    except ValueError:
        return
    assert all(isinstance(s, TensorSpec) and s.kind in F.KINDS for s in specs)
