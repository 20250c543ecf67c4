"""Will each syncer shard fit in its host's memory? The operator's verdict per host (pure).

The estimate (floor, full, peak bytes of a shard) and the parsing of a host's answer are
syncer/common/memfit.py's, shared with the syncer; here: the shards summed per host and the line
`up` and `check` print. A host whose free memory is below its shards' floor cannot run them
(`up` refuses); one below `full` or `peak` may, and is warned about. The shell
(dldctl/lifecycle/memcheck.py) asks each syncer host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from syncer.common.memfit import gb, shard_need


@dataclass(frozen=True)
class Need:
    """What one host's syncer shards need, in bytes."""

    host: str
    shards: tuple[int, ...]
    params: int  # the parameters those shards own
    floor: float
    full: float
    peak: float
    scorer: float = 0.0  # of those, what shard 0 holds to score the whole model (sharded runs)


def by_host(
    hosts: Sequence[str], owned: Sequence[int], learners: int, push_b: float, scorer: float = 0.0
) -> list[Need]:
    """Each host's shards (`hosts[s]` runs shard s, which owns `owned[s]` parameters), summed;
    shard 0's host holds `scorer` more (memfit.scorer_bytes)."""
    order: dict[str, list[int]] = {}
    for shard, host in enumerate(hosts):
        order.setdefault(host, []).append(shard)
    needs = []
    for host, ids in order.items():
        parts = [shard_need(owned[s], learners, push_b) for s in ids]
        extra = scorer if 0 in ids else 0.0
        floor, full, peak = (extra + sum(p[i] for p in parts) for i in range(3))
        needs.append(Need(host, tuple(ids), sum(owned[s] for s in ids), floor, full, peak, extra))
    return needs


FITS, MAY_NOT_FIT, DOES_NOT_FIT = "ok", "warn", "fail"


def verdict(need: Need, free: int | None, which: str, shards: int) -> tuple[str, str]:
    """(FITS, MAY_NOT_FIT or DOES_NOT_FIT, one line) for one host: DOES_NOT_FIT only when the
    floor does not fit; a `full` or `peak` that does not is MAY_NOT_FIT."""
    ids = ",".join(map(str, need.shards))
    many = len(need.shards) > 1
    what = "the syncer needs" if shards == 1 else f"syncer shard{'s' if many else ''} {ids} need{'' if many else 's'}"
    line = (
        f"{what} {gb(need.floor)} to {gb(need.full)} ({gb(need.peak)} while checkpointing) "
        f"for {need.params / 1e6:,.1f} M parameters"
    )
    if need.scorer:
        line += f" (of it {gb(need.scorer)} to score the whole model on shard 0; global_eval_every = 0: none)"
    if free is None:
        return FITS, f"{line}; free memory unknown ({which})"
    line += f"; {gb(free)} free ({which})"
    if need.floor > free:
        return DOES_NOT_FIT, line
    if need.full > free:
        return MAY_NOT_FIT, line + ": may not fit once every round holds every learner's push"
    if need.peak > free:
        return MAY_NOT_FIT, line + ": a checkpoint may not fit"
    return FITS, line


def owned_even(total: int, shards: int) -> list[int]:
    """Parameters per shard when the exact fragment plan is not at hand: an even split."""
    return [total // shards + (1 if s < total % shards else 0) for s in range(shards)]


def total_params(shapes: Sequence[tuple[str, tuple[int, ...]]]) -> int:
    """The parameters of (name, shape) pairs."""
    total = 0
    for _, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total
