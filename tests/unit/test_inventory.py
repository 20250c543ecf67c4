"""Inventory loading: typed tables, one-line errors naming file, key and fix; cross-field rules."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from dldctl import inventory
from dldctl.errors import ConfigError
from syncer.common.settings import RunSettings

ROOT = Path(__file__).resolve().parents[2]
GOOD = """
[run]
model = "gpt-tiny"
seq_len = 32
quorum = 2
[[hosts]]
name = "a"
address = "local"
learners = 2
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inv.toml"
    path.write_text(text)
    return path


def error(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        inventory.load(write(tmp_path, text))
    message = info.value.line()
    assert "\n" not in message and str(tmp_path / "inv.toml") in message
    assert info.value.exit_code == 2
    return info.value


def test_good_inventory_loads_typed(tmp_path: Path) -> None:
    inv = inventory.load(write(tmp_path, GOOD))
    assert inv.run.quorum == 2 and inv.hosts[0].learners == 2 and inv.total_learners == 2
    assert [lid for lid, _ in inv.learner_hosts()] == ["learner-0", "learner-1"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        inv.run.quorum = 3  # type: ignore[misc]


def test_unknown_key_suggests_the_right_one(tmp_path: Path) -> None:
    exc = error(tmp_path, GOOD.replace("quorum = 2", "quorom = 2"))
    assert exc.key == "run.quorom" and "did you mean 'quorum'" in exc.line()


def test_unknown_table_suggests(tmp_path: Path) -> None:
    exc = error(tmp_path, GOOD + "\n[sync]\nport = 1\n")
    assert "did you mean [syncer]" in exc.line()


def test_wrong_type_names_key_and_type(tmp_path: Path) -> None:
    exc = error(tmp_path, GOOD.replace("learners = 2", 'learners = "two"'))
    assert exc.key == "hosts.learners" and "must be int" in exc.line()
    # which [[hosts]] entry, and how to write it
    assert "host a: must be int" in exc.line() and "e.g. learners = 1" in exc.line()
    exc = error(tmp_path, GOOD.replace("quorum = 2", 'quorum = "2"'))
    assert exc.key == "run.quorum" and "write quorum as int, e.g. quorum = 1" in exc.line()


@pytest.mark.parametrize("name", ["a/b", "..", "", "-x", "x y"])
def test_run_name_must_be_a_simple_directory_name(tmp_path: Path, name: str) -> None:
    exc = error(tmp_path, GOOD.replace("[run]\n", f'[run]\nname = "{name}"\n'))
    assert exc.key == "run.name" and "names the run directory" in exc.line()


def test_missing_host_address(tmp_path: Path) -> None:
    exc = error(tmp_path, GOOD.replace('address = "local"\n', ""))
    assert exc.key == "hosts.address" and "host a has no address" in exc.line()


def test_quorum_larger_than_fleet(tmp_path: Path) -> None:
    exc = error(tmp_path, GOOD.replace("quorum = 2", "quorum = 5"))
    assert (
        exc.key == "run.quorum" and "larger than the fleet (2 learners)" in exc.line() and "quorum <= 2" in exc.line()
    )


def test_unreadable_identity_file(tmp_path: Path) -> None:
    key = tmp_path / "id_missing"
    text = GOOD + f'[[hosts]]\nname = "b"\naddress = "127.0.0.2"\n[ssh]\nidentity_file = "{key}"\n'
    exc = error(tmp_path, text)
    assert exc.key == "ssh.identity_file" and str(key) in exc.line()


def test_duplicate_host_names(tmp_path: Path) -> None:
    exc = error(tmp_path, GOOD + '[[hosts]]\nname = "a"\naddress = "local"\n')
    assert "duplicate host name 'a'" in exc.line()


def test_fragments_more_than_tensors(tmp_path: Path) -> None:
    exc = error(tmp_path, GOOD.replace("quorum = 2", "quorum = 2\nfragments = 64\nH = 128"))
    assert exc.key == "run.fragments" and "parameter tensors" in exc.line()


def test_H_must_be_a_multiple_of_fragments(tmp_path: Path) -> None:
    exc = error(tmp_path, GOOD.replace("quorum = 2", "quorum = 2\nH = 30\nfragments = 4"))
    assert exc.key == "run.H" and "multiple of fragments=4" in exc.line()


def test_bad_toml_syntax(tmp_path: Path) -> None:
    assert "not valid TOML" in error(tmp_path, "[run\nname=").line()


def test_unknown_model_and_device(tmp_path: Path) -> None:
    assert "did you mean 'gpt-tiny'" in error(tmp_path, GOOD.replace('"gpt-tiny"', '"gpt-tine"')).line()
    assert "is not a device" in error(tmp_path, GOOD.replace("learners = 2", 'learners = 2\ndevice = "tpu"')).line()


def test_no_hosts(tmp_path: Path) -> None:
    assert "no hosts" in error(tmp_path, "[run]\nname = 'x'\n").line()


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        inventory.load(tmp_path / "nope.toml")


def test_builtin_default_is_the_same_dataclasses() -> None:
    inv = inventory.default_inventory()
    assert isinstance(inv.run, RunSettings) and inv.total_learners == 4
    assert len({h.throttle for h in inv.hosts}) >= 3  # learners of different speeds
    assert all(h.local for h in inv.hosts)


def test_round_trip_through_plain_data() -> None:
    inv = inventory.default_inventory()
    again = inventory.parse(inventory.to_dict(inv), "x")
    assert again.hosts == inv.hosts and again.run == inv.run


def test_example_loads_and_documents_every_key() -> None:
    path = ROOT / "inventory.example.toml"
    inv = inventory.load(path)
    assert inv.total_learners >= 1
    text = path.read_text()
    tables = {"run": RunSettings, "ssh": inventory.SSHSpec, "syncer": inventory.SyncerSpec, "hosts": inventory.HostSpec}
    for table, cls in tables.items():
        for f in dataclasses.fields(cls):
            line = re.search(rf"^{f.name}\s*=.*#", text, re.MULTILINE) or re.search(
                rf"^{f.name}\s*=", text, re.MULTILINE
            )
            assert line, f"inventory.example.toml does not document [{table}] {f.name}"


def _default(f: dataclasses.Field[object]) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def test_example_shows_the_defaults_it_says_it_shows() -> None:
    """The header: in [run], [ssh] and [syncer] the value shown is the default, but for `name`."""
    data = tomllib.loads((ROOT / "inventory.example.toml").read_text())
    tables = {"run": RunSettings, "ssh": inventory.SSHSpec, "syncer": inventory.SyncerSpec}
    named = {"name"}
    for table, cls in tables.items():
        defaults = {f.name: _default(f) for f in dataclasses.fields(cls)}
        shown = {k: tuple(v) if isinstance(v, list) else v for k, v in data[table].items()}  # TOML has no tuples
        wrong = {k: (v, defaults[k]) for k, v in shown.items() if k not in named and v != defaults[k]}
        assert not wrong, f"inventory.example.toml [{table}] shows values that are not the defaults: {wrong}"


@pytest.mark.parametrize(
    ("run", "expected"),
    [
        ("H = 16", (0.6, 0.8)),  # one outer Nesterov for every H (docs/tuning.md)
        ("H = 64", (0.6, 0.8)),
        ('lr_schedule = "constant"', (0.6, 0.8)),
        ("H = 64\nouter_lr = 1.0", (1.0, 0.8)),  # a key set is the user's; the other keeps its default
        ("H = 16\nouter_momentum = 0.0", (0.6, 0.0)),
    ],
)
def test_outer_optimizer_defaults_unless_set(tmp_path: Path, run: str, expected: tuple[float, float]) -> None:
    inv = inventory.load(write(tmp_path, GOOD.replace("[run]\n", f"[run]\n{run}\n")))
    assert (inv.run.outer_lr, inv.run.outer_momentum) == expected
    default = inventory.default_inventory().run
    assert default.H == 32 and (default.outer_lr, default.outer_momentum) == (0.6, 0.8)


def test_init_from_is_taken_from_the_inventory_files_directory(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    inv = inventory.load(write(tmp_path, GOOD.replace("[run]\n", '[run]\ninit_from = "models/final_model.pt"\n')))
    assert inv.run.init_from == str(tmp_path.absolute() / "models" / "final_model.pt")
    again = inventory.parse(inventory.to_dict(inv), str(tmp_path / "elsewhere" / "inventory.toml"))
    assert again.run.init_from == inv.run.init_from  # the run directory's copy names the same file
    absolute = inventory.load(write(tmp_path, GOOD.replace("[run]\n", '[run]\ninit_from = "/data/x.pt"\n')))
    assert absolute.run.init_from == "/data/x.pt"
    assert inventory.load(write(tmp_path, GOOD)).run.init_from == ""


@pytest.mark.parametrize(("value", "problem"), [('"  "', "is blank"), ("3", "must be str")])
def test_a_bad_init_from_names_the_key(tmp_path: Path, value: str, problem: str) -> None:
    exc = error(tmp_path, GOOD.replace("[run]\n", f"[run]\ninit_from = {value}\n"))
    assert exc.key == "run.init_from" and problem in exc.line()


SITE = '[[sites]]\nname = "cluster-a"\nscheduler = "slurm"\nlogin = "local"\n'


def test_island_is_ddp_unless_fsdp_is_asked_on_a_learner_with_ranks(tmp_path: Path) -> None:
    from dldctl.lifecycle import plan

    assert inventory.load(write(tmp_path, GOOD)).hosts[0].island == "ddp"
    assert inventory.default_inventory().hosts[0].island == "ddp"
    inv = inventory.load(write(tmp_path, GOOD.replace("learners = 2", 'learners = 2\nnproc = 2\nisland = "fsdp"')))
    assert inv.hosts[0].island == "fsdp" and inventory.parse(inventory.to_dict(inv), "x").hosts == inv.hosts
    entries = [p.entry for p in plan.learner_plans(inv)]
    assert [(e.nproc, e.island) for e in entries] == [(2, "fsdp"), (2, "fsdp")]
    assert "device cpu, nproc 2 (fsdp), batch" in plan.describe(inv)[2]
    site = inventory.load(write(tmp_path, GOOD + SITE + 'nodes = 2\nisland = "fsdp"\n'))  # 2 nodes x 1 rank
    assert site.hosts[1].island == "fsdp" and plan.learner_plans(site)[2].entry.island == "fsdp"


@pytest.mark.parametrize(
    ("text", "key", "words"),
    [
        (
            GOOD.replace("learners = 2", 'learners = 2\nisland = "zero"'),
            "hosts.a.island",
            "'zero' is not one of ddp, fsdp",
        ),
        (GOOD.replace("learners = 2", 'learners = 2\nnproc = 2\nisland = "FSDP"'), "hosts.a.island", "'FSDP' is not"),
        (GOOD.replace("learners = 2", 'learners = 2\nisland = "fsdp"'), "hosts.a.island", "this one has 1 rank"),
        # `nodes` is a site's: on a [[hosts]] machine it adds no ranks
        (GOOD.replace("learners = 2", 'learners = 2\nnodes = 4\nisland = "fsdp"'), "hosts.a.island", "1 rank"),
        (GOOD + SITE + 'island = "fsdp"\n', "sites.cluster-a.island", "set nproc >= 2 (or nodes >= 2 on a site)"),
        (GOOD + SITE + 'nproc = 4\nisland = "ring"\n', "sites.cluster-a.island", "'ring' is not one of ddp, fsdp"),
        (GOOD.replace("learners = 2", "learners = 2\nisland = 2"), "hosts.island", "host a: must be str"),
        # a thin link's codec for one host's pushes: a known one, and 2bit needs whole bytes of codes
        (
            GOOD.replace("learners = 2", 'learners = 2\ncompression = "int3"'),
            "hosts.a.compression",
            "'int3' is not one of \"\", int4",
        ),
        (
            GOOD.replace("learners = 2", 'learners = 2\ncompression = "2bit"').replace("[run]", "[run]\nblock = 10"),
            "hosts.a.compression",
            "set [run] block to a multiple of 4",
        ),
    ],
)
def test_a_bad_island_is_one_line_naming_the_key(tmp_path: Path, text: str, key: str, words: str) -> None:
    exc = error(tmp_path, text)
    assert exc.key == key and words in exc.line(), exc.line()


def test_link_thin_is_one_setting_for_a_thin_link_and_keys_beside_it_win(tmp_path: Path) -> None:
    thin = inventory.load(write(tmp_path, GOOD.replace("[run]", '[run]\nlink = "thin"'))).run
    assert (thin.link, thin.compression, thin.outer_lr, thin.outer_momentum) == ("thin", "topk", 1.0, 0.0)
    assert thin.risks(2) == [], "the preset is the measured recipe: nothing to warn about"
    mine = inventory.load(write(tmp_path, GOOD.replace("[run]", '[run]\nlink = "thin"\ncompression = "2bit"'))).run
    assert (mine.compression, mine.outer_lr) == ("2bit", 1.0)
    plain = inventory.load(write(tmp_path, GOOD)).run
    assert (plain.link, plain.compression, plain.outer_lr) == ("default", "int4", 0.6)
    # what the learners and the syncer read back is what the operator resolved, not expanded twice
    assert inventory.load(write(tmp_path, GOOD.replace("[run]", '[run]\nlink = "thin"\ncompression = "int4"'))).run == (
        dataclasses.replace(thin, compression="int4")
    )
    exc = error(tmp_path, GOOD.replace("[run]", '[run]\nlink = "slow"'))
    assert exc.key == "run.link" and "'slow' is not one of default, thin" in exc.line(), exc.line()
    # topk under the outer Nesterov step is accepted, and named as the measured risk it is
    topk = inventory.load(write(tmp_path, GOOD.replace("[run]", '[run]\ncompression = "topk"'))).run
    assert any('link = "thin"' in r and "+16.4%" in r for r in topk.risks(2))
