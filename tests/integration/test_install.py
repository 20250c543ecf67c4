"""The released package: its wheel built from the tree, installed without extras in a fresh venv.

The wheel is built by the real build backend (`pip wheel`, from a copy of the tree so nothing is
written into the checkout) and must carry what the help sends users to. Installed with no extras
into a new virtualenv (no system site-packages), it must bring no torch and no matplotlib, and the
operator's commands must work there. The dependencies come from a wheelhouse that pip fills once
from the package index and that is kept, keyed by the wheel's requirements and constraints.txt,
under `$DLDCTL_TEST_CACHE` (default `~/.cache/dldctl-tests`), so a second run needs no network.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "inventory.example.toml", "docs", "dldctl", "learner", "syncer", "workload")
DOCS = "dldctl-0.1.0.data/data/share/doc/dldctl"  # the data files: <prefix>/share/doc/dldctl once installed
CITED = (  # `chaos example`; the syncer's kernel; the pages the help and the README send users to
    "dldctl/examples/chaos-experiment.toml",
    "syncer/native/fused.c",
    f"{DOCS}/simulate.md",
    f"{DOCS}/operations.md",
    f"{DOCS}/inventory.example.toml",
)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def pip(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"pip {' '.join(args)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


def _no_isolation() -> list[str]:
    """`--no-build-isolation` when this Python has the backend pyproject.toml asks for (saves a
    fresh build environment, seconds); else pip builds in an isolated one, as a user's pip does."""
    try:
        setuptools = int(importlib.metadata.version("setuptools").split(".")[0])
        importlib.metadata.version("wheel")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-build-isolation"] if setuptools >= 77 else []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=junk)
        else:
            shutil.copy2(path, src / name)
    pip("wheel", "-q", "--no-deps", *_no_isolation(), str(src), "-w", str(out))
    (built,) = out.glob("dldctl-*.whl")
    return built


def requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def test_the_wheel_carries_what_the_help_cites_and_asks_for_no_torch(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert set(CITED) <= names, sorted(n for n in names if not n.endswith(".py"))
    base = [r for r in requires(wheel) if "extra ==" not in r]
    assert not [r for r in base if r.startswith(("torch", "matplotlib"))], base
    assert 'torch<3,>=2.1; extra == "train"' in requires(wheel)  # a range: a CUDA torch is kept
    assert any(r.startswith("matplotlib") and 'extra == "plot"' in r for r in requires(wheel))


def wheelhouse(wheel: Path) -> Path:
    """The base dependencies' wheels (no dldctl, no extras), downloaded once and kept."""
    constraints = (ROOT / "constraints.txt").read_bytes()
    base = sorted(r for r in requires(wheel) if "extra ==" not in r)
    key = hashlib.sha256("\n".join(base).encode() + constraints).hexdigest()[:16]
    cache = Path(os.environ.get("DLDCTL_TEST_CACHE") or Path.home() / ".cache" / "dldctl-tests")
    house = cache / f"wheelhouse-{key}"
    if not house.is_dir():
        tmp = cache / f".wheelhouse-{key}-{os.getpid()}"
        pip("download", "-q", "-d", str(tmp), "-c", str(ROOT / "constraints.txt"), str(wheel))
        for own in tmp.glob("dldctl-*"):
            own.unlink()
        try:
            tmp.rename(house)
        except OSError:  # another run filled it first: use that one
            shutil.rmtree(tmp)
            assert house.is_dir()
    return house


def test_a_fresh_venv_without_extras_runs_the_operator_and_has_no_torch(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip(
        "--python",
        python,
        "install",
        "-q",
        "--no-compile",
        "--no-index",
        "--find-links",
        str(wheelhouse(wheel)),
        str(wheel),
    )
    probe = "import importlib.util as u; print([m for m in ('torch', 'matplotlib') if u.find_spec(m)])"
    assert subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    env = dict(os.environ, DLDCTL_HOME=str(tmp_path / "home"), COLUMNS="200")
    env.pop("PYTHONPATH", None)

    def dl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(venv / "bin" / "dldctl"), *args], env=env, capture_output=True, text=True, timeout=120
        )

    assert dl("--version").stdout.strip() == "dldctl 0.1.0"
    dry = dl("up", "--dry-run")
    assert dry.returncode == 0 and "(dry run: nothing was touched)" in dry.stdout, dry.stderr
    example = dl("chaos", "example")  # the package data, read from the installed package
    assert example.returncode == 0 and "[experiment]" in example.stdout, example.stderr
    up = dl("up", "-d")
    assert up.returncode == 2 and "pip install 'dldctl[train]'" in up.stderr, up.stderr
    cited = venv / "share" / "doc" / "dldctl" / "simulate.md"  # the help names the installed page
    assert cited.is_file() and str(cited) in dl("simulate", "bandwidth", "--help").stdout.replace("\n", "")


def test_the_train_extra_keeps_the_torch_already_installed(wheel: Path) -> None:
    """The README's CUDA recipe: a torch installed first (here this venv's 2.13.0+cpu, as a user's
    2.x+cu124 would be) satisfies `dldctl[train]`, so pip would install dldctl alone over it."""
    dry = pip("install", "--dry-run", "--no-index", f"{wheel}[train,plot]")
    would = [line for line in dry.stdout.splitlines() if line.startswith("Would install")]
    assert would and "torch" not in would[0] and "dldctl-0.1.0" in would[0], dry.stdout[-2000:]
    assert "Requirement already satisfied: torch<3,>=2.1" in dry.stdout
