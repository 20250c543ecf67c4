"""Starting the run's processes on a host: the argv and environment of a syncer or a learner.

Secrets never travel in argv or the environment: processes read their keys from files (0600)
named in the resolved configuration.
"""

from __future__ import annotations

from dldctl import shards
from dldctl.hostruntime import HostRuntime
from dldctl.hosts import Host, ProcRef
from syncer.common.resolved import LearnerEntry


def _env(runtime: HostRuntime, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The process environment: the host's `env` on top; the import path is the run's code snapshot
    (`[run] workdir`) first, then a PYTHONPATH of the host's `env`, then ours (where dldctl's wheel
    is installed): a user's module wins over a name of ours, and nothing replaces the wheel."""
    env = {"PYTHONUNBUFFERED": "1"}
    env.update(extra or {})
    path = [runtime.code, env.get("PYTHONPATH", ""), runtime.pythonpath]
    if any(path[::2]):
        env["PYTHONPATH"] = ":".join(filter(None, path))
    return env


def syncer_argv(runtime: HostRuntime, shard: int = 0) -> list[str]:
    """`python -m syncer --config ...`, with `--shard N` for shard N > 0 of a sharded syncer."""
    argv = [runtime.python, "-m", "syncer", "--config", runtime.config]
    return [*argv, "--shard", str(shard)] if shard else argv


def learner_argv(runtime: HostRuntime, entry: LearnerEntry) -> list[str]:
    """`python -m learner ...`, or the same under torchrun for an island of nproc ranks."""
    lid = entry.id
    tail = ["--config", runtime.config, "--id", lid, "--workdir", runtime.learner_workdir(lid)]
    nproc = entry.nproc
    if nproc > 1:
        return [
            runtime.python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "learner",
            *tail,
        ]
    return [runtime.python, "-m", "learner", *tail]


# glibc hands freed fragment-sized buffers back to the kernel and faults them in again every
# round; keeping them costs little memory and measured 5-15% of the syncer's merge time
SYNCER_MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


def syncer_env(runtime: HostRuntime) -> dict[str, str]:
    """A syncer's environment: the run's code and our PYTHONPATH, the allocator's settings."""
    return _env(runtime, SYNCER_MALLOC)


def start_syncer(host: Host, runtime: HostRuntime, name: str = shards.SYNCER) -> ProcRef:
    """Start the syncer process `name` (`syncer`, or shard N's `syncer-N`), logging to logs/NAME.log."""
    shard = shards.shard_of(name)
    if shard is None:
        raise ValueError(f"{name!r} is not a syncer process name (syncer, syncer-1, ...)")
    argv = syncer_argv(runtime, shard)
    return host.start(argv, cwd=runtime.run_dir, log=runtime.log_path(name), env=syncer_env(runtime))


def learner_env(runtime: HostRuntime, entry: LearnerEntry, restarts: int) -> dict[str, str]:
    """A learner's environment: its host's `env`, our PYTHONPATH, its restart count and threads."""
    env = _env(runtime, dict(entry.env))
    env["DLDCTL_RESTARTS"] = str(restarts)
    env["OMP_NUM_THREADS"] = str(entry.threads)
    if entry.nproc > 1:
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # pytorch/pytorch#135712
    return env


def start_learner(host: Host, runtime: HostRuntime, entry: LearnerEntry, restarts: int) -> ProcRef:
    lid = entry.id
    host.mkdir(runtime.learner_workdir(lid))
    env = learner_env(runtime, entry, restarts)
    return host.start(learner_argv(runtime, entry), cwd=runtime.run_dir, log=runtime.log_path(lid), env=env)
