"""The link model against numbers worked by hand.

Reference case: 1B parameters, 1 s steps, 4 sites, bf16 data-parallel gradients, DiLoCo int4 with
H = 64, 4 fragments, tau = 2, target 95% busy.
- data-parallel: ring 2*3/4 = 1.5 gradients of 2 GB = 3 GB = 24 Gbit per step per site; 2/3 s of it
  hides behind the backward pass; 95% busy allows 1/0.95 - 1 = 1/19 s of stall per step, so the
  link must carry 24 Gbit in 2/3 + 1/19 s = 33.366 Gbit/s.
- DiLoCo: a fragment is 250M values * (4 + 32/128) bits = 1.0625 Gbit, every 16 steps; the reply
  may lag 2 steps; 16/19 s of stall is allowed per fragment: 1.0625 / (2 + 16/19) = 0.37384 Gbit/s.
"""

from __future__ import annotations

import math

import pytest
import torch

from dldctl.sim.bandwidth import (
    DATA_PARALLEL,
    DILOCO,
    LinkParams,
    Transfer,
    data_parallel_transfer,
    diloco_transfer,
    effective_bits,
    link_report,
)
from dldctl.sim.errors import ParamError
from dldctl.units import format_count, parse_quantity

pytestmark = pytest.mark.timeout(30)

REF = LinkParams(params=1e9, step_time_s=1.0)


def test_data_parallel_reference_case() -> None:
    t = data_parallel_transfer(REF)
    assert t.strategy == DATA_PARALLEL
    assert t.bits == pytest.approx(24e9)
    assert (t.period_s, t.hidden_s) == (1.0, pytest.approx(2 / 3))
    assert t.average_gbps == pytest.approx(24.0)
    assert t.required_gbps(0.95) == pytest.approx(24 / (2 / 3 + 1 / 19))
    assert t.required_gbps(0.95) == pytest.approx(33.3659, abs=1e-3)


def test_diloco_reference_case() -> None:
    t = diloco_transfer(REF)
    assert t.strategy == DILOCO
    assert t.bits == pytest.approx(250e6 * 4.25)
    assert (t.period_s, t.hidden_s) == (16.0, 2.0)
    assert t.required_gbps(0.95) == pytest.approx(1.0625 / (2 + 16 / 19))
    # ALGORITHM.md: about bytes(params, fp32) * bits/32 / H per step each way, before scales.
    per_step_bits = 4e9 * 8 * 4 / 32 / 64
    assert t.average_gbps * 1e9 == pytest.approx(per_step_bits * 4.25 / 4)


def test_a_codec_by_name_moves_its_own_bits_per_value() -> None:
    """The thin codecs: 2bit with one fp32 scale a block of 128, topk 64 of 4,096 values with an
    int16 index and 2 bits each plus one scale a chunk; what syncer/wire/codec.py writes."""
    from syncer.wire import codec

    per_value = {"int4": 4.25, "2bit": 2.25, "topk": (64 * 18 + 32) / 4096}
    for name, bits in per_value.items():
        t = diloco_transfer(LinkParams(params=1e9, step_time_s=1.0, compression=name))
        assert t.bits == pytest.approx(250e6 * bits)
    n = 1 << 20
    for name, block in (("2bit", 128), ("topk", 4096 | 64 << 16)):
        stored = len(codec.encode(torch.randn(n), name, block, zstd=False)) - codec.HEADER_SIZE
        assert stored * 8 / n == pytest.approx(per_value[name], rel=1e-3)
    with pytest.raises(ParamError, match="compression"):
        LinkParams(params=1e9, step_time_s=1.0, compression="int3")


def test_utilization_on_a_given_link() -> None:
    r = link_report(REF, link_gbps=10.0)
    # 24 Gbit at 10 Gbit/s takes 2.4 s, 2/3 s hidden: 1.7333 s of stall per 1 s step.
    assert r.data_parallel.utilization_at(10.0) == pytest.approx(1 / (1 + 2.4 - 2 / 3))
    # 1.0625 Gbit takes 0.10625 s, well inside the 2 s of overlap.
    assert r.diloco.utilization_at(10.0) == 1.0
    assert r.diloco.utilization_at(0.05) == pytest.approx(16 / (16 + 1.0625 / 0.05 - 2))
    d = r.to_dict()
    assert d["strategies"]["data_parallel"]["utilization_at_link"] == pytest.approx(0.365854, abs=1e-6)


