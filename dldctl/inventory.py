"""Inventory files: what to run where, as typed, frozen dataclasses (one per TOML table).

    [run]      RunSettings (syncer/common/settings.py): model, data, H, fragments, quorum, ...
    [ssh]      SSHSpec: how to reach remote hosts
    [syncer]   SyncerSpec: where the syncer runs and listens
    [[hosts]]  HostSpec: one entry per machine (address "local" = this machine, no SSH)
    [[sites]]  a scheduler's cluster (Slurm) whose learners run as batch jobs, reached through its
               login node; kept as a HostSpec with `scheduler` set (login -> address), so every
               room that knows hosts knows sites
    [metrics]  MetricsSpec (dldctl/metricspec.py): TensorBoard, Prometheus, W&B sinks
    [alerts]   AlertsSpec (dldctl/alertspec.py): a command and/or webhook on chosen events
    [model]    free-form keys for the run's model (dldctl/modelspec.py), handed to its factory

Unknown keys and wrong types are rejected with the file, the key, a "did you mean" and the fix;
each field's rule is declared with the field (syncer/common/typedcodec.py checks it), and the
rules that relate fields are checked before anything starts. A relative path (`[run] init_from`) is
taken from the inventory file's directory (`load` makes it absolute; also `workdir` and an
`hf:` model's directory). The built-in default
(`dldctl up` with no argument) is an Inventory built from the same dataclasses.
"""

from __future__ import annotations

import os
import re

# stdlib since 3.11; mypy checks as 3.10 (pyproject's python_version), which has none
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from dldctl import alertspec, metricspec, modelspec, shards
from dldctl.alertspec import AlertsSpec
from dldctl.errors import ConfigError
from dldctl.hosts import slurmjobs
from dldctl.metricspec import MetricsSpec
from syncer.common.resolved import Island
from syncer.common.settings import HostCompression, RunSettings, SettingsError, from_mapping, run_from_mapping, suggest
from syncer.common.typedcodec import check_fields, checked, meta, to_mapping

TABLES = ("run", "ssh", "syncer", "hosts", "sites", "metrics", "alerts", "model")
SCHEDULERS = ("slurm",)
_SCHEDULER = "|".join(("", *SCHEDULERS))  # "" = a machine
# sbatch options dldctl sets itself for every learner job (a site's sbatch_args may not override them)
OWN_SBATCH: tuple[str, ...] = ("--output", "--error", "--job-name", "--comment", "--parsable", "--requeue")
OWN_SBATCH += ("--no-requeue", "--chdir", "-o", "-e", "-J", "-D", "--open-mode", "--export", "--wrap")
# ... and the ones a site sets with its own keys (so `check` judges what sbatch will get)
SITE_SBATCH = {"--partition": "partition", "-p": "partition", "--account": "account", "-A": "account"}
SITE_SBATCH |= {"--time": "time", "-t": "time", "--nodes": "nodes", "-N": "nodes", "--gpus-per-node": "gpus_per_node"}


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_ADDRESS_FIX = 'set the host\'s address, or "local" for this machine'


@dataclass(frozen=True)
class SSHSpec:
    """[ssh]: defaults for every remote host (a host entry may override user/port)."""

    user: str = ""  # "" = from ~/.ssh/config or the local user
    identity_file: str = ""  # "" = the SSH agent / ~/.ssh/config
    port: int = 0  # 0 = from ~/.ssh/config, else 22
    known_hosts: str = "~/.ssh/known_hosts"
    host_key_policy: Literal["strict", "accept-new"] = "strict"
    proxy_jump: str = ""  # "user@jumphost:port"
    connect_timeout: float = 10.0
    use_ssh_config: bool = True


@dataclass(frozen=True)
class SyncerSpec:
    """[syncer]: where the syncer runs and which ports it binds (0 = pick a free one)."""

    host: str = "local"  # "local" or the name of a [[hosts]] entry
    port: int = 0
    control_port: int = 0
    bind: str = ""  # "" = 127.0.0.1 if every learner is local, else 0.0.0.0
    advertise: str = ""  # address learners dial; "" = worked out per run
    shards: int = 1  # syncer processes, each owning a balanced subset of the fragments
    shard_hosts: tuple[str, ...] = ()  # where shards 1..S-1 run ("local" or [[hosts]] names); () = on `host`


