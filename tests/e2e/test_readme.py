"""The README's commands, exactly as written.

The first command (set up, then `dldctl up` on the built-in default) runs in a real pseudo-
terminal, with every library it does not install refused at import (this suite's venv has the
dev extras: a supervisor that imported prometheus_client on every run crashed in a fresh
checkout while this test passed): the live view opens, the loss falls, Ctrl-C leaves the view but not the run, and
`dldctl down` then stops everything. The second command is what `.ci/run` runs (CI exercises
it); here we check that it is so, and that the README opens with exactly those two commands.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import time
import tomllib
from pathlib import Path

import pytest

from dldctl import extras
from dldctl.testing import DldctlHome

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(600)]
# the modules of each optional extra (dldctl/extras.py), and of the test tools the dev install adds
EXTRA_MODULES = {extra: [module] for module, extra in extras.EXTRAS.items()}
NOT_EXTRAS = {"dev": ["pytest", "hypothesis"], "bench": ["torchft"], "all": []}
REFUSER = """
import importlib.machinery, sys

class _NotInstalled(importlib.machinery.PathFinder):  # as if their packages were not on sys.path
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in {refused!r}:
            return None  # importlib.util.find_spec says None, `import` raises ModuleNotFoundError
        return super().find_spec(name, path, target)

sys.meta_path[:] = [_NotInstalled if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", text, re.S)
    return [b.strip() for b in blocks]


def test_readme_opens_with_the_two_commands_and_ci_runs_the_second() -> None:
    text = (ROOT / "README.md").read_text()
    first, second = readme_commands()[:2]
    assert text.index(first) < text.index(second) < text.index("## What is this")
    assert "dldctl up" in first and first.startswith("python3 -m venv .venv")
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"exec {second}" in ci, ".ci/run must run exactly the README's test command"
    assert os.access(ROOT / second, os.X_OK)
    script = (ROOT / second).read_text()
    assert "openssh-server" in script and "pytest" in script and "constraints.txt" in script


def not_installed_by(command: str) -> set[str]:
    """The modules of every extra in pyproject.toml that `command`'s `pip install .[...]` leaves out."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = set(re.search(r"\.\[([a-z,]+)\]", command).group(1).split(","))  # type: ignore[union-attr]
    unknown = set(extras) - installed - set(EXTRA_MODULES) - set(NOT_EXTRAS)
    assert not unknown, f"name the modules of the extras {sorted(unknown)} in EXTRA_MODULES"
    left_out = {e: m for e, m in {**EXTRA_MODULES, **NOT_EXTRAS}.items() if e not in installed}
    return {module for modules in left_out.values() for module in modules}


def test_the_refused_modules_are_the_extras_the_first_command_leaves_out() -> None:
    refused = not_installed_by(readme_commands()[0])
    assert {"prometheus_client", "wandb", "tensorboard", "pytest"} <= refused and "torch" not in refused


def read_until(fd: int, pattern: bytes, timeout: float, seen: bytearray) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return pattern in seen
            if not chunk:
                return pattern in seen
            seen.extend(chunk)
            if pattern in seen:
                return True
    return False


def test_first_command_shows_a_learning_run_and_ctrl_c_leaves_it_running(tmp_path: Path) -> None:
    first = readme_commands()[0]
    dl = DldctlHome(tmp_path / "home")
    site = tmp_path / "site"  # every process of the run starts with the refuser (PYTHONPATH)
    site.mkdir()
    (site / "sitecustomize.py").write_text(REFUSER.format(refused=sorted(not_installed_by(first))))
    pid, fd = pty.fork()
    if pid == 0:  # the child: a login-like shell in the repo, in a real terminal
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a terminal's shell has it, however this suite was started
        os.chdir(ROOT)
        env = dict(dl.env, TERM="xterm-256color", LINES="30", COLUMNS="100", PYTHONPATH=str(site))
        os.execvpe("bash", ["bash", "-c", first], env)
    seen = bytearray()
    try:
        # the live view's goodput panel (up's progress board also names learner-3, before the run's
        # state exists: it shows while the hosts are prepared and the native kernel is built)
        assert read_until(fd, b"goodput", 420, seen), seen[-3000:].decode(errors="replace")
        # merging, then learning: the loss falls well below where it was at the first merges (a run
        # that did not learn, or whose merges undid the learners' work, stays put)
        snap = dl.wait(
            lambda s: s["loss"]["train"] is not None and s["syncer"]["outer_steps"] >= 2,
            240,
            "the default run merging",
        )
        first_loss = snap["loss"]["train"]
        dl.wait(
            lambda s: s["loss"]["train"] is not None and s["loss"]["train"] < first_loss - 0.5,
            240,
            "the loss falling",
        )
        os.write(fd, b"\x03")  # Ctrl-C in the terminal
        assert read_until(fd, b"keeps running", 60, seen), seen[-3000:].decode(errors="replace")
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 0
        assert dl.status()["syncer"]["alive"], "Ctrl-C must leave the view, not the run"
        summary = json.loads(dl("down", "--json").stdout)
        assert summary["outer_steps"] > 0 and dl.leftovers() == []
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
        dl.close()
