"""Syncer shards on other hosts (`[syncer] shard_hosts`), without processes: the inventory key and
its errors, config.json's per-shard host and address (and an unchanged file without the key),
the dry run's words, where each shard's process is started, whose records are mirrored from
where, the checkpoints `down` gathers for shard 0 (between two real directories), and a shard's
row taking the CPU and memory it reports itself."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dldctl import inventory, rundir
from dldctl.errors import ConfigError, DldError
from dldctl.hostruntime import HostRuntime
from dldctl.hosts import Host, LocalHost
from dldctl.inventory import Inventory
from dldctl.lifecycle import plan, shardgather, up
from dldctl.observe import shardrows
from dldctl.runstate import HostRecord, Proc, ProcStatus, RunState
from dldctl.supervise import mirror
from syncer.common import jsonlread
from syncer.common.resolved import ResolvedConfig, ResolvedConfigError, SyncerSection
from syncer.config import load as load_syncer
from syncer.usage import own_usage

HOSTS = (
    '[[hosts]]\nname = "here"\naddress = "local"\nlearners = 2\n'
    '[[hosts]]\nname = "cpu-a"\naddress = "10.0.0.7"\nlearners = 0\n'
    '[[hosts]]\nname = "cpu-b"\naddress = "10.0.0.8"\nlearners = 1\n'
    '[[sites]]\nname = "hpc"\nscheduler = "slurm"\nlogin = "local"\n'
)


def load(tmp_path: Path, syncer: str) -> Inventory:
    path = tmp_path / "inv.toml"
    path.write_text(f'[run]\nname = "t"\nmodel = "gpt-tiny"\nfragments = 4\n\n[syncer]\n{syncer}\n{HOSTS}')
    return inventory.load(path)


# -- the inventory key ---------------------------------------------------------------------------
def test_shard_hosts_name_where_shards_1_on_run(tmp_path: Path) -> None:
    inv = load(tmp_path, 'shards = 3\nshard_hosts = ["cpu-a", "local"]')
    assert inv.syncer.shard_hosts == ("cpu-a", "local")
    assert load(tmp_path, "shards = 3").syncer.shard_hosts == ()


@pytest.mark.parametrize(
    ("syncer", "key", "words"),
    [
        ('shards = 3\nshard_hosts = ["cpu-a"]', "syncer.shard_hosts", "1 hosts for 2 shard(s) after the first"),
        ('shards = 2\nshard_hosts = ["cpu-c"]', "syncer.shard_hosts", "no host named 'cpu-c'"),
        ('shards = 2\nshard_hosts = ["hpc"]', "syncer.shard_hosts", "'hpc' is a scheduler site"),
        ('host = "hpc"', "syncer.host", "'hpc' is a scheduler site"),
        ('shards = 2\nshard_hosts = "cpu-a"', "syncer.shard_hosts", "shard_hosts"),
    ],
)
def test_a_bad_shard_host_is_one_line_naming_the_file_and_the_key(
    tmp_path: Path, syncer: str, key: str, words: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, syncer)
    line = caught.value.line()
    assert str(tmp_path / "inv.toml") in line and f"[{key}]" in line and words in line, line
    assert "\n" not in line


def test_an_unknown_shard_host_suggests_the_close_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, 'shards = 2\nshard_hosts = ["cpu-aa"]')
    assert caught.value.hint is not None and "cpu-a" in caught.value.hint


# -- config.json ---------------------------------------------------------------------------------
def test_each_shard_dials_its_own_hosts_address_and_the_file_round_trips(tmp_path: Path) -> None:
    inv = load(tmp_path, 'shards = 3\nshard_hosts = ["cpu-a", "local"]\nport = 5555\ncontrol_port = 5556')
    section = plan.syncer_section(inv, "192.168.1.2")
    assert section.bind_host == "0.0.0.0"  # a shard elsewhere: every shard listens beyond loopback
    assert section.hosts == ("local", "cpu-a", "local")
    assert section.shard(1).address == f"tcp://10.0.0.7:{section.shard_ports[0]}"
    assert section.shard(1).control == f"tcp://10.0.0.7:{section.shard_ports[1]}"  # the operator dials it there
    assert section.shard(2).address == f"tcp://192.168.1.2:{section.shard_ports[2]}"  # this machine's
    assert section.addresses[0] == "tcp://192.168.1.2:5555" and section.on_host("local") == (0, 2)
    data = ResolvedConfig("t-1", inv.run, section).to_json()
    assert list(data["syncer"]["shard_hosts"]) == ["cpu-a", "local"]
    assert ResolvedConfig.from_json(json.loads(json.dumps(data))).syncer == section


def test_shards_on_one_host_write_the_file_as_before(tmp_path: Path) -> None:
    section = plan.syncer_section(load(tmp_path, "shards = 2"), "127.0.0.1")
    assert "shard_hosts" not in section.to_json() and "shard_addresses" not in section.to_json()
    assert (
        section.hosts == ("local", "local") and section.shard(1).address == f"tcp://127.0.0.1:{section.shard_ports[0]}"
    )


def test_shard_0_on_another_host_leaves_a_local_shard_dialling_this_machine(tmp_path: Path) -> None:
    section = plan.syncer_section(load(tmp_path, 'host = "cpu-b"\nshards = 2\nshard_hosts = ["local"]'), "10.9.9.9")
    assert section.address.startswith("tcp://10.0.0.8:") and section.shard(1).address.startswith("tcp://10.9.9.9:")


def test_a_config_with_a_host_for_every_shard_but_no_address_is_refused(tmp_path: Path) -> None:
    inv = load(tmp_path, 'shards = 2\nshard_hosts = ["cpu-a"]')
    data = ResolvedConfig("t-1", inv.run, plan.syncer_section(inv, "127.0.0.1")).to_json()
    data["syncer"]["shard_addresses"] = []
    with pytest.raises(ResolvedConfigError, match=r"\[syncer.shard_addresses\] needs one address per entry"):
        ResolvedConfig.from_json(data)


def test_a_shard_takes_its_share_of_its_own_hosts_cores(tmp_path: Path) -> None:
    inv = load(tmp_path, 'shards = 3\nshard_hosts = ["cpu-a", "local"]')
    config = ResolvedConfig("t-1", inv.run, plan.syncer_section(inv, "127.0.0.1"))
    (tmp_path / "config.json").write_text(json.dumps(config.to_json()))
    assert [load_syncer(tmp_path / "config.json", s).neighbours for s in range(3)] == [2, 1, 2]


def test_the_dry_run_says_where_each_shard_runs(tmp_path: Path) -> None:
    line = plan.describe(load(tmp_path, 'shards = 3\nshard_hosts = ["cpu-a", "cpu-a"]'))[1]
    assert "3 shards (syncer, syncer-1 on cpu-a, syncer-2 on cpu-a)" in line


def test_each_shard_process_is_started_on_its_own_host(tmp_path: Path) -> None:
    inv = load(tmp_path, 'shards = 3\nshard_hosts = ["cpu-a", "local"]')
    config = ResolvedConfig("t-1", inv.run, plan.syncer_section(inv, "127.0.0.1"))
    run = rundir.RunDir(tmp_path / "run")
    state = up.initial_state(inv, run, config, {}, {})
    assert {n: state.procs[n].host for n in ("syncer", "syncer-1", "syncer-2")} == {
        "syncer": "local",
        "syncer-1": "cpu-a",
        "syncer-2": "local",
    }


def test_a_shard_whose_host_could_not_be_set_up_fails_up_naming_both(tmp_path: Path) -> None:
    inv = load(tmp_path, 'shards = 2\nshard_hosts = ["cpu-a"]')
    config = ResolvedConfig("t-1", inv.run, plan.syncer_section(inv, "127.0.0.1"))
    with pytest.raises(DldError) as caught:
        up._check_syncer_hosts(config, {"cpu-a": DldError("connection refused")})
    assert "syncer shard 1 (syncer-1) runs on host cpu-a" in caught.value.line()
    up._check_syncer_hosts(config, {"cpu-b": DldError("a learner host: not the syncer's")})


# -- records and checkpoints from the shards' hosts ------------------------------------------------
def _two_host_run(tmp_path: Path) -> tuple[rundir.RunDir, RunState, Path]:
    """A run here with shard 0 local and shard 1 on host "h0", whose run directory is another one."""
    run = rundir.RunDir(tmp_path / "run")
    run.path.mkdir()
    far = tmp_path / "h0run"
    (far / "shard-1" / "checkpoints").mkdir(parents=True)
    remote = HostRuntime("h0", "py", "", str(far), str(far / "config.json"))
    here = HostRuntime("local", "py", "", str(run.path), str(run.config))
    procs = {
        "syncer": Proc("syncer", "local", ProcStatus.RUNNING),
        "syncer-1": Proc("syncer", "h0", ProcStatus.RUNNING),
    }
    state = RunState("up", procs=procs).with_host("h0", HostRecord(remote))
    return run, state.with_host("local", HostRecord(here)), far


def test_only_the_shards_on_other_hosts_are_mirrored_from_them(tmp_path: Path) -> None:
    run, state, far = _two_host_run(tmp_path)
    (far / "shard-1" / "events.jsonl").write_text('{"kind": "syncer_start"}\n')
    (far / "events.jsonl").write_text('{"kind": "not shard 0: it runs here"}\n')
    [(name, runtime, which)] = mirror.remote_shards(state, run)
    assert (name, runtime.run_dir, which) == ("h0", str(far), (1,))
    offsets = mirror.mirror(LocalHost("h0"), runtime, run, {}, which)
    assert offsets == {"shard-1/events.jsonl": 25} and not (run.path / "events.jsonl").exists()


def test_a_hosts_entry_for_this_machine_has_nothing_to_mirror(tmp_path: Path) -> None:
    run, state, _ = _two_host_run(tmp_path)
    same = HostRuntime("h0", "py", "", str(run.path), str(run.config))
    assert mirror.remote_shards(state.with_host("h0", HostRecord(same)), run) == []


def test_newest_checkpoint_by_name() -> None:
    names = ["ckpt-0001-000000009-5.pt", "ckpt-0002-000000004-7.pt", "ckpt-0002-000000004-7.pt.tmp", "x.pt"]
    assert shardgather.newest(names) == "ckpt-0002-000000004-7.pt"
    assert shardgather.newest(["syncer.refused"]) is None


def test_down_gathers_the_newest_checkpoint_of_a_shard_elsewhere_into_shard_0s_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path / "home"))
    run, state, far = _two_host_run(tmp_path)
    for name in ("ckpt-0001-000000003-1.pt", "ckpt-0002-000000008-2.pt"):
        (far / "shard-1" / "checkpoints" / name).write_bytes(name.encode())
    inv = load(tmp_path, 'shards = 2\nshard_hosts = ["cpu-a"]')
    config = ResolvedConfig("t-1", inv.run, plan.syncer_section(inv, "127.0.0.1"))
    config = ResolvedConfig("t-1", inv.run, _renamed(config.syncer, "h0"))
    hosts: dict[str, Host] = {"h0": LocalHost("h0")}
    assert shardgather.to_gather(config) == [1]
    assert shardgather.gather(run, config, state, hosts.__getitem__) == {1: "ckpt-0002-000000008-2.pt"}
    copied = run.path / "shard-1" / "checkpoints" / "ckpt-0002-000000008-2.pt"
    assert copied.read_bytes() == b"ckpt-0002-000000008-2.pt" and len(list(copied.parent.iterdir())) == 1
    assert [e["kind"] for e in _events(run)] == ["shard_gathered"]


def test_a_shard_with_no_checkpoint_or_an_unreachable_host_is_an_event_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path / "home"))
    run, state, _ = _two_host_run(tmp_path)
    inv = load(tmp_path, 'shards = 2\nshard_hosts = ["cpu-a"]')
    config = ResolvedConfig("t-1", inv.run, _renamed(plan.syncer_section(inv, "127.0.0.1"), "h0"))
    assert shardgather.gather(run, config, state, lambda name: LocalHost(name)) == {}

    def unreachable(name: str) -> Host:
        raise DldError(f"host {name}: connection refused")

    assert shardgather.gather(run, config, state, unreachable) == {}
    details = [(e["kind"], e["target"], e["detail"]) for e in _events(run)]
    assert details[0] == ("shard_gather_failed", "syncer-1", "no checkpoint of it on h0")
    assert details[1][0] == "shard_gather_failed" and "connection refused" in details[1][2]


def _renamed(section: SyncerSection, host: str) -> SyncerSection:
    return replace(section, shard_hosts=(host,))


def _events(run: rundir.RunDir) -> list[dict[str, Any]]:
    return list(jsonlread.read(run.path / "events.jsonl"))


# -- status --------------------------------------------------------------------------------------
def test_a_shard_reports_its_own_cpu_and_memory() -> None:
    usage = own_usage()
    assert isinstance(usage["cpu_s"], float) and usage["cpu_s"] > 0
    assert isinstance(usage["rss_bytes"], int) and usage["rss_bytes"] > 1 << 20


def test_a_remote_shards_row_takes_the_cpu_and_memory_it_reports() -> None:
    proc = Proc("syncer", "h0", ProcStatus.RUNNING)
    answer = {"alive": True, "outer_steps": 5, "cpu_s": 12.5, "rss_bytes": 3 << 20, "pid": 77}
    row = shardrows.shard_row(1, answer, proc, shardrows.Seen(now=1.0))  # nothing readable here
    assert (row["cpu_s"], row["rss_bytes"], row["pid"]) == (12.5, 3 << 20, 77)
    gone = shardrows.shard_row(1, None, proc, shardrows.Seen(usage=(1.0, 2), now=1.0))
    assert gone["cpu_s"] is None and gone["rss_bytes"] is None