@dataclass(frozen=True)
class HostSpec:
    """[[hosts]]: one machine and the learners it runs."""

    name: str
    # "local", an IP, a DNS name or an ~/.ssh/config alias
    address: str = field(metadata=meta(pattern=r".*\S.*", allowed="an address", fix=_ADDRESS_FIX))
    learners: int = checked(1, ge=0)
    device: str = checked("cpu", pattern=r"cpu|cuda(:\d+)?", allowed="a device", fix='use "cpu", "cuda" or "cuda:N"')
    nproc: int = checked(1, ge=1)  # ranks per learner (torchrun island)
    # ddp: every rank a replica | fsdp: the model sharded across the ranks
    island: Island = checked("ddp", fix='use "ddp" (default) or "fsdp"')  # noqa: RUF009 (a field())
    threads: int = checked(1, ge=1)  # torch threads per rank
    batch_size: int = checked(0, ge=0)  # 0 = [run] batch_size
    # "" = [run] compression; a thin link's codec for this host's pushes (updates stay the run's)
    compression: HostCompression = checked("", fix="leave it out for [run] compression, or pick one of those")  # noqa: RUF009
    throttle: float = checked(1.0, ge=1, note="1 = full speed")  # >1 = artificially slower (demos and tests)
    python: str = "python3"  # interpreter on the host (with torch, unless setup = "venv")
    setup: Literal["auto", "venv"] = "auto"  # auto: use `python`, add our wheel | venv: fresh venv with torch
    torch: str = "torch"  # what `setup = "venv"` installs
    workdir: str = "~/.dldctl"  # remote base directory
    user: str = ""  # overrides [ssh] user
    port: int = 0  # overrides [ssh] port (0 = [ssh] port)
    env: dict[str, str] = field(default_factory=dict)
    # [[sites]] only: a scheduler's cluster; `address` is its login node
    # "" = a machine; "slurm" = learners are Slurm batch jobs
    scheduler: str = checked("", pattern=_SCHEDULER, allowed="a scheduler dldctl drives", fix='use "slurm"')
    partition: str = ""  # "" = the cluster's default partition
    account: str = ""
    nodes: int = checked(1, ge=1)  # per learner; > 1 (or nproc > 1) = a torchrun island inside the job
    gpus_per_node: int = checked(0, ge=0)
    time: str = ""  # the job's time limit in Slurm's syntax ("12:00:00"); "" = the partition's default
    sbatch_args: tuple[str, ...] = ()  # further sbatch options, e.g. ["--qos=high", "--constraint=a100"]

    @property
    def local(self) -> bool:
        """Whether dldctl reaches it without SSH (for a site: sbatch on this machine)."""
        return self.address == "local"

    @property
    def site(self) -> bool:
        """A scheduler's cluster rather than a machine."""
        return bool(self.scheduler)


@dataclass(frozen=True)
class Inventory:
    """A whole inventory; `path` is where it came from (or "<built-in default>")."""

    run: RunSettings
    ssh: SSHSpec
    syncer: SyncerSpec
    hosts: tuple[HostSpec, ...]
    path: str = "<built-in default>"
    metrics: MetricsSpec = field(default_factory=MetricsSpec)
    alerts: AlertsSpec = field(default_factory=AlertsSpec)
    model_args: dict[str, Any] = field(default_factory=dict)  # [model]: free-form, for the model's factory

    @property
    def total_learners(self) -> int:
        return sum(h.learners for h in self.hosts)

    def host(self, name: str) -> HostSpec:
        for h in self.hosts:
            if h.name == name:
                return h
        close = suggest(name, [h.name for h in self.hosts])
        raise ConfigError(
            self.path,
            "hosts",
            f"no host named {name!r}",
            f"did you mean {close!r}?" if close else f"hosts are: {', '.join(h.name for h in self.hosts)}",
        )

    def learner_hosts(self) -> list[tuple[str, HostSpec]]:
        """(learner id, host) in inventory order: learner-0, learner-1, ..."""
        out: list[tuple[str, HostSpec]] = []
        for h in self.hosts:
            for _ in range(h.learners):
                out.append((f"learner-{len(out)}", h))
        return out


