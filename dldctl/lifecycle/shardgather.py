"""A sharded syncer's checkpoints brought to shard 0 before it assembles the final model.

Where `[syncer] shard_hosts` puts shards on other hosts than shard 0, each writes its final
checkpoint on its own host as it shuts down. Shard 0 assembles `final_model.pt` from every
shard's newest checkpoint in its own run directory (syncer/shardmodel.py), so `dldctl down`
copies each such shard's newest checkpoint (and only that: a checkpoint is the size of the
shard's state) into `shard-N/checkpoints/` of shard 0's run directory first: through this
machine when shard 0 runs elsewhere. A shard whose host does not answer, or that has no
checkpoint, is an event; shard 0 then refuses to assemble without it (its own event says so),
so a mixed or partial model is never written silently.

    gather(run, config, state, host_of) -> {shard: copied file name}
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable
from pathlib import Path

from dldctl import shards
from dldctl.errors import DldError
from dldctl.hostruntime import HostRuntime
from dldctl.hosts import Host
from dldctl.rundir import RunDir
from dldctl.runstate import RunState
from syncer.common.resolved import ResolvedConfig

STAGING = ".gather"  # this machine's staging directory (in the run directory) on the way to a remote shard 0


def newest(names: Iterable[str]) -> str | None:
    """The newest checkpoint among file names (syncer/checkpoint.py: zero-padded epoch, outer
    step, then time, so the greatest name is the newest); None without one."""
    found = sorted(n for n in names if n.startswith("ckpt-") and n.endswith(".pt"))
    return found[-1] if found else None


def to_gather(config: ResolvedConfig) -> list[int]:
    """The shards whose checkpoints are not where shard 0 reads them (another host than its own)."""
    return [s for s in range(1, config.syncer.shards) if config.syncer.host_of(s) != config.syncer.host_of(0)]


def gather(run: RunDir, config: ResolvedConfig, state: RunState, host_of: Callable[[str], Host]) -> dict[int, str]:
    """Copy every other host's shard's newest checkpoint into shard 0's run directory; the names
    copied, by shard. Never raises for a host: each failure is an event naming shard and host."""
    copied: dict[int, str] = {}
    zero = config.syncer.host_of(0)
    for shard in to_gather(config):
        name = shards.proc_name(shard)
        where = config.syncer.host_of(shard)
        try:
            found = _copy_one(run, state, host_of, shard, where, zero)
        except DldError as exc:
            run.event("shard_gather_failed", name, f"its checkpoint from {where}: {exc.line()}")
            continue
        if found is None:
            run.event("shard_gather_failed", name, f"no checkpoint of it on {where}")
            continue
        copied[shard] = found
        run.event("shard_gathered", name, f"{found} from {where} for the final model")
    return copied


def _runtime(state: RunState, host: str, run: RunDir) -> HostRuntime:
    if host == "local":
        return HostRuntime("local", "", "", str(run.path), str(run.config))
    return state.runtime_of(host)


def _copy_one(
    run: RunDir, state: RunState, host_of: Callable[[str], Host], shard: int, where: str, zero: str
) -> str | None:
    """Shard `shard`'s newest checkpoint from `where` to shard 0's host `zero`; its name, or None."""
    source = host_of(where)
    src_dir = f"{shards.remote_dir(_runtime(state, where, run).run_dir, shard)}/checkpoints"
    listing = source.run(f"ls -1 {shlex.quote(src_dir)} 2>/dev/null", check=False).stdout
    name = newest(listing.split())
    if name is None:
        return None
    dest_dir = f"{shards.remote_dir(_runtime(state, zero, run).run_dir, shard)}/checkpoints"
    if zero == "local":
        source.get_file(f"{src_dir}/{name}", Path(dest_dir) / name)
        return name
    staged = run.path / STAGING / name
    try:
        source.get_file(f"{src_dir}/{name}", staged)
        target = host_of(zero)
        target.mkdir(dest_dir)
        target.put_file(staged, f"{dest_dir}/{name}", 0o600)
    finally:
        staged.unlink(missing_ok=True)
    return name
