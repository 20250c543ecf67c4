"""The resolved run configuration (`config.json`) as typed, frozen records: the one schema that
`dldctl up` writes and every process of the run reads (a leaf: stdlib and the shared settings).

    ResolvedConfig  the whole file: run id, the run settings, the syncer's section, the learners, keys
    SyncerSection   where the syncer binds, its two ports, the addresses learners and the operator dial
    LearnerEntry    one learner of the fleet: id, host, device, batch size, ranks (and how they
                    hold the model: island "ddp" or "fsdp"), threads, env, shard
    KeysSection     where the CURVE keys lie

On disk (keys as dldctl has always written them; "version" is the schema version):

    { "version": 1, "run_id": str, "run": {RunSettings},
      "syncer": {"host", "bind_host", "port", "control_port", "advertise", "control_address", "dir",
                 "shards", "shard_ports" (two per shard after the first),
                 "shard_hosts", "shard_addresses" (only where shards run on other hosts: the host
                 and the address learners and the operator dial, one each per shard after the first)},
      "learners": [{"id": "learner-0", "host", "device", "batch_size", "throttle", "nproc",
                    "island" (only if not "ddp"), "threads", "env", "shard", "shards"}, ...],
      "keys": {"dir": str}, "inventory": str, "init_model": str (only with [run] init_from),
      "model_args": {...} (only with an inventory's [model] table: free-form, handed to the factory),
      "model_dir": str (only for an `hf:` model: the run's copy of its directory, without weights) }

Paths in the file are absolute or relative to the file's own directory (`resolve_path`), so the
same file works in the run directory of whichever host reads it. `load` and `save` are the one
reader and writer; `from_json` checks the schema version and every field (unknown keys too; by
their types and rules, syncer/common/typedcodec.py), so a file of another dldctl, or a damaged one,
is one line naming the file, the key and what to do. A key holding its default is left out where
older files had no such key (`omit_default`), so an older reader still reads what this one writes.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from syncer.common import strictjson
from syncer.common.atomic import atomic_write
from syncer.common.settings import HostCompression, RunSettings, SettingsError
from syncer.common.typedcodec import check_fields, checked, from_mapping, meta, to_mapping

SCHEMA_VERSION = 1
VERSION_KEY = "version"
FIX = "start a new run with `dldctl up`"
Island = Literal["ddp", "fsdp"]  # an island's ranks hold replicas (DDP) or shards (FSDP2) of the model
ISLANDS: tuple[str, ...] = typing.get_args(Island)


class ResolvedConfigError(ValueError):
    """A resolved configuration that cannot be used: one line naming the file and what to do."""


@dataclass(frozen=True, kw_only=True)
class SyncerSection:
    """Where the syncer listens and how the others reach it (`host`: an inventory host or "local")."""

    host: str = "local"
    bind_host: str = "127.0.0.1"
    port: int
    control_port: int
    advertise: str = "127.0.0.1"  # the address learners dial
    control_address: str = "127.0.0.1"  # the address the operator's control client dials
    dir: str = "."  # the run directory, relative to the configuration file
    # syncer processes, each owning a balanced subset of the fragments (syncer/wire/shards.py);
    # an unsharded syncer's file has none of the shard keys, one sharded on one host no shard_hosts
    shards: int = checked(1, omit_default=True)
    shard_ports: tuple[int, ...] = checked((), omit_default=True)  # shards 1..S-1: learner port, control port, ...
    shard_hosts: tuple[str, ...] = checked((), omit_default=True)  # shards 1..S-1: each one's host (empty: `host`)
    shard_addresses: tuple[str, ...] = checked((), omit_default=True)  # shards 1..S-1: what learners dial

    def shard(self, s: int) -> SyncerSection:
        """The section as shard `s` sees it: its own two ports (shard 0: `port`, `control_port`),
        and its own host and address where it runs on another host than shard 0."""
        if not 0 <= s < self.shards:
            raise ValueError(f"syncer shard {s} does not exist: the run has {self.shards} (0..{self.shards - 1})")
        if s == 0:
            return self
        out = replace(self, port=self.shard_ports[2 * s - 2], control_port=self.shard_ports[2 * s - 1])
        if self.shard_hosts:
            address = self.shard_addresses[s - 1]
            out = replace(out, host=self.shard_hosts[s - 1], advertise=address, control_address=address)
        return out

    def host_of(self, s: int) -> str:
        """The host shard `s` runs on: an inventory host or "local"."""
        return self.shard(s).host

    @property
    def hosts(self) -> tuple[str, ...]:
        """Every shard's host, shard 0 first."""
        return tuple(self.host_of(s) for s in range(self.shards))

    def on_host(self, host: str) -> tuple[int, ...]:
        """The shards that run on `host`."""
        return tuple(s for s in range(self.shards) if self.host_of(s) == host)

    def to_json(self) -> dict[str, Any]:
        """Its JSON; an unsharded syncer's as dldctl has always written it (no shard keys), and a
        sharded one on one host's without the per-shard hosts."""
        return to_mapping(self)

    @property
    def addresses(self) -> tuple[str, ...]:
        """What learners dial, one address per shard."""
        return tuple(self.shard(s).address for s in range(self.shards))

    @property
    def bind(self) -> str:
        return f"tcp://{self.bind_host}:{self.port}"

    @property
    def control_bind(self) -> str:
        return f"tcp://{self.bind_host}:{self.control_port}"

    @property
    def address(self) -> str:
        """What learners dial."""
        return f"tcp://{self.advertise}:{self.port}"

    @property
    def control(self) -> str:
        """What the operator's control client dials."""
        return f"tcp://{self.control_address or '127.0.0.1'}:{self.control_port}"


