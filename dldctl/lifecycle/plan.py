"""From an inventory to a resolved run: learner ids, ports, addresses, keys, config.json.

Pure where it can be (`learner_plans`, `describe`); `write` creates the keys
(0600) and the resolved configuration (a ResolvedConfig, syncer/common/resolved.py) that
`python -m syncer` and `python -m learner` read.
"""

from __future__ import annotations

import secrets
import socket
from dataclasses import dataclass

from dldctl import modelspec, shards
from dldctl.errors import ConfigError
from dldctl.inventory import HostSpec, Inventory
from dldctl.lifecycle import initmodel, modeldir
from dldctl.ports import free_port
from dldctl.rundir import RunDir
from syncer.common import keys, modelfile
from syncer.common.resolved import KeysSection, LearnerEntry, ResolvedConfig, SyncerSection


@dataclass(frozen=True)
class LearnerPlan:
    """One learner: its id, host and the per-learner entry of the resolved config."""

    id: str
    host: HostSpec
    entry: LearnerEntry


def learner_entry(lid: str, host: HostSpec, shard: int, shards: int) -> LearnerEntry:
    """The resolved-config entry of one learner."""
    return LearnerEntry(
        id=lid,
        host=host.name,
        device=host.device,
        batch_size=host.batch_size,
        throttle=host.throttle,
        nproc=host.nproc,
        island=host.island,
        threads=host.threads,
        compression=host.compression,
        env=dict(host.env),
        shard=shard % shards,
        shards=shards,
    )


def learner_plans(inv: Inventory) -> list[LearnerPlan]:
    """learner-0, learner-1, ... in inventory order; one data shard each."""
    pairs = inv.learner_hosts()
    return [LearnerPlan(lid, host, learner_entry(lid, host, i, len(pairs))) for i, (lid, host) in enumerate(pairs)]


def free_ports(count: int, taken: set[int], host: str = "127.0.0.1") -> tuple[int, ...]:
    """`count` free ports at `host`, none of them in `taken` nor twice (a port just let go may come back)."""
    out: list[int] = []
    while len(out) < count:
        port = free_port(host)
        if port not in taken and port not in out:
            out.append(port)
    return tuple(out)


def syncer_section(inv: Inventory, advertise: str) -> SyncerSection:
    """Bind address, ports (two more per shard after the first: free ones) and the address learners dial."""
    bind = syncer_bind(inv)
    control = "127.0.0.1"
    others = [_shard_address(inv, h, advertise) for h in inv.syncer.shard_hosts]  # this machine's, not shard 0's
    if inv.syncer.host != "local":  # the syncer runs on an inventory host: dial that host
        advertise = control = inv.syncer.advertise or inv.host(inv.syncer.host).address
    probe = bind if inv.syncer.host == "local" else "127.0.0.1"  # a remote host's ports cannot be probed here
    port = inv.syncer.port or free_port(probe)
    control_port = inv.syncer.control_port or free_ports(1, {port}, probe)[0]
    # "dir" is relative to config.json, so it is the run directory on whichever host reads it
    return SyncerSection(
        host=inv.syncer.host,
        bind_host=bind,
        port=port,
        control_port=control_port,
        advertise=inv.syncer.advertise or advertise,
        control_address=control,
        dir=".",
        shards=inv.syncer.shards,
        shard_ports=free_ports(2 * (inv.syncer.shards - 1), {port, control_port}, probe),
        shard_hosts=tuple(inv.syncer.shard_hosts),
        shard_addresses=tuple(others),
    )


def syncer_bind(inv: Inventory) -> str:
    """The address the syncer binds: [syncer] bind, else loopback when every process is on this machine."""
    where = shards.hosts_of(inv.syncer.host, inv.syncer.shard_hosts, inv.syncer.shards)
    # a site's jobs run on its compute nodes, even with login "local": they dial in from elsewhere
    all_local = all(h.local and not h.site for h in inv.hosts) and all(h == "local" for h in where)
    return inv.syncer.bind or ("127.0.0.1" if all_local else "0.0.0.0")


def check_fixed_ports(inv: Inventory) -> None:
    """Before a run starts: a port the inventory fixed for a syncer on this machine can be bound
    (else ConfigError naming the key); one in use would only show as a syncer that never answers."""
    if inv.syncer.host != "local":
        return  # its host binds it; the syncer's log says so there
    bind = syncer_bind(inv)
    for key, port in (("syncer.port", inv.syncer.port), ("syncer.control_port", inv.syncer.control_port)):
        if port <= 0:
            continue
        with socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq's listener does
            try:
                probe.bind((bind, port))
            except OSError as exc:
                raise ConfigError(
                    inv.path,
                    key,
                    f"the syncer cannot listen on {bind}:{port} ({exc.strerror})",
                    "stop what listens there (another run? `dldctl runs`), or pick another port, or 0 for a free one",
                ) from None


