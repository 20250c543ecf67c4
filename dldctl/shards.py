"""A sharded syncer as the operator sees it: process names, chaos targets, directories (pure).

`[syncer] shards = S` runs S syncer processes, each owning a balanced subset of the run's
fragments (syncer/wire/shards.py): all on the syncer's host, or shards 1..S-1 on the hosts
`[syncer] shard_hosts` names (one each; "local" or a [[hosts]] machine). The supervisor keeps them as processes named
`syncer` (shard 0: the name an unsharded run has always had, so nothing about a run of one shard
changes) and `syncer-1` .. `syncer-(S-1)`, each started with `--shard N` and logging to
`logs/<name>.log`. Shard 0 keeps its checkpoints, metrics, events, epoch and refusal marker in
the run directory; shard s > 0 in `shard-s/` inside it (`syncer.common.resolved.shard_subdir`).

No I/O: names in, names out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from dldctl.errors import ConfigError, UsageError
from syncer.common.resolved import shard_subdir
from syncer.common.settings import suggest

SYNCER = "syncer"  # shard 0's process, and the kind of every shard's process


class _Machine(Protocol):
    """What the checks need of an inventory host (dldctl.inventory.HostSpec)."""

    @property
    def site(self) -> bool: ...


def proc_name(shard: int) -> str:
    """The supervisor's name of shard `shard`'s process: `syncer`, `syncer-1`, ..."""
    return SYNCER if shard == 0 else f"{SYNCER}-{shard}"


def names(count: int) -> list[str]:
    """Every shard's process name, shard 0 first."""
    return [proc_name(s) for s in range(max(1, count))]


def shard_of(name: str) -> int | None:
    """Which shard a process name is (`syncer` and `syncer-0` 0, `syncer-3` 3); None for any other name."""
    if name == SYNCER:
        return 0
    head, _, tail = name.rpartition("-")
    if head != SYNCER or not tail.isdigit() or str(int(tail)) != tail:
        return None
    return int(tail)


def subdir(shard: int) -> str:
    """Where shard `shard` keeps its files, relative to the run directory ("" for shard 0)."""
    return shard_subdir(shard)


def remote_dir(run_dir: str, shard: int) -> str:
    """Shard `shard`'s directory on the syncer's host, from that host's run directory."""
    return f"{run_dir}/{subdir(shard)}" if shard else run_dir


def local_dir(run_dir: Path, shard: int) -> Path:
    """Shard `shard`'s directory in a run directory on this machine."""
    return run_dir / subdir(shard) if shard else run_dir


def valid_targets(count: int) -> str:
    """The syncer targets a run of `count` shards has, as an operator types them."""
    return ", ".join(["syncer (= syncer-0)", *names(count)[1:]])


def syncer_target(target: str, count: int) -> str | None:
    """The process a chaos target names when it names a syncer shard: `syncer` and `syncer-0` are
    shard 0, `syncer-N` shard N; None when it names no syncer (a learner); UsageError, naming the
    valid targets, for a shard this run does not have."""
    if target != SYNCER and not target.startswith(SYNCER + "-"):
        return None
    shard = shard_of(target)
    if shard is None or shard >= count:
        raise UsageError(
            f"no syncer shard {target!r} in this run (it has {count} shard{'s' if count != 1 else ''})",
            hint=f"syncer targets: {valid_targets(count)}",
        )
    return proc_name(shard)


def check_count(path: str, count: int, fragments: int) -> None:
    """[syncer] shards: from 1 (one syncer process) to the run's fragments (each shard owns at
    least one); ConfigError naming the file, the key and the fix."""
    if count < 1:
        raise ConfigError(path, "syncer.shards", f"must be >= 1, got {count}", "set shards = 1 for one syncer process")
    if count > fragments:
        raise ConfigError(
            path,
            "syncer.shards",
            f"{count} shards but [run] fragments = {fragments}: every shard owns at least one fragment",
            f"set shards <= {fragments}, or raise [run] fragments",
        )


def hosts_of(host: str, shard_hosts: Sequence[str], count: int) -> list[str]:
    """Every shard's host, shard 0 first: `host` for shard 0, then `shard_hosts` (or `host` again)."""
    return [host, *(shard_hosts or [host] * (count - 1))]


def check_hosts(path: str, host: str, shard_hosts: Sequence[str], count: int, machines: Mapping[str, _Machine]) -> None:
    """[syncer] host and shard_hosts: each "local" or a [[hosts]] machine (in `machines`; not a
    scheduler site: a syncer is a long-lived server), and shard_hosts one per shard after the
    first; ConfigError naming the file, the key and the fix."""
    _check_machine(path, "syncer.host", host, machines)
    if not shard_hosts:
        return
    if len(shard_hosts) != count - 1:
        raise ConfigError(
            path,
            "syncer.shard_hosts",
            f"{len(shard_hosts)} hosts for {count - 1} shard(s) after the first (shards = {count})",
            f"list one host per shard 1..{count - 1} (shard 0 runs on [syncer] host), "
            f"or set shards = {len(shard_hosts) + 1}",
        )
    for name in shard_hosts:
        _check_machine(path, "syncer.shard_hosts", name, machines)


def _check_machine(path: str, key: str, name: str, machines: Mapping[str, _Machine]) -> None:
    if name == "local":
        return
    machine = machines.get(name)
    if machine is None:
        close = suggest(name, list(machines))
        fix = f"did you mean {close!r}?" if close else f"hosts are: {', '.join(['local', *machines])}"
        raise ConfigError(path, key, f"no host named {name!r}", fix)
    if machine.site:
        raise ConfigError(path, key, f"{name!r} is a scheduler site", "run the syncer on a [[hosts]] machine")
