"""bench/cli_startup.py, run once quickly: a row per everyday command against the same run's
baseline (every command's module and the libraries they used to import), in its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import cli_startup


def test_the_bench_times_each_command_against_importing_everything(tmp_path: Path) -> None:
    out = tmp_path / "cli.json"
    assert cli_startup.main(["--quick", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["command"] for r in rows] == ["dldctl " + " ".join(c) for c in cli_startup.COMMANDS]
    for row in rows:
        assert 0 < row["python alone s"] < row["s"]
        assert row["ratio"] == pytest.approx(row["s"] / row["every command imported s"], abs=0.011)