@dataclass(frozen=True)
class LearnerEntry:
    """One learner of the fleet, as the inventory declared it (0 batch_size: the run's)."""

    id: str
    host: str = "local"
    device: str = "cpu"
    batch_size: int = 0  # 0: the run's batch_size
    throttle: float = 1.0  # >1: artificially this many times slower (demos, tests)
    nproc: int = 1  # ranks in this learner's torchrun island
    # how its ranks hold the model: "ddp" replicas or "fsdp" shards (FSDP2); a DDP fleet's file has
    # no island key, as dldctl has always written it (and an older reader still reads it)
    island: Island = checked("ddp", omit_default=True)  # noqa: RUF009 (a field(), not a shared default)
    threads: int = 1  # torch intra-op threads per rank
    compression: HostCompression = checked("", omit_default=True)  # noqa: RUF009 (a field()): "" = the run's
    env: dict[str, str] = field(default_factory=dict)
    shard: int = 0
    shards: int = 1


@dataclass(frozen=True)
class KeysSection:
    """The directory of the run's CURVE key files (relative to the configuration file)."""

    dir: str = "keys"


@dataclass(frozen=True)
class ResolvedConfig:
    """The whole file. Frozen: a change (`with_learners`) is a new record that `save` writes."""

    run_id: str
    run: RunSettings
    syncer: SyncerSection
    learners: tuple[LearnerEntry, ...] = ()
    keys: KeysSection = KeysSection()
    inventory: str | None = checked(None, omit_default=True)  # where the inventory came from (shown to people)
    # the run's copy of [run] init_from, relative to the file (None: from the seed)
    init_model: str | None = checked(None, omit_default=True)
    # the inventory's [model] table, for the factory
    model_args: dict[str, Any] = field(default_factory=dict, metadata=meta(omit_default=True))
    # an `hf:` model's directory (config, tokenizer), the run's copy, relative
    model_dir: str | None = checked(None, omit_default=True)

    @property
    def learner_ids(self) -> tuple[str, ...]:
        return tuple(e.id for e in self.learners)

    def learner(self, learner_id: str) -> LearnerEntry:
        """The entry of `learner_id`; SettingsError (naming the known ones) if there is none."""
        for entry in self.learners:
            if entry.id == learner_id:
                return entry
        known = ", ".join(self.learner_ids) or "none"
        raise SettingsError("learners", f"no learner {learner_id!r} in this configuration (known: {known})")

    def learners_on(self, host: str) -> list[LearnerEntry]:
        return [e for e in self.learners if e.host == host]

    def with_learners(self, *entries: LearnerEntry) -> ResolvedConfig:
        """This configuration with `entries` appended to the fleet."""
        return replace(self, learners=(*self.learners, *entries))

    def keys_dir(self, base: Path) -> Path | None:
        """The keys directory as seen from `base` (the file's directory); None for an insecure run."""
        return None if self.run.insecure else resolve_path(base, self.keys.dir)

    def run_dir(self, base: Path) -> Path:
        """The run directory as seen from `base` (the file's directory)."""
        return resolve_path(base, self.syncer.dir)

    def init_model_path(self, base: Path) -> Path | None:
        """The model file a new run starts from, as seen from `base`; None: from the seed."""
        return None if self.init_model is None else resolve_path(base, self.init_model)

    def model_dir_path(self, base: Path) -> Path | None:
        """The run's copy of an `hf:` model's directory as seen from `base`; None: not an `hf:` model."""
        return None if self.model_dir is None else resolve_path(base, self.model_dir)

    # -- JSON --------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, data: Any, where: object = "config.json") -> ResolvedConfig:
        """The typed configuration; ResolvedConfigError (one line naming `where`) for another
        schema version or a missing, unknown or mistyped key. Does no I/O."""
        if not isinstance(data, dict):
            raise ResolvedConfigError(f"{where}: not a resolved configuration (not a JSON object); {FIX}")
        if VERSION_KEY not in data:
            raise ResolvedConfigError(
                f"{where}: no schema version (key {VERSION_KEY!r}): not a configuration `dldctl up` wrote; {FIX}"
            )
        version = data[VERSION_KEY]
        if version != SCHEMA_VERSION or isinstance(version, bool):
            raise ResolvedConfigError(
                f"{where}: schema version {version!r}, this dldctl reads version {SCHEMA_VERSION}; {FIX}"
            )
        try:
            config = from_mapping(cls, {k: v for k, v in data.items() if k != VERSION_KEY})
            _check(config)
        except SettingsError as exc:
            raise ResolvedConfigError(f"{where}: malformed configuration: {exc}; {FIX}") from None
        return config

    def to_json(self) -> dict[str, Any]:
        """The file's JSON, keys as dldctl has always written them."""
        return {VERSION_KEY: SCHEMA_VERSION, **to_mapping(self)}


