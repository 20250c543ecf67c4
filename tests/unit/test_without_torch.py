"""The operator's commands on a Python without torch and matplotlib (`pip install dldctl`, no extras).

Each command runs as the real console script in a subprocess whose `sitecustomize` puts a finder
first on `sys.meta_path` that refuses `torch` and `matplotlib` (as a Python without them does:
ModuleNotFoundError). What needs neither runs; what needs one fails before it touches anything,
with one line naming the extra that installs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dldctl import docpath, extras, inventory
from dldctl.lifecycle import kernel

DLDCTL = str(Path(sys.executable).parent / "dldctl")
BLOCKER = """
import importlib.abc, sys

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
"""
REMOTE_ONLY = """
[run]
name = "remote-only"
model = "gpt-tiny"

[syncer]
host = "h0"

[[hosts]]
name = "h0"
address = "127.0.0.1"
port = 1
learners = 2
"""


@pytest.fixture
def no_torch(tmp_path: Path) -> dict[str, str]:
    """The environment of a Python that has neither torch nor matplotlib, in a fresh DLDCTL_HOME."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    return dict(os.environ, PYTHONPATH=str(site), DLDCTL_HOME=str(tmp_path / "home"), COLUMNS="200")


def dl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DLDCTL, *args], env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["up", "--dry-run"],
        ["runs"],
        ["chaos", "example"],
        ["simulate", "bandwidth", "--params", "12B", "--step-time", "1s"],
    ],
)
def test_what_needs_no_torch_runs_without_it(no_torch: dict[str, str], args: list[str]) -> None:
    proc = dl(no_torch, *args)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def test_status_and_down_without_a_run_say_so_not_a_traceback(no_torch: dict[str, str]) -> None:
    for args in (["status", "--once"], ["down"]):
        proc = dl(no_torch, *args)
        assert proc.returncode != 0 and proc.stderr.startswith("error: "), (args, proc.stderr)
        assert "Traceback" not in proc.stderr and "torch" not in proc.stderr, (args, proc.stderr)


def test_up_of_the_local_default_refuses_before_touching_anything(no_torch: dict[str, str]) -> None:
    proc = dl(no_torch, "up", "-d")  # with torch this would start a run: the blocker works
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    assert "the syncer and the learners on local-fast" in line and "pip install 'dldctl[train]'" in line
    assert not (Path(no_torch["DLDCTL_HOME"]) / "runs").exists() or not any(
        (Path(no_torch["DLDCTL_HOME"]) / "runs").iterdir()
    )


def test_up_with_a_remote_syncer_and_remote_learners_needs_no_torch_here(
    no_torch: dict[str, str], tmp_path: Path
) -> None:
    inv = tmp_path / "inventory.toml"
    inv.write_text(REMOTE_ONLY)
    proc = dl(no_torch, "up", str(inv), "-d")  # gets as far as the host (nothing listens on port 1)
    assert proc.returncode == 1 and "connection refused by 127.0.0.1:1" in proc.stderr, proc.stderr
    assert "torch" not in proc.stderr


def test_plots_without_matplotlib_name_the_plot_extra(no_torch: dict[str, str], tmp_path: Path) -> None:
    proc = dl(no_torch, "report")
    assert proc.returncode == 2 and "pip install 'dldctl[plot]'" in proc.stderr, proc.stderr
    proc = dl(no_torch, "simulate", "goodput", "--sweep", "chips=1000,2000", "--plot", str(tmp_path / "s.png"))
    assert proc.returncode == 2 and "pip install 'dldctl[plot]'" in proc.stderr, proc.stderr


def test_what_needs_torch_here(tmp_path: Path) -> None:
    inv = tmp_path / "inventory.toml"
    inv.write_text(REMOTE_ONLY)
    assert extras.torch_users(inventory.load(inv)) == []
    assert extras.torch_users(inventory.default_inventory()) == [
        "the syncer",
        "the learners on local-fast, local-mid, local-slow",
    ]
    inv.write_text(REMOTE_ONLY.replace('host = "h0"', 'host = "local"'))
    assert extras.torch_users(inventory.load(inv)) == ["the syncer"]


def test_a_remote_syncer_builds_its_kernel_on_its_host_and_a_local_one_needs_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inv = tmp_path / "inventory.toml"
    inv.write_text(REMOTE_ONLY)
    remote = kernel.for_syncer(inventory.load(inv))  # builds nothing here
    assert remote.ok and remote.elsewhere == "h0" and "built on h0" in remote.line()
    monkeypatch.setattr(extras, "installed", lambda module: False)
    local = kernel.for_syncer(inventory.default_inventory())
    assert not local.runnable and "pip install 'dldctl[train]'" in local.line()


def test_the_help_names_the_installed_page_outside_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert docpath.doc("simulate.md") == "docs/simulate.md"  # this checkout
    installed = tmp_path / "share" / "doc" / "dldctl"
    installed.mkdir(parents=True)
    (installed / "simulate.md").write_text("# simulate\n")
    monkeypatch.setattr(docpath, "CHECKOUT", tmp_path / "site-packages")
    monkeypatch.setattr(docpath, "installed_dirs", lambda: [tmp_path / "nowhere", installed])
    assert docpath.doc("simulate.md") == str(installed / "simulate.md")
    assert docpath.doc("missing.md") == "docs/missing.md"
