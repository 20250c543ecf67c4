"""Wide-area link bandwidth: data-parallel training versus Decoupled DiLoCo (pure arithmetic).

Both are modelled as one periodic transfer per site and direction (links are full duplex):

- **data-parallel** across `sites` sites all-reduces the whole gradient every step; a ring moves
  2 (n-1)/n of the gradient's bytes through each site's link per step. The transfer can hide
  behind the backward pass (`dp_overlap` of the step, about 2/3: backward costs twice forward).
- **Decoupled DiLoCo** sends one fragment (params / fragments values, quantized to `bits` plus one
  fp32 absmax scale per block of 128 values, as syncer/wire/quant.py packs them) every H / fragments
  steps, and receives the merged fragment back the same size. The learner keeps training while it
  is in flight and needs the reply `tau` steps later (or before the next fragment is due, if
  sooner); only the excess stalls compute.

A transfer of `bits` every `period_s` that may hide behind `hidden_s` of compute gives utilization
period / (period + max(0, bits / link - hidden)), and conversely the link needed for a target
utilization U is bits / (hidden + period (1/U - 1)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dldctl.sim.errors import check

DATA_PARALLEL = "data_parallel"
DILOCO = "decoupled_diloco"
CODEC_BITS = (4, 8, 16, 32)  # int4, int8, bf16, none: the modes of syncer/wire/codec.py
SCALE_BLOCK = 128  # values per absmax scale (syncer/wire/codec.py default)
SCALE_BITS = 32  # the scale is stored as fp32
TOPK_CHUNK, TOPK_KEEP = 4096, 64  # topk's defaults (syncer/wire/thin.py): an int16 index + 2 bits a kept value
# bits per value on the wire of each codec by name, before zstd (syncer/wire/quant.py, thin.py)
CODEC_EFFECTIVE = {
    "none": 32.0,
    "bf16": 16.0,
    "int8": 8 + SCALE_BITS / SCALE_BLOCK,
    "int4": 4 + SCALE_BITS / SCALE_BLOCK,
    "2bit": 2 + SCALE_BITS / SCALE_BLOCK,
    "topk": (TOPK_KEEP * (16 + 2) + SCALE_BITS) / TOPK_CHUNK,
}
GBIT = 1e9


@dataclass(frozen=True)
class LinkParams:
    """A model, its step time and how it is spread over sites."""

    params: float  # parameter count
    step_time_s: float  # one inner (or data-parallel) step's compute time
    H: int = 64  # inner steps between two syncs of one fragment
    fragments: int = 4
    bits: int = 4  # DiLoCo outer-gradient precision (codec mode)
    compression: str = ""  # a codec by name (CODEC_EFFECTIVE), in place of `bits`; "" = by bits
    tau: int = 2  # steps a learner may run ahead of a reply
    sites: int = 4  # data centres (one DiLoCo learner each)
    utilization: float = 0.95  # target share of time spent computing
    dp_bits: int = 16  # data-parallel gradient precision (bf16 all-reduce)
    dp_overlap: float = 2.0 / 3.0  # share of a step the all-reduce can hide behind

    def __post_init__(self) -> None:
        check(self.problems())

    def problems(self) -> list[tuple[str, str]]:
        """(field, problem) for every value out of range; empty when the set is valid."""
        checks = [
            ("params", self.params >= 1, "must be >= 1"),
            ("step_time_s", self.step_time_s > 0, "must be > 0"),
            ("H", self.H >= 1, "must be >= 1"),
            ("fragments", 1 <= self.fragments <= self.H, "must be between 1 and H"),
            ("bits", self.bits in CODEC_BITS, "must be one of 4, 8, 16, 32"),
            ("compression", self.compression in ("", *CODEC_EFFECTIVE), f"must be one of {', '.join(CODEC_EFFECTIVE)}"),
            ("tau", self.tau >= 0, "must be >= 0"),
            ("sites", self.sites >= 2, "must be >= 2 (one site crosses no wide-area link)"),
            ("utilization", 0 < self.utilization <= 1, "must be in (0, 1]"),
            ("dp_bits", self.dp_bits in (8, 16, 32), "must be one of 8, 16, 32"),
            ("dp_overlap", 0 <= self.dp_overlap <= 1, "must be in [0, 1]"),
        ]
        return [(name, why) for name, ok, why in checks if not ok]


@dataclass(frozen=True)
class Transfer:
    """`bits` to move each way every `period_s`, of which `hidden_s` overlap with compute."""

    strategy: str
    bits: float
    period_s: float
    hidden_s: float

    @property
    def average_gbps(self) -> float:
        """Sustained rate, each way, averaged over the period."""
        return self.bits / self.period_s / GBIT

    def required_gbps(self, utilization: float) -> float:
        """Link rate (each way) at which compute is busy `utilization` of the time."""
        if self.bits == 0:
            return 0.0
        # Compute may stall period * (1/U - 1) per period on top of what overlap hides.
        window = self.hidden_s + self.period_s * (1.0 / utilization - 1.0)
        return self.bits / window / GBIT if window > 0 else math.inf

    def utilization_at(self, link_gbps: float) -> float:
        """Share of time computing on a link of `link_gbps` each way."""
        if link_gbps <= 0:
            return 0.0
        stall = max(0.0, self.bits / (link_gbps * GBIT) - self.hidden_s)
        return self.period_s / (self.period_s + stall)


def effective_bits(bits: int) -> float:
    """Bits per value on the wire, with the per-block scale of the quantized modes (before zstd)."""
    return bits + (SCALE_BITS / SCALE_BLOCK if bits <= 8 else 0.0)


def data_parallel_transfer(p: LinkParams) -> Transfer:
    """Ring all-reduce of the gradient across sites, every step."""
    ring = 2.0 * (p.sites - 1) / p.sites
    return Transfer(DATA_PARALLEL, ring * p.params * p.dp_bits, p.step_time_s, p.dp_overlap * p.step_time_s)


def diloco_transfer(p: LinkParams) -> Transfer:
    """One quantized fragment every H / fragments steps; the reply may lag min(tau, H/P) steps."""
    steps_between = p.H / p.fragments
    per_value = CODEC_EFFECTIVE[p.compression] if p.compression else effective_bits(p.bits)
    frag_bits = p.params / p.fragments * per_value
    return Transfer(DILOCO, frag_bits, steps_between * p.step_time_s, min(p.tau, steps_between) * p.step_time_s)


@dataclass(frozen=True)
class LinkReport:
    """Both strategies' needs on one site's link (each way), and the syncer's average ingress."""

    params: LinkParams
    data_parallel: Transfer
    diloco: Transfer
    link_gbps: float | None

    @property
    def reduction(self) -> float:
        """How many times less link DiLoCo needs than data-parallel at the target utilization."""
        u = self.params.utilization
        need_dp, need_diloco = self.data_parallel.required_gbps(u), self.diloco.required_gbps(u)
        return need_dp / need_diloco if 0 < need_diloco < math.inf else math.inf

    @property
    def syncer_ingress_gbps(self) -> float:
        """Average rate into the syncer from all sites' learners."""
        return self.diloco.average_gbps * self.params.sites

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (the shape is documented in docs/simulate.md)."""
        u = self.params.utilization
        rows = {}
        for t in (self.data_parallel, self.diloco):
            rows[t.strategy] = {
                "bytes_per_transfer": t.bits / 8,
                "period_s": t.period_s,
                "hidden_s": t.hidden_s,
                "average_gbps": t.average_gbps,
                "required_gbps": _finite(t.required_gbps(u)),
                "utilization_at_link": None if self.link_gbps is None else t.utilization_at(self.link_gbps),
            }
        return {
            "params": self.params.__dict__.copy(),
            "link_gbps": self.link_gbps,
            "strategies": rows,
            "reduction": _finite(self.reduction),
            "syncer_ingress_gbps": self.syncer_ingress_gbps,
        }


def _finite(x: float) -> float | None:
    """JSON has no infinity: an unreachable need is reported as null."""
    return x if math.isfinite(x) else None


def link_report(p: LinkParams, link_gbps: float | None = None) -> LinkReport:
    """Both transfers for `p`, and (when given) what utilization each reaches on `link_gbps`."""
    if link_gbps is not None and link_gbps <= 0:
        raise ValueError("link_gbps: must be > 0")
    return LinkReport(p, data_parallel_transfer(p), diloco_transfer(p), link_gbps)
