"""Shipping `[run] workdir` (dldctl/lifecycle/codeship.py): what is left out, the size limit, and
real shipments onto this machine's store through the same host script an SSH host runs: a second
shipment of the same tree sends nothing, a changed tree sends only what changed, every process's
import path puts the snapshot first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dldctl.errors import ConfigError
from dldctl.hostruntime import HostRuntime
from dldctl.hosts import LocalHost
from dldctl.lifecycle import codeship
from dldctl.runstate import HostRecord
from dldctl.supervise import launch
from syncer.common.resolved import LearnerEntry
from syncer.common.settings import RunSettings


def project(root: Path) -> Path:
    """A small project: a package, a script, a venv and caches that must not travel."""
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (root / "pkg" / "model.py").write_text("def factory(ctx):\n    return ctx\n")
    (root / "pkg" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0" * 10)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / ".venv" / "lib").mkdir(parents=True)
    (root / ".venv" / "lib" / "big.so").write_bytes(b"\1" * 1000)
    (root / "data").mkdir()
    (root / "data" / "corpus.txt").write_text("text " * 100)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    return root


def test_what_travels_and_what_does_not(tmp_path: Path) -> None:
    root = project(tmp_path / "proj")
    (root / codeship.IGNORE_FILE).write_text("# the data goes another way\ndata/\n*.log\n")
    (root / "train.log").write_text("x")
    paths = [e.path for e in codeship.walk(root)]
    assert paths == [codeship.IGNORE_FILE, "pkg/__init__.py", "pkg/model.py", "run.sh"]
    assert next(e for e in codeship.walk(root) if e.path == "run.sh").executable


def test_ignore_rules_are_pure() -> None:
    assert codeship.ignored("a/__pycache__", True, [])
    assert codeship.ignored("x.pyc", False, [])
    assert not codeship.ignored("venv.py", False, [])
    assert codeship.ignored("data", True, ["data/"]) and not codeship.ignored("data", False, ["data/"])
    assert codeship.ignored("deep/x.ckpt", False, ["*.ckpt"])  # a bare glob matches the name anywhere
    assert not codeship.ignored("deep/x.ckpt", False, ["top/*.ckpt"])


def test_a_tree_over_its_limit_is_refused_naming_the_largest_files(tmp_path: Path) -> None:
    root = project(tmp_path / "proj")
    (root / "weights.bin").write_bytes(b"\0" * (2 << 20))
    settings = RunSettings(workdir=str(root), workdir_max_mb=1.0)
    with pytest.raises(ConfigError, match=r"run\.workdir.*over workdir_max_mb = 1.*weights\.bin \(2\.0 MB\)"):
        codeship.scan(settings, "inv.toml")
    assert codeship.scan(RunSettings(workdir=str(root)), "inv.toml") is not None
    assert codeship.scan(RunSettings(), "inv.toml") is None


def test_digest_follows_content_not_time(tmp_path: Path) -> None:
    root = project(tmp_path / "proj")
    first = codeship.scan(RunSettings(workdir=str(root)), "i")
    (root / "pkg" / "model.py").touch()
    same = codeship.scan(RunSettings(workdir=str(root)), "i")
    (root / "pkg" / "model.py").write_text("def factory(ctx):\n    return None\n")
    changed = codeship.scan(RunSettings(workdir=str(root)), "i")
    assert first and same and changed
    assert first.digest == same.digest != changed.digest


def test_ship_twice_then_a_change(tmp_path: Path) -> None:
    root = project(tmp_path / "proj")
    base = tmp_path / "store"
    host = LocalHost("here")
    tree = codeship.scan(RunSettings(workdir=str(root)), "i")
    assert tree is not None
    first = codeship.ship(host, sys.executable, str(base), tree)
    assert first.files_sent == 4 and Path(first.path).name == tree.digest
    snap = Path(first.path)
    assert (snap / "pkg" / "model.py").read_text() == (root / "pkg" / "model.py").read_text()
    assert not (snap / ".git").exists() and not (snap / ".venv").exists()
    assert (snap / "run.sh").stat().st_mode & 0o111
    again = codeship.ship(host, sys.executable, str(base), tree)
    assert (again.path, again.files_sent, again.bytes_sent) == (first.path, 0, 0)
    (root / "pkg" / "extra.py").write_text("EXTRA = 2\n")
    changed = codeship.scan(RunSettings(workdir=str(root)), "i")
    assert changed is not None
    third = codeship.ship(host, sys.executable, str(base), changed)
    assert third.files_sent == 1 and third.path != first.path
    assert Path(first.path, "pkg", "model.py").is_file()  # the old snapshot stays whole for a live run
    out = subprocess.run(
        [sys.executable, "-c", "import pkg.extra, pkg; print(pkg.extra.EXTRA + pkg.VALUE)"],
        env={"PYTHONPATH": third.path},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "3"


def test_a_blob_that_arrives_damaged_is_refused(tmp_path: Path) -> None:
    root = project(tmp_path / "proj")
    tree = codeship.scan(RunSettings(workdir=str(root)), "i")
    assert tree is not None
    wrong = codeship.Tree(tree.root, tuple(codeship.Entry(e.path, "0" * 64, e.size, False) for e in tree.files[:1]))
    with pytest.raises(Exception, match="arrived damaged"):
        codeship.ship(LocalHost("here"), sys.executable, str(tmp_path / "store"), wrong)
    assert not list((tmp_path / "store" / "code").glob(wrong.digest + "*"))
    assert not list((tmp_path / "store" / "code").glob("incoming-*"))


def test_every_process_imports_the_snapshot_first() -> None:
    runtime = HostRuntime("h", "py", "/site/abc", "/run", "/run/config.json", code="/store/code/d1")
    entry = LearnerEntry("learner-0", env={"PYTHONPATH": "/mine"})
    assert launch.learner_env(runtime, entry, 0)["PYTHONPATH"] == "/store/code/d1:/mine:/site/abc"
    assert launch.syncer_env(runtime)["PYTHONPATH"] == "/store/code/d1:/site/abc"
    bare = HostRuntime("h", "py", "", "/run", "/run/config.json")
    assert "PYTHONPATH" not in launch.syncer_env(bare)
    written = {k: v for k, v in runtime.to_dict().items() if k != "code"}
    old = HostRecord.from_json({"runtime": written}, "state.hosts").runtime
    assert old.code == ""  # a state written by an older dldctl still reads