def _check(config: ResolvedConfig) -> None:
    """Each field's rule, then those that relate two: the run's own (checked like an inventory's
    `[run]` table, its keys named `run.KEY`), the syncer's shards, the learners' ids."""
    try:
        config.run.validate()
    except SettingsError as exc:
        raise SettingsError(f"run.{exc.key}" if exc.key else "run", exc.problem, exc.fix) from None
    check_fields(config)
    _check_shards(config.syncer, config.run.fragments)
    seen: set[str] = set()
    for i, entry in enumerate(config.learners):
        if entry.id in seen:
            raise SettingsError(f"learners[{i}].id", f"duplicate learner id {entry.id!r}")
        seen.add(entry.id)


def shard_subdir(shard: int) -> str:
    """Where syncer shard `shard` keeps its checkpoints, metrics, events and epoch, relative to the
    run directory: "" for shard 0 (an unsharded run's layout), `shard-N` for the others."""
    return "" if shard == 0 else f"shard-{shard}"


def _check_shards(section: SyncerSection, fragments: int) -> None:
    """The syncer's shards against the ports, the hosts and the run's fragments."""
    if not 1 <= section.shards <= fragments:
        raise SettingsError("syncer.shards", f"must be between 1 and fragments = {fragments}, got {section.shards}")
    if len(section.shard_ports) != 2 * (section.shards - 1):
        raise SettingsError(
            "syncer.shard_ports", f"needs two ports per shard after the first: {2 * (section.shards - 1)}"
        )
    for key in ("shard_hosts", "shard_addresses"):
        if len(getattr(section, key)) not in (0, section.shards - 1):
            raise SettingsError(f"syncer.{key}", f"needs one entry per shard after the first: {section.shards - 1}")
    if len(section.shard_hosts) != len(section.shard_addresses):
        raise SettingsError("syncer.shard_addresses", "needs one address per entry of shard_hosts")


def resolve_path(base: Path, value: str) -> Path:
    """A path of the file: absolute, `~`-expanded, or relative to `base` (the file's directory)."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


# -- the one load and the one save --------------------------------------------------------------
def load(path: Path | str) -> ResolvedConfig:
    """Read and check a resolved configuration; ResolvedConfigError (a ValueError) names the file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ResolvedConfigError(f"{path}: cannot read the run's configuration ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResolvedConfigError(f"{path}: not valid JSON ({exc}); {FIX}") from None
    return ResolvedConfig.from_json(data, path)


def save(path: Path | str, config: ResolvedConfig) -> None:
    """Write `config` to `path` whole (atomic: a crash leaves the old file or the new one)."""
    atomic_write(path, strictjson.dumps(config.to_json(), indent=1))
