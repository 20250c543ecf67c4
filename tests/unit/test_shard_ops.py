"""The operator side of `[syncer] shards`, without processes: the inventory key and its errors,
the plan's ports and config.json (unchanged for one shard), the shard process names and chaos
targets, the shard's argv and log, every shard told a fleet-wide action, a remote syncer's shard
records mirrored home, a chaos verdict on a killed shard, and the `down` summary's shard words."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dldctl import inventory, rundir, shards, syncerctl
from dldctl.chaos import verdict
from dldctl.chaos.plan import Experiment, Fault
from dldctl.commands.run import shard_words
from dldctl.errors import ConfigError, SyncerError, UsageError
from dldctl.hostruntime import HostRuntime
from dldctl.hosts import LocalHost, ProcRef
from dldctl.inventory import HostSpec, Inventory, SSHSpec, SyncerSpec
from dldctl.lifecycle import plan
from dldctl.rundir import RunDir
from dldctl.runstate import HostRecord, Proc, ProcStatus, RunState
from dldctl.supervise import launch, mirror
from dldctl.supervise.supervisor import Supervisor
from syncer.common import strictjson
from syncer.common.resolved import ResolvedConfig, SyncerSection
from syncer.common.settings import RunSettings

HOSTS = '[[hosts]]\nname = "here"\naddress = "local"\nlearners = 2\n'


def load(tmp_path: Path, syncer: str, run: str = 'model = "gpt-tiny"\nfragments = 4\n') -> Inventory:
    path = tmp_path / "inv.toml"
    path.write_text(f'[run]\nname = "t"\n{run}\n[syncer]\n{syncer}\n{HOSTS}')
    return inventory.load(path)


# -- the inventory key ---------------------------------------------------------------------------
def test_shards_default_to_one_and_take_any_count_up_to_the_fragments(tmp_path: Path) -> None:
    assert load(tmp_path, "").syncer.shards == 1
    assert load(tmp_path, "shards = 4").syncer.shards == 4
    assert inventory.default_inventory().syncer.shards == 1


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("0", "must be >= 1, got 0"),
        ("-2", "must be >= 1, got -2"),
        ("5", "5 shards but [run] fragments = 4"),
        ('"2"', "shards"),
        ("2.5", "shards"),
    ],
)
def test_a_bad_shard_count_is_one_line_naming_the_file_and_the_key(tmp_path: Path, value: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, f"shards = {value}")
    line = caught.value.line()
    assert "\n" not in line and str(tmp_path / "inv.toml") in line and "syncer.shards" in line, line
    assert words in line


def test_too_many_shards_says_what_to_set(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"set shards <= 4, or raise \[run\] fragments"):
        load(tmp_path, "shards = 5")
    assert inventory.parse({"syncer": {"shards": 3}}, "x").syncer.shards == 3  # parsed; validated by `validate`


# -- the plan -------------------------------------------------------------------------------------
def _inv(count: int, **syncer: Any) -> Inventory:
    run = RunSettings(name="t", model="gpt-tiny", fragments=4)
    return Inventory(run, SSHSpec(), SyncerSpec(shards=count, **syncer), (HostSpec("here", "local", learners=2),))


def test_one_shard_writes_the_syncer_section_dldctl_always_wrote() -> None:
    section = plan.syncer_section(_inv(1), "127.0.0.1")
    keys = {"host", "bind_host", "port", "control_port", "advertise", "control_address", "dir"}
    assert set(section.to_json()) == keys and section.shards == 1 and section.shard_ports == ()
    assert section.port != section.control_port


def test_every_extra_shard_gets_two_free_ports_of_its_own() -> None:
    section = plan.syncer_section(_inv(3, port=5555, control_port=5556), "127.0.0.1")
    assert (section.port, section.control_port, section.shards) == (5555, 5556, 3)
    ports = [section.port, section.control_port, *section.shard_ports]
    assert len(section.shard_ports) == 4 and len(set(ports)) == 6
    assert section.addresses == (
        "tcp://127.0.0.1:5555",
        f"tcp://127.0.0.1:{section.shard_ports[0]}",
        f"tcp://127.0.0.1:{section.shard_ports[2]}",
    )
    assert section.shard(2).control == f"tcp://127.0.0.1:{section.shard_ports[3]}"
    data = ResolvedConfig("t-1", _inv(3).run, section).to_json()
    assert ResolvedConfig.from_json(json.loads(json.dumps(data))).syncer == section  # config.json round trip


def test_free_ports_never_repeats_one_nor_takes_a_taken_one(monkeypatch: pytest.MonkeyPatch) -> None:
    offered = iter([7, 7, 9, 8, 9, 10])
    monkeypatch.setattr(plan, "free_port", lambda host="127.0.0.1": next(offered))
    assert plan.free_ports(3, {9}) == (7, 8, 10)


def test_the_dry_run_names_the_shards() -> None:
    assert "2 shards (syncer, syncer-1), each its own process" in plan.describe(_inv(2))[1]
    assert "shards" not in plan.describe(_inv(1))[1]


# -- names and chaos targets ----------------------------------------------------------------------
def test_shard_process_names() -> None:
    assert shards.names(3) == ["syncer", "syncer-1", "syncer-2"] and shards.names(1) == ["syncer"]
    assert [shards.shard_of(n) for n in ("syncer", "syncer-0", "syncer-2", "syncer-02", "learner-1", "syncerx")] == [
        0,
        0,
        2,
        None,
        None,
        None,
    ]
    assert shards.local_dir(Path("/r"), 0) == Path("/r") and shards.local_dir(Path("/r"), 2) == Path("/r/shard-2")
    assert shards.remote_dir("~/run", 1) == "~/run/shard-1" and shards.remote_dir("~/run", 0) == "~/run"


@pytest.mark.parametrize(
    ("target", "count", "name"),
    [("syncer", 2, "syncer"), ("syncer-0", 2, "syncer"), ("syncer-1", 2, "syncer-1"), ("syncer-0", 1, "syncer")],
)
def test_chaos_targets_name_a_shard(target: str, count: int, name: str) -> None:
    assert shards.syncer_target(target, count) == name


def test_a_learner_is_no_syncer_target() -> None:
    assert shards.syncer_target("learner-3", 2) is None


@pytest.mark.parametrize("target", ["syncer-2", "syncer-9", "syncer-x", "syncer-01", "syncer-"])
def test_an_unknown_shard_is_one_line_naming_the_valid_targets(target: str) -> None:
    with pytest.raises(UsageError) as caught:
        shards.syncer_target(target, 2)
    line = caught.value.line()
    assert "\n" not in line and repr(target) in line and "it has 2 shards" in line
    assert "syncer targets: syncer (= syncer-0), syncer-1" in line and caught.value.exit_code == 2


def test_a_killed_shard_is_back_when_the_supervisor_restarts_it() -> None:
    exp = Experiment("e", 60.0, (Fault(5.0, "kill", "syncer-1"),))
    events = [
        {"t": 106.0, "kind": "syncer_death", "target": "syncer-1"},
        {"t": 108.0, "kind": "restart", "target": "syncer-1"},
    ]
    report = verdict.fault_report(exp, 0, 105.0, [{"now": 104.0, "goodput_window": 0.9}], events, 160.0)
    assert (report.detected_at, report.back_at, report.work_lost_tokens) == (106.0, 108.0, None)


# -- processes ------------------------------------------------------------------------------------
class _Recorder(LocalHost):
    """A host that records what it would start."""

    def __init__(self) -> None:
        super().__init__("local")
        self.started: list[tuple[list[str], str]] = []

    def start(self, argv: list[str], *, cwd: str, log: str, env: dict[str, str] | None = None) -> ProcRef:
        self.started.append((argv, log))
        return ProcRef(1, 2)


def test_a_shard_starts_with_its_shard_flag_and_its_own_log() -> None:
    runtime = HostRuntime("local", "py", "", "/run", "/run/config.json")
    host = _Recorder()
    launch.start_syncer(host, runtime)
    launch.start_syncer(host, runtime, "syncer-2")
    assert host.started == [
        (["py", "-m", "syncer", "--config", "/run/config.json"], "/run/logs/syncer.log"),
        (["py", "-m", "syncer", "--config", "/run/config.json", "--shard", "2"], "/run/logs/syncer-2.log"),
    ]
    with pytest.raises(ValueError, match="not a syncer process name"):
        launch.start_syncer(host, runtime, "learner-0")


def test_every_shard_is_told_and_one_that_does_not_answer_is_named(tmp_path: Path) -> None:
    run = RunSettings(name="t", fragments=4, insecure=True)
    section = plan.syncer_section(_inv(2), "127.0.0.1")  # nothing listens on these ports
    told = syncerctl.tell_every_shard(ResolvedConfig("t-1", run, section), tmp_path, "ending", 0.2)
    assert sorted(told) == [0, 1] and all(isinstance(e, SyncerError) for e in told.values())
    said = told[1]
    assert said is not None and f":{section.shard_ports[1]} did not answer" in said.line()  # shard 1's own port


def test_a_remote_syncers_shard_records_are_mirrored_into_their_shard_dirs(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    (remote / "shard-1").mkdir(parents=True)
    (remote / "events.jsonl").write_text('{"a": 0}\n')
    (remote / "shard-1" / "events.jsonl").write_text('{"a": 1}\n{"a": 2}\n{"torn"')
    (remote / "shard-1" / "metrics.jsonl").write_text('{"m": 1}\n')
    home = RunDir(tmp_path / "run")
    home.path.mkdir()
    runtime = HostRuntime("h", "py", "", str(remote), str(remote / "config.json"))
    offsets = mirror.mirror(LocalHost("h"), runtime, home, {}, 2)
    assert offsets == {"events.jsonl": 9, "shard-1/events.jsonl": 18, "shard-1/metrics.jsonl": 9}
    assert (home.path / "shard-1" / "events.jsonl").read_text() == '{"a": 1}\n{"a": 2}\n'
    assert mirror.mirror(LocalHost("h"), runtime, home, offsets, 2) == offsets  # nothing new: nothing copied


def test_the_down_summary_says_each_shards_outer_steps() -> None:
    rows: list[dict[str, Any]] = [
        {"shard": 0, "outer_steps": 403, "state": "stopped"},
        {"shard": 1, "outer_steps": 380, "state": "dead"},
        {"shard": 2, "outer_steps": None, "state": "unreachable"},
    ]
    assert shard_words(rows) == (
        "0: 403 outer steps; 1: 380 outer steps (dead: its newest checkpoint); 2: ? outer steps (did not answer)"
    )


def test_a_section_of_one_shard_has_no_other() -> None:
    with pytest.raises(ValueError, match="syncer shard 1 does not exist"):
        SyncerSection(port=1, control_port=2).shard(1)


def test_the_supervisor_reads_a_shards_refusal_in_its_own_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    run = rundir.create("sup")
    (run.path / "inventory.json").write_text(strictjson.dumps(inventory.to_dict(_inv(2))))
    local = HostRuntime("local", "py", "", str(run.path), str(run.config))
    procs = {name: Proc("syncer", "local", ProcStatus.DEAD) for name in ("syncer", "syncer-1")}
    state = RunState("up", procs=procs).with_host("local", HostRecord(local))
    (run.path / "shard-1").mkdir()
    (run.path / "shard-1" / "syncer.refused").write_text("shard 1's history was lost\n")
    sup = Supervisor(run)
    assert sup._finished(state, "syncer-1") == "refused: shard 1's history was lost"
    assert sup._finished(state, "syncer") is None  # shard 0's marker would be in the run directory itself
    (run.path / "syncer.refused").write_text("shard 0's\n")
    assert sup._finished(state, "syncer") == "refused: shard 0's"
