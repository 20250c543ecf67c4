"""A run whose state file is corrupt: clear one-line errors, and `dldctl down` still stops every
process (found through procs.jsonl). The run is insecure on purpose, which status must shout."""

from __future__ import annotations

from pathlib import Path

import pytest

from dldctl.testing import DldctlHome
from tests.e2e.fleetutil import run_table

pytestmark = [pytest.mark.timeout(300)]

INVENTORY = (
    run_table("corrupt", insecure=True)
    + """
[[hosts]]
name = "here"
address = "local"
learners = 2
"""
)


def test_corrupt_state_file_and_insecure_run(tmp_path: Path) -> None:
    inv = tmp_path / "inv.toml"
    inv.write_text(INVENTORY)
    with DldctlHome(tmp_path / "home") as dl:
        dl("up", str(inv), "-d")
        snap = dl.wait(lambda s: s["syncer"]["outer_steps"] >= 3, 120, "merges")
        assert snap["insecure"] is True and "INSECURE" in dl("status", "--once").stdout
        assert not list((dl.run_dir / "keys").iterdir()), "an insecure run has no keys"
        (dl.run_dir / "state.json").write_text("{ this is not json")
        bad = dl("status", check=False)
        assert bad.returncode == 1 and "corrupt state" in bad.stderr and "state.json" in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
        assert len(dl.leftovers()) >= 3, "the processes keep running with a corrupt state file"
        dl("down", timeout=120)
        assert dl.leftovers() == []
