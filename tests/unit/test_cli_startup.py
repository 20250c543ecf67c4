"""A command imports what it uses: `dldctl status` (and the other commands an operator runs in a
loop or a script) starts without the simulator's numpy, the SSH hosts' paramiko or torch.

Each case runs the real console entry point in a fresh interpreter, in a home with no run, and
reads `sys.modules` when it exits; the command's own failure ("no run yet") is expected.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("numpy", "paramiko", "torch")  # 0.05-0.1 s each; typer itself brings pydantic
PROBE = """
import atexit, json, sys
atexit.register(lambda: print("MODULES " + json.dumps(sorted(m for m in {heavy!r} if m in sys.modules))))
sys.argv = ["dldctl", *{args!r}]
from dldctl.cli import main
main()
"""


def loaded(args: list[str], home: Path) -> list[str]:
    code = PROBE.format(heavy=HEAVY, args=args)
    env = {"DLDCTL_HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": "100"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("MODULES ")), None)
    assert line is not None, proc.stdout + proc.stderr
    return list(json.loads(line.removeprefix("MODULES ")))


@pytest.mark.parametrize(
    "args",
    [["status", "--json"], ["events"], ["runs", "--json"], ["logs", "syncer"], ["chaos", "kill", "learner-0"]],
)
def test_everyday_commands_start_without_the_heavy_libraries(args: list[str], tmp_path: Path) -> None:
    assert loaded(args, tmp_path) == []


def test_a_command_that_needs_a_library_still_gets_it(tmp_path: Path) -> None:
    # the simulator's numpy arrives with the command that uses it; `check` reaches SSH hosts
    assert "numpy" in loaded(["simulate", "goodput", "--help"], tmp_path)
    inventory = tmp_path / "inventory.toml"
    inventory.write_text(
        '[run]\nname = "s"\n[ssh]\nconnect_timeout = 2\n[[hosts]]\nname = "a"\naddress = "127.0.0.9"\nlearners = 1\n'
    )
    assert "paramiko" in loaded(["check", str(inventory), "--json"], tmp_path)