def default_inventory() -> Inventory:
    """The built-in default: a syncer and four learners of different speeds on this machine."""
    run = RunSettings(name="default", model="gpt-small", H=32, fragments=4, seq_len=128, batch_size=16, eval_every=50)
    hosts = (
        HostSpec(name="local-fast", address="local", learners=2, batch_size=16),
        HostSpec(name="local-mid", address="local", learners=1, batch_size=12, throttle=1.5),
        HostSpec(name="local-slow", address="local", learners=1, batch_size=8, throttle=3.0),
    )
    inv = Inventory(run=run, ssh=SSHSpec(), syncer=SyncerSpec(), hosts=hosts)
    validate(inv)
    return inv


def load(path: str | os.PathLike[str]) -> Inventory:
    """Read, type-check and validate an inventory file."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(
            str(p), None, "no such file", "check the path, or run `dldctl up` with no argument for the built-in default"
        ) from None
    except OSError as exc:
        raise ConfigError(str(p), None, f"cannot read ({exc.strerror})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(p), None, f"not valid TOML: {exc}", "fix the syntax at that line") from exc
    inv = with_paths_from(parse(data, str(p)), p.parent)
    validate(inv)
    return inv


def with_paths_from(inv: Inventory, base: Path) -> Inventory:
    """The inventory with its file paths made absolute: `~` expanded, a relative one taken from
    `base` (the inventory file's directory), so the run directory's copy means the same file."""
    return replace(inv, run=modelspec.absolute(inv.run, base))


def parse(data: dict[str, Any], path: str) -> Inventory:
    """Typed dataclasses from a TOML document (no cross-field checks)."""
    for key in data:
        if key not in TABLES:
            close = suggest(key, list(TABLES))
            raise ConfigError(
                path, key, "unknown table", f"did you mean [{close}]?" if close else f"tables are {', '.join(TABLES)}"
            )
    try:
        run = run_from_mapping(data.get("run", {}))
        ssh = from_mapping(SSHSpec, data.get("ssh", {}), "ssh")
        syncer = from_mapping(SyncerSpec, data.get("syncer", {}), "syncer")
        raw_hosts = data.get("hosts", [])
        if not isinstance(raw_hosts, list):
            raise SettingsError("hosts", "must be an array of tables", "write each host as [[hosts]]")
        hosts = tuple(_host(entry, i) for i, entry in enumerate(raw_hosts)) + _sites(data.get("sites", []))
        metrics = from_mapping(MetricsSpec, data.get("metrics", {}), "metrics")
        alert_spec = from_mapping(AlertsSpec, data.get("alerts", {}), "alerts")
        model_args = modelspec.model_table(data.get("model", {}))
    except SettingsError as exc:
        raise ConfigError(path, exc.key, exc.problem, exc.fix) from None
    return Inventory(
        run=run,
        ssh=ssh,
        syncer=syncer,
        hosts=hosts,
        path=path,
        metrics=metrics,
        alerts=alert_spec,
        model_args=model_args,
    )


def _host(entry: Any, index: int) -> HostSpec:
    if isinstance(entry, dict):
        for required in ("name", "address"):
            if required not in entry:
                label = entry.get("name", f"#{index + 1}")
                raise SettingsError(
                    f"hosts.{required}",
                    f"host {label} has no {required}",
                    f'add {required} = "..." to that [[hosts]] entry'
                    + (' ("local" for this machine)' if required == "address" else ""),
                )
    label = entry.get("name", f"#{index + 1}") if isinstance(entry, dict) else f"#{index + 1}"
    try:
        return from_mapping(HostSpec, entry, "hosts")
    except SettingsError as exc:
        raise SettingsError(exc.key, f"host {label}: {exc.problem}", exc.fix) from None


def _sites(raw: Any) -> tuple[HostSpec, ...]:
    """[[sites]]: each a HostSpec whose `address` is its `login` and whose `scheduler` is set."""
    if not isinstance(raw, list):
        raise SettingsError("sites", "must be an array of tables", "write each site as [[sites]]")
    out = []
    for i, entry in enumerate(raw):
        label = entry.get("name", f"#{i + 1}") if isinstance(entry, dict) else f"#{i + 1}"
        if not isinstance(entry, dict):
            raise SettingsError("sites", f"site {label} must be a table", "write each site as [[sites]]")
        if "address" in entry:
            raise SettingsError(
                "sites.address", f"site {label}: a site has a login, not an address", "write login = ..."
            )
        for required, example in (
            ("name", '"cluster-a"'),
            ("scheduler", '"slurm"'),
            ("login", '"user@login.example.org"'),
        ):
            if required not in entry:
                raise SettingsError(
                    f"sites.{required}", f"site {label} has no {required}", f"add {required} = {example}"
                )
        mapping = {("address" if k == "login" else k): v for k, v in entry.items()}
        try:
            out.append(from_mapping(HostSpec, mapping, "sites"))
        except SettingsError as exc:
            raise SettingsError(exc.key, f"site {label}: {exc.problem}", exc.fix) from None
    return tuple(out)


def validate(inv: Inventory) -> None:
    """Each field's rule and the rules that relate fields, checked before anything starts."""
    path = inv.path
    try:
        inv.run.validate()
    except SettingsError as exc:
        raise ConfigError(path, f"run.{exc.key}", exc.problem, exc.fix) from None
    if not inv.hosts:
        raise ConfigError(
            path, "hosts", "no hosts", 'add at least one [[hosts]] entry (address = "local" for this machine)'
        )
    _validate_hosts(inv)
    metricspec.validate(inv.metrics, path)
    _validate_alerts(inv)
    total = inv.total_learners
    if total < 1:
        raise ConfigError(path, "hosts.learners", "the fleet has no learners", "set learners >= 1 on some host")
    if inv.run.quorum > total:
        raise ConfigError(
            path,
            "run.quorum",
            f"quorum {inv.run.quorum} is larger than the fleet ({total} learners)",
            f"set quorum <= {total}",
        )
    modelspec.validate(inv.run, inv.model_args, path)
    _validate_ssh(inv)
    shards.check_count(path, inv.syncer.shards, inv.run.fragments)
    shards.check_hosts(path, inv.syncer.host, inv.syncer.shard_hosts, inv.syncer.shards, {h.name: h for h in inv.hosts})
    if inv.ssh.proxy_jump and inv.syncer.host == "local" and not inv.syncer.advertise:
        raise ConfigError(
            path,
            "syncer.advertise",
            "hosts are reached through proxy_jump, but learners dial the syncer directly",
            "set advertise = the address at which the hosts can reach this machine",
        )


def _check_fields(path: str, spec: Any, prefix: str) -> None:
    """`spec`'s fields against their rules (syncer/common/typedcodec.py), as a ConfigError."""
    try:
        check_fields(spec, prefix)
    except SettingsError as exc:
        raise ConfigError(path, exc.key, exc.problem, exc.fix) from None


def _validate_hosts(inv: Inventory) -> None:
    seen: set[str] = set()
    for h in inv.hosts:
        if not _NAME.match(h.name):
            raise ConfigError(
                inv.path,
                "hosts.name",
                f"host name {h.name!r} is not a simple name",
                "use letters, digits, '-', '_' or '.'",
            )
        if h.name in seen:
            raise ConfigError(
                inv.path, "hosts.name", f"duplicate host name {h.name!r}", "give every [[hosts]] entry its own name"
            )
        seen.add(h.name)
        key = f"{'sites' if h.site else 'hosts'}.{h.name}"
        _check_fields(inv.path, h, key)
        if h.nproc > 1 and h.device.startswith("cuda:"):
            raise ConfigError(
                inv.path,
                f"{key}.device",
                f"{h.device!r} with nproc = {h.nproc} puts every rank on one GPU",
                'use device = "cuda": each rank of the island takes its own local GPU',
            )
        _validate_site(inv.path, h)
        if h.compression == "2bit" and inv.run.block % 4:
            msg = f"2bit packs four codes a byte, but [run] block = {inv.run.block}"
            raise ConfigError(inv.path, f"{key}.compression", msg, "set [run] block to a multiple of 4, e.g. 128")
        if h.island == "fsdp" and h.nproc * (h.nodes if h.site else 1) < 2:
            fix = 'set nproc >= 2 (or nodes >= 2 on a site), or island = "ddp"'
            msg = "fsdp shards the model across an island's ranks, and this one has 1 rank"
            raise ConfigError(inv.path, f"{key}.island", msg, fix)


def _validate_site(path: str, h: HostSpec) -> None:
    """A [[sites]] entry's scheduler keys (and none of them on a [[hosts]] machine)."""
    key = f"sites.{h.name}"
    if not h.site:
        for attr in ("partition", "account", "time", "sbatch_args", "gpus_per_node"):
            if getattr(h, attr):
                raise ConfigError(
                    path, f"hosts.{h.name}.{attr}", "is a scheduler key", "put the cluster under [[sites]]"
                )
        return
    try:
        slurmjobs.parse_time(h.time)
    except ValueError:
        raise ConfigError(
            path, f"{key}.time", f"{h.time!r} is not a Slurm time limit", 'write e.g. "12:00:00" or "2-00:00:00"'
        ) from None
    for arg in h.sbatch_args:
        option = arg.split("=", 1)[0]
        if option in SITE_SBATCH:
            raise ConfigError(
                path,
                f"{key}.sbatch_args",
                f"{arg!r} sets what a site key says",
                f"write {SITE_SBATCH[option]} = ... instead",
            )
        if not arg.startswith("-") or option in OWN_SBATCH:
            raise ConfigError(
                path,
                f"{key}.sbatch_args",
                f"{arg!r} is not an option dldctl can pass",
                f'dldctl sets {", ".join(OWN_SBATCH)} itself; write others as "--qos=high"',
            )


def _validate_alerts(inv: Inventory) -> None:
    """[alerts]: its own rules (dldctl/alertspec.py), then its command exists on this machine
    (the supervisor, which runs it, runs here)."""
    alertspec.validate(inv.alerts, inv.path)
    alertspec.check_command(inv.alerts, inv.path)


def _validate_ssh(inv: Inventory) -> None:
    _check_fields(inv.path, inv.ssh, "ssh")
    if inv.ssh.identity_file and any(not h.local for h in inv.hosts):
        path = Path(os.path.expanduser(inv.ssh.identity_file))
        if not path.is_file() or not os.access(path, os.R_OK):
            raise ConfigError(
                inv.path,
                "ssh.identity_file",
                f"cannot read {path}",
                "point identity_file at a readable private key, or leave it empty to use the SSH agent",
            )


def to_dict(inv: Inventory) -> dict[str, Any]:
    """The inventory as plain data (`parse` reads it back), kept in the run directory."""
    return {
        "run": to_mapping(inv.run),
        "ssh": to_mapping(inv.ssh),
        "syncer": to_mapping(inv.syncer),
        "hosts": [to_mapping(h) for h in inv.hosts],
        "metrics": to_mapping(inv.metrics),
        "alerts": to_mapping(inv.alerts),
        "model": dict(inv.model_args),
    }


def with_host_learners(inv: Inventory, name: str, learners: int) -> Inventory:
    """The same inventory with one host's learner count changed (for `learner add`)."""
    hosts = tuple(replace(h, learners=learners) if h.name == name else h for h in inv.hosts)
    return replace(inv, hosts=hosts)