@pytest.mark.parametrize("u", [0.5, 0.8, 0.95, 0.99])
@pytest.mark.parametrize("params", [1e9, 12e9, 100e9])
def test_required_link_gives_exactly_the_target_utilization(u, params) -> None:
    p = LinkParams(params=params, step_time_s=2.0, H=128, fragments=8, utilization=u)
    for t in (data_parallel_transfer(p), diloco_transfer(p)):
        assert t.utilization_at(t.required_gbps(u)) == pytest.approx(u)
        assert t.utilization_at(t.required_gbps(u) * 1.01) > u


def test_reduction_is_large_and_grows_with_h() -> None:
    reductions = [link_report(LinkParams(params=12e9, step_time_s=1.0, H=h)).reduction for h in (16, 64, 256)]
    assert reductions[0] < reductions[1] < reductions[2]
    assert reductions[1] == pytest.approx((24 * 12 / (2 / 3 + 1 / 19)) / (12 * 1.0625 / (2 + 16 / 19)))


def test_overlap_window_is_capped_by_the_next_fragment() -> None:
    # With H/P = 2 steps the reply must be back before the next fragment leaves, tau or not.
    t = diloco_transfer(LinkParams(params=1e9, step_time_s=1.0, H=8, fragments=4, tau=10))
    assert t.hidden_s == 2.0 and t.period_s == 2.0


def test_no_overlap_and_full_utilization_is_unreachable() -> None:
    t = Transfer(DATA_PARALLEL, bits=8e9, period_s=1.0, hidden_s=0.0)
    assert t.required_gbps(1.0) == math.inf
    assert t.utilization_at(8.0) == pytest.approx(0.5)
    assert Transfer(DILOCO, 0.0, 1.0, 0.0).required_gbps(1.0) == 0.0


def test_more_sites_cost_data_parallel_more_per_link() -> None:
    two = data_parallel_transfer(LinkParams(params=1e9, step_time_s=1.0, sites=2))
    many = data_parallel_transfer(LinkParams(params=1e9, step_time_s=1.0, sites=64))
    assert two.bits == pytest.approx(16e9)  # ring factor 1
    assert many.bits == pytest.approx(2 * 63 / 64 * 16e9)
    assert diloco_transfer(LinkParams(params=1e9, step_time_s=1.0, sites=64)).bits == diloco_transfer(REF).bits


def test_effective_bits_and_syncer_ingress() -> None:
    assert effective_bits(4) == 4.25 and effective_bits(8) == 8.25
    assert effective_bits(16) == 16 and effective_bits(32) == 32
    r = link_report(LinkParams(params=12e9, step_time_s=1.0, sites=4))
    assert r.syncer_ingress_gbps == pytest.approx(4 * 12e9 / 4 * 4.25 / 16 / 1e9)


def test_json_has_no_infinity() -> None:
    r = link_report(LinkParams(params=1e9, step_time_s=1.0, utilization=1.0, dp_overlap=0.0, tau=0))
    d = r.to_dict()
    assert d["strategies"]["data_parallel"]["required_gbps"] is None
    assert d["reduction"] is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(params=0), "params"),
        (dict(step_time_s=0), "step_time_s"),
        (dict(bits=3), "bits"),
        (dict(fragments=128, H=64), "fragments"),
        (dict(sites=1), "sites"),
        (dict(utilization=1.5), "utilization"),
        (dict(dp_overlap=-0.1), "dp_overlap"),
    ],
)
def test_bad_parameters_name_their_field(kwargs, field) -> None:
    values = dict(params=1e9, step_time_s=1.0) | kwargs
    with pytest.raises(ParamError) as info:
        LinkParams(**values)
    assert info.value.field == field
    with pytest.raises(ValueError):
        link_report(REF, link_gbps=0)


def test_parameter_counts_parse() -> None:
    assert parse_quantity("12B") == 12e9 and parse_quantity("1b") == 1e9
    assert parse_quantity("350M") == 350e6 and parse_quantity("7e9") == 7e9
    assert format_count(12e9) == "12B" and format_count(2_400_000) == "2.4M"
    with pytest.raises(ValueError):
        parse_quantity("12 parrots")
