"""The typed resolved configuration (config.json): a round trip through the file (as `up` writes it
and as the syncer, a learner and the operator read it), a file of another schema version or with a
malformed entry is one line naming the file and the key, a file older dldctl wrote still reads,
and no module digs into the configuration by string keys."""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dldctl import inventory, rundir
from dldctl.errors import RunError
from dldctl.lifecycle import plan
from learner import config as learner_config
from syncer import config as syncer_config
from syncer.common import resolved
from syncer.common.resolved import (
    SCHEMA_VERSION,
    VERSION_KEY,
    KeysSection,
    LearnerEntry,
    ResolvedConfig,
    ResolvedConfigError,
    SyncerSection,
)
from syncer.common.settings import RunSettings

ROOT = Path(__file__).resolve().parents[2]

# what `dldctl up` wrote before the configuration was typed (the keys have not changed since)
OLDER = {
    "version": 1,
    "run_id": "exp-1a2b3c4d",
    "run": {"name": "exp", "H": 8, "fragments": 4, "quorum": 2},
    "syncer": {
        "host": "local",
        "bind_host": "127.0.0.1",
        "port": 5555,
        "control_port": 5556,
        "advertise": "127.0.0.1",
        "control_address": "127.0.0.1",
        "dir": ".",
    },
    "learners": [
        {
            "id": "learner-0",
            "host": "here",
            "device": "cpu",
            "batch_size": 0,
            "throttle": 1.0,
            "nproc": 1,
            "threads": 2,
            "env": {"A": "1"},
            "shard": 0,
            "shards": 2,
        },
        {"id": "learner-1", "host": "there", "throttle": 3, "shard": 1, "shards": 2},
    ],
    "keys": {"dir": "keys"},
    "inventory": "/tmp/inventory.toml",
}


def full_config() -> ResolvedConfig:
    return ResolvedConfig(
        run_id="exp-1234",
        run=RunSettings(name="exp", H=8, fragments=4, quorum=2, insecure=False),
        syncer=SyncerSection(host="h0", bind_host="0.0.0.0", port=7000, control_port=7001, advertise="10.0.0.2"),
        learners=(
            LearnerEntry("learner-0", host="h0", device="cuda:0", env={"X": "y"}, shard=0, shards=2),
            LearnerEntry("learner-1", host="h1", nproc=2, threads=4, batch_size=8, throttle=2.5, shard=1, shards=2),
        ),
        keys=KeysSection("keys"),
        inventory="inv.toml",
    )