def _shard_address(inv: Inventory, host: str, advertise: str) -> str:
    """The address learners and the operator dial for a shard on `host` (`[syncer] shard_hosts`):
    this machine's `advertise` for "local" or a local [[hosts]] entry, else the host's address."""
    if host == "local" or inv.host(host).local:
        return advertise
    return inv.host(host).address


def resolved_config(inv: Inventory, advertise: str) -> ResolvedConfig:
    """The configuration every process of the run reads."""
    return ResolvedConfig(
        run_id=f"{inv.run.name}-{secrets.token_hex(4)}",
        run=inv.run,
        syncer=syncer_section(inv, advertise),
        learners=tuple(p.entry for p in learner_plans(inv)),
        keys=KeysSection("keys"),
        inventory=inv.path,
        model_args=dict(inv.model_args),
        model_dir=modeldir.COPY if modelspec.kind(inv.run.model) == "hf" else None,  # write() copies it there
        init_model=modelfile.copy_name(inv.run.init_from) if inv.run.init_from else None,  # write() copies it there
    )


def write(inv: Inventory, run: RunDir, advertise: str = "127.0.0.1") -> ResolvedConfig:
    """Create keys (unless insecure), the init model's copy (`[run] init_from`) and config.json
    in the run directory; returns the config."""
    config = resolved_config(inv, advertise)
    initmodel.copy(inv, run)
    modeldir.copy(inv, run)
    if not inv.run.insecure:
        for name in ["syncer", "operator", *config.learner_ids]:
            keys.create(run.keys, name)
    run.write_config(config)
    return config


def add_learners(run: RunDir, config: ResolvedConfig, host: HostSpec, count: int) -> tuple[ResolvedConfig, list[str]]:
    """`count` more learners on `host` (keys too), saved; returns the new config and their ids."""
    existing = config.learners
    shards = existing[0].shards if existing else 1
    next_index = 1 + max((int(e.id.rsplit("-", 1)[1]) for e in existing), default=-1)
    entries = [learner_entry(f"learner-{next_index + i}", host, next_index + i, shards) for i in range(count)]
    if not config.run.insecure:
        for entry in entries:
            keys.create(run.keys, entry.id)
    config = config.with_learners(*entries)
    run.write_config(config)
    return config, [e.id for e in entries]


def _site_words(h: HostSpec) -> str:
    """How a site's learner runs, for --dry-run: `a slurm job of 1 node(s) via login, partition gpu`."""
    asks = [f"{key} {getattr(h, key)}" for key in ("partition", "account", "time") if getattr(h, key)]
    via = "sbatch here" if h.local else h.address
    return ", ".join([f"a {h.scheduler} job of {h.nodes} node(s) via {via}", *asks])


def _shard_words(count: int, shard_hosts: tuple[str, ...] = ()) -> str:
    """`, 2 shards (syncer, syncer-1), each its own process` for a sharded syncer (`syncer-1 on h1`
    where shards run on other hosts); "" for one."""
    if count < 2:
        return ""
    names = shards.names(count)
    if shard_hosts:
        names = [names[0], *(f"{n} on {h}" for n, h in zip(names[1:], shard_hosts, strict=True))]
    return f", {count} shards ({', '.join(names)}), each its own process"


def describe(inv: Inventory) -> list[str]:
    """Human-readable lines of what `up` would do (for --dry-run)."""
    lines = [
        f"run {inv.run.name}: model {inv.run.model}, data {inv.run.data}, H={inv.run.H}, "
        f"fragments={inv.run.fragments}, quorum={inv.run.quorum}, compression={inv.run.compression}, "
        f"merge={inv.run.merge}{', INSECURE' if inv.run.insecure else ''}",
        f"syncer on {inv.syncer.host} (port {inv.syncer.port or 'auto'})"
        + _shard_words(inv.syncer.shards, inv.syncer.shard_hosts),
    ]
    for plan in learner_plans(inv):
        h = plan.host
        where = "this machine" if h.local else f"{h.address} over SSH"
        if h.site:
            where = _site_words(h)
        nproc = f"{h.nproc} (fsdp)" if h.island == "fsdp" else str(h.nproc)
        lines.append(
            f"{plan.id} on {h.name} ({where}): device {h.device}, nproc {nproc}, "
            f"batch {h.batch_size or inv.run.batch_size}, throttle {h.throttle:g}"
        )
    lines += initmodel.describe(inv)
    lines += modeldir.describe(inv)
    lines += [f"WARNING: {risk}" for risk in inv.run.risks(len(learner_plans(inv)))]
    return lines
