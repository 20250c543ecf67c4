"""Run directories: names, and which run `--run NAME`, `up` (converge) and "the newest live run" find."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from dldctl import inventory, rundir
from dldctl.errors import RunError
from dldctl.hosts.local import read_stat
from dldctl.runstate import Daemon, RunState


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    return tmp_path


def make_run(name: str, *, live: bool, mtime: float) -> rundir.RunDir:
    """A run directory whose supervisor is this test process (live) or a pid that is not running."""
    run = rundir.create(name)
    me = read_stat(os.getpid())
    sup = Daemon(os.getpid(), me.start_ticks) if live else Daemon(2**22 + 17, 1)
    with run.locked():
        run.write_state(RunState(status="up", supervisor=sup))
    os.utime(run.state_file, (mtime, mtime))
    return run


def test_is_run_of_matches_the_name_and_a_stamp_only() -> None:
    assert rundir.is_run_of("exp-20261129-131500", "exp")
    assert rundir.is_run_of("exp-20261129-131500-2", "exp")
    assert not rundir.is_run_of("exp-2-20261129-131500", "exp")
    assert not rundir.is_run_of("exp-20261129", "exp")
    assert rundir.is_run_of("exp-2-20261129-131500", "exp-2")


def test_up_does_not_converge_into_a_run_whose_name_only_starts_alike(home: Path) -> None:
    other = make_run("exp-2", live=True, mtime=2000)
    assert rundir.find_live("exp") is None
    assert rundir.find_live("exp-2").path == other.path
    mine = make_run("exp", live=True, mtime=1000)
    assert rundir.find_live("exp").path == mine.path


def test_find_orphan_only_for_its_own_name(home: Path) -> None:
    orphan = make_run("exp-2", live=False, mtime=1000)
    assert rundir.find_orphan("exp") is None
    assert rundir.find_orphan("exp-2").path == orphan.path


def test_resolve_by_name_prefers_a_live_run_and_defaults_to_the_newest_live(home: Path) -> None:
    old_live = make_run("a", live=True, mtime=1000)
    dead = make_run("a", live=False, mtime=3000)
    newer = make_run("b", live=True, mtime=2000)
    assert rundir.resolve("a").path == old_live.path
    assert rundir.resolve(dead.name).path == dead.path
    assert rundir.resolve(str(dead.path)).path == dead.path
    assert rundir.resolve(None).path == newer.path
    with pytest.raises(RunError, match="no run named 'c'"):
        rundir.resolve("c")


def test_no_live_run_says_how_to_start_one(home: Path) -> None:
    make_run("a", live=False, mtime=1000)
    with pytest.raises(RunError) as info:
        rundir.resolve(None)
    assert "no live run" in info.value.line() and "dldctl up" in info.value.line()
    assert rundir.resolve(None, live_only=False).name.startswith("a-")


def test_the_inventory_round_trips_and_a_missing_or_bad_one_is_one_line(home: Path) -> None:
    run = rundir.create("a")
    with pytest.raises(RunError) as info:
        run.read_inventory()
    assert str(run.inventory_json) in info.value.line() and "no inventory" in info.value.line()
    inv = inventory.parse({"hosts": [{"name": "here", "address": "local", "learners": 2}]}, "inv.toml")
    run.write_inventory(inv)
    assert run.read_inventory() == replace(inv, path=str(run.inventory))
    for bad in ("{not json", "[1, 2]"):
        run.inventory_json.write_text(bad)
        with pytest.raises(RunError) as info:
            run.read_inventory()
        assert "\n" not in info.value.line() and str(run.inventory_json) in info.value.line()


def test_a_run_directory_has_no_path_it_does_not_name(home: Path) -> None:
    run = rundir.create("a")
    assert run.events == run.path / "events.jsonl" and run.final_model == run.path / "final_model.pt"
    with pytest.raises(AttributeError):
        _ = run.event_log  # type: ignore[attr-defined]  # a misspelled path is an error, not a file name