def write_raw(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def test_round_trip_through_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    config = full_config()
    resolved.save(path, config)
    assert resolved.load(path) == config
    raw = json.loads(path.read_text())
    assert raw[VERSION_KEY] == SCHEMA_VERSION
    assert set(raw) == set(OLDER)  # the keys as dldctl has always written them
    assert set(raw["syncer"]) == set(OLDER["syncer"]) and set(raw["learners"][0]) == set(OLDER["learners"][0])


def test_an_fsdp_island_round_trips_and_a_ddp_one_writes_no_island_key(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    config = full_config()
    sharded = replace(config, learners=(config.learners[0], replace(config.learners[1], island="fsdp")))
    resolved.save(path, sharded)
    assert resolved.load(path) == sharded and resolved.load(path).learner("learner-1").island == "fsdp"
    raw = json.loads(path.read_text())["learners"]
    assert raw[1]["island"] == "fsdp" and "island" not in raw[0]  # absent: "ddp", as older files say
    assert resolved.load(write_raw(tmp_path, OLDER)).learner("learner-0").island == "ddp"


def test_up_writes_what_the_syncer_the_learners_and_the_operator_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    inv = inventory.default_inventory()
    run = rundir.create(inv.run.name)
    config = plan.write(inv, run)
    assert run.read_config() == config and config.learner_ids == tuple(p.id for p in plan.learner_plans(inv))
    syncer_view = syncer_config.load(run.config)
    assert syncer_view.run_id == config.run_id and syncer_view.learners == config.learner_ids
    assert syncer_view.bind == f"tcp://127.0.0.1:{config.syncer.port}" and syncer_view.keys_dir == run.keys
    learner_view = learner_config.load(run.config, "learner-1")
    assert learner_view.spec == config.learner("learner-1") and learner_view.settings == inv.run
    assert learner_view.syncer_address == config.syncer.address and learner_view.secret_key is not None
    grown, ids = plan.add_learners(run, config, inv.hosts[0], 2)
    assert ids == [f"learner-{len(config.learners)}", f"learner-{len(config.learners) + 1}"]
    assert run.read_config() == grown and grown.learners[: len(config.learners)] == config.learners


def test_a_hosts_own_codec_reaches_its_learners_pushes_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hosts.compression (a thin link's codec) is what that host's learners code their pushes in;
    the others, and everything else of the run, keep [run]'s."""
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    inv = inventory.default_inventory()
    inv = replace(inv, hosts=(replace(inv.hosts[0], compression="topk"), *inv.hosts[1:]))
    run = rundir.create(inv.run.name)
    config = plan.write(inv, run)
    assert (config.learner("learner-0").compression, config.learner("learner-2").compression) == ("topk", "")
    assert learner_config.load(run.config, "learner-0").settings == replace(inv.run, compression="topk")
    assert learner_config.load(run.config, "learner-2").settings == inv.run
    raw = json.loads(run.config.read_text())["learners"]
    assert raw[0]["compression"] == "topk" and "compression" not in raw[2], "the default is not written"


def test_a_file_older_dldctl_wrote_reads(tmp_path: Path) -> None:
    config = resolved.load(write_raw(tmp_path, OLDER))
    assert config.run.H == 8 and config.run.quorum == 2 and config.syncer.control == "tcp://127.0.0.1:5556"
    assert config.learner("learner-1").throttle == 3.0 and config.learner("learner-1").threads == 1
    assert config.keys_dir(tmp_path) == tmp_path / "keys" and config.run_dir(tmp_path) == tmp_path


@pytest.mark.parametrize("version", [0, SCHEMA_VERSION + 1, "1", True])
def test_another_version_is_one_line_naming_the_file(tmp_path: Path, version: object) -> None:
    path = write_raw(tmp_path, {**OLDER, VERSION_KEY: version})
    with pytest.raises(ResolvedConfigError) as err:
        resolved.load(path)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{path}: schema version {version!r}")
    assert f"reads version {SCHEMA_VERSION}" in line and "`dldctl up`" in line


def test_no_version_or_no_json_is_one_line(tmp_path: Path) -> None:
    no_version = {k: v for k, v in OLDER.items() if k != VERSION_KEY}
    for data, words in ((no_version, "no schema version"), ([1, 2], "not a JSON object")):
        with pytest.raises(ValueError, match=words) as err:
            resolved.load(write_raw(tmp_path, data))
        assert "\n" not in str(err.value)
    (tmp_path / "config.json").write_text("{ half")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolved.load(tmp_path / "config.json")
    with pytest.raises(ValueError, match="cannot read"):
        resolved.load(tmp_path / "missing.json")


def _set(section: str, key: str, value: Any, index: int | None = None) -> Any:
    def damage(d: dict[str, Any]) -> None:
        target = d[section] if index is None else d[section][index]
        target[key] = value

    return damage


@pytest.mark.parametrize(
    ("damage", "key"),
    [
        (_set("syncer", "port", "5555"), "[syncer.port]"),
        (_set("syncer", "bind", "0.0.0.0"), "[syncer.bind]"),
        (_set("learners", "nproc", "two", 1), "[learners[1].nproc]"),
        (_set("learners", "island", "zero", 1), "[learners[1].island]"),
        (_set("learners", "island", 2, 0), "[learners[0].island]"),
        (_set("learners", "devce", "cpu", 0), "[learners[0].devce]"),
        (_set("learners", "env", {"A": 1}, 0), "[learners[0].env]"),
        (_set("learners", "id", "learner-0", 1), "[learners[1].id]"),
        (_set("run", "fragmets", 4), "[run.fragmets]"),
        (_set("run", "H", 10), "[run.H]"),
        (_set("keys", "dir", 3), "[keys.dir]"),
        (lambda d: d.pop("run_id"), "[run_id]"),
        (lambda d: d.pop("syncer"), "[syncer]"),
        (lambda d: d.update(learners={"learner-0": {}}), "[learners]"),
        (lambda d: d.update(run_idd="x"), "[run_idd]"),
    ],
)
def test_a_malformed_entry_is_one_line_naming_the_file_and_the_key(tmp_path: Path, damage: Any, key: str) -> None:
    data = json.loads(json.dumps(OLDER))
    damage(data)
    path = write_raw(tmp_path, data)
    with pytest.raises(ResolvedConfigError) as err:
        resolved.load(path)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{path}: malformed configuration: {key} ") and "`dldctl up`" in line


def test_the_operator_sees_a_run_error_and_the_learner_a_value_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    run = rundir.create("old")
    run.config.write_text(json.dumps({**OLDER, VERSION_KEY: 0}))
    with pytest.raises(RunError) as err:
        run.read_config()
    assert "\n" not in err.value.line() and str(run.config) in err.value.line()
    assert run.log_cap() == RunSettings().max_log_bytes  # the default, never an exception
    resolved.save(run.config, resolved.load(write_raw(tmp_path, OLDER)))
    assert run.read_config().run_id == OLDER["run_id"]  # the file changed: read again
    with pytest.raises(ValueError, match=r"no learner 'learner-7' in this configuration \(known: learner-0, learner-1"):
        learner_config.load(run.config, "learner-7")


def test_helpers_return_new_configs() -> None:
    config = full_config()
    grown = config.with_learners(LearnerEntry("learner-2", host="h1"))
    assert grown.learner_ids == ("learner-0", "learner-1", "learner-2") and len(config.learners) == 2
    assert [e.id for e in grown.learners_on("h1")] == ["learner-1", "learner-2"]
    assert replace(config, run=replace(config.run, insecure=True)).keys_dir(Path("/r")) is None
    assert config.keys_dir(Path("/r")) == Path("/r/keys") and config.syncer.address == "tcp://10.0.0.2:7000"


# -- nobody digs into the configuration by string keys --------------------------------------------
CONFIG_NAMES = {"config", "cfg", "conf", "resolved_config"}
SCANNED = ("dldctl", "syncer", "learner", "bench")
OTHER_CONFIGS = {"dldctl/hosts/sshconfig.py"}  # its `config` is an ~/.ssh/config lookup, not config.json


def _string_key_digs(tree: ast.AST) -> list[int]:
    """Lines that index a name called config/cfg/conf by a string (`config["run"]`), call
    `.get("...")` on one, or index a `.config()` call's result by a string."""
    return [node.lineno for node in ast.walk(tree) if _subscript_dig(node) or _get_dig(node)]


def _subscript_dig(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
        and _is_config(node.value)
    )


def _get_dig(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and _is_config(node.func.value)
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
    )


def _is_config(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in CONFIG_NAMES
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "config"


def test_no_module_digs_into_the_configuration_by_string_keys() -> None:
    found = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in OTHER_CONFIGS:
                continue
            found += [f"{rel}:{line}" for line in _string_key_digs(ast.parse(path.read_text()))]
    assert found == [], f"string-key access to config.json (use syncer/common/resolved.py's attributes): {found}"


def test_the_scan_sees_a_dig() -> None:
    code = 'a = config["run"]\nb = cfg.get("syncer")\nc = fleet.config()["run"]\nd = other["run"]\ne = config.run'
    assert _string_key_digs(ast.parse(code)) == [1, 2, 3]
