"""Capping one learner's link to the syncer on real hosts (`dldctl chaos link`): probe both ends,
cap, uncap. The commands themselves are data (dldctl/faults/linkcap.py); this is the thin shell
that runs them over the `Host` interface (local or SSH), so it works wherever the run's hosts do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dldctl.errors import ChaosError
from dldctl.faults import linkcap
from dldctl.faults.linkcap import LinkCapError, LinkSide
from dldctl.hosts import Host
from dldctl.hosts.base import output_tail
from dldctl.runstate import ProcStatus, RunState
from syncer.common.resolved import ResolvedConfig


@dataclass(frozen=True)
class Ends:
    """The two hosts of a learner's link and what the learner dials (the syncer's address and port)."""

    learner: str
    learner_host: Host
    syncer_host: Host
    syncer_addr: str
    port: int
    shared: tuple[str, ...] = ()  # the run's other learners (they may share a loopback link)


def ends_of(state: RunState, config: ResolvedConfig, learner: str, host: Callable[[str], Host]) -> Ends:
    """The link of `learner` in this run (`host` opens a host of the run by name)."""
    syncer = state.procs["syncer"].host
    others = tuple(sorted(n for n, p in state.procs.items() if p.learner and n != learner))
    return Ends(
        learner, host(state.procs[learner].host), host(syncer), config.syncer.advertise, config.syncer.port, others
    )


def sharing(state: RunState, addresses: Mapping[str, str], learner: str) -> list[str]:
    """The other learners on the same machine as `learner` (same host address): a cap on its link
    would cap theirs too, since both reach the syncer from one address."""
    mine = addresses.get(state.procs[learner].host)
    live = (ProcStatus.STOPPED, ProcStatus.FINISHED)
    return sorted(
        name
        for name, proc in state.procs.items()
        if proc.learner and name != learner and proc.status not in live and addresses.get(proc.host) == mine
    )


def probe(ends: Ends, *, capping: bool = True) -> tuple[LinkSide, LinkSide]:
    """Each end's device, address and root qdisc (LinkCapError naming the host that cannot be
    capped; `capping` False: only where the cap is, to take it off)."""
    said = ends.learner_host.run(linkcap.probe_script(ends.syncer_addr), check=False).stdout
    near = linkcap.parse_probe(ends.learner_host.name, ends.syncer_addr, said)
    if capping and near.dev == "lo" and ends.shared:
        raise LinkCapError(
            f"host {ends.learner_host.name}: {ends.learner} reaches the syncer over loopback (the syncer's own "
            f"machine), as {', '.join(ends.shared)} may: a cap there would cap them too"
        )
    said = ends.syncer_host.run(linkcap.probe_script(near.src), check=False).stdout
    far = linkcap.parse_probe(ends.syncer_host.name, near.src, said)
    return near, far


def plan(ends: Ends, rate_bits: int) -> list[tuple[Host, list[str]]]:
    """The tc commands for each end, checked (LinkCapError where a host cannot take them)."""
    near, far = probe(ends)
    return [
        (
            ends.learner_host,
            linkcap.cap_commands(near, ends.learner, 0, rate_bits, linkcap.to_syncer(near.peer_ip, ends.port)),
        ),
        (
            ends.syncer_host,
            linkcap.cap_commands(far, ends.learner, 1, rate_bits, linkcap.from_syncer(far.peer_ip, ends.port)),
        ),
    ]


def cap(ends: Ends, rate_bits: int) -> str:
    """Cap both directions; on any refusal the half-done cap is taken off again. Returns where."""
    steps = plan(ends, rate_bits)
    for host, commands in steps:
        result = host.run(" && ".join(commands), check=False)
        if result.status != 0:
            uncap(ends)
            raise ChaosError(f"host {host.name}: tc refused the cap: {' '.join(output_tail(result, 2).split())}")
    near, far = probe(ends, capping=False)
    return f"{near.dev} on {ends.learner_host.name} (to the syncer), {far.dev} on {ends.syncer_host.name} (back)"


def uncap(ends: Ends) -> None:
    """Take the learner's cap off both ends (idempotent)."""
    try:
        near, far = probe(ends, capping=False)
    except LinkCapError as exc:
        raise ChaosError(f"cannot undo the link cap of {ends.learner}: {exc}") from None
    ends.learner_host.run(linkcap.uncap_script(near, ends.learner, 0), check=False)
    ends.syncer_host.run(linkcap.uncap_script(far, ends.learner, 1), check=False)
