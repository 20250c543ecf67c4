"""Every command has --help with an example; groups compose; user mistakes exit 2 with one line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from dldctl.cli import app


def commands() -> list[list[str]]:
    """Every leaf command path of the app, e.g. ["chaos", "kill"]."""
    root = typer.main.get_command(app)
    out: list[list[str]] = []

    def walk(cmd: object, path: list[str]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
        else:
            out.append(path)

    walk(root, [])
    return out


def test_the_contract_commands_exist() -> None:
    names = {" ".join(c) for c in commands()}
    expected = {
        "up",
        "down",
        "status",
        "logs",
        "check",
        "report",
        "learner add",
        "learner remove",
        "chaos kill",
        "chaos pause",
        "chaos slow",
        "chaos partition",
        "chaos monkey",
        "chaos run",
        "chaos heal",
        "simulate goodput",
        "simulate bandwidth",
        "simulate calibrate",
    }
    assert expected <= names


@pytest.mark.parametrize("path", commands(), ids=lambda p: " ".join(p))
def test_every_command_has_help_with_an_example(path: list[str]) -> None:
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0
    assert "Example" in result.output and f"dldctl {' '.join(path)}" in result.output


def pages() -> list[list[str]]:
    """Every help page: the root, each group and each command."""
    groups = {tuple(p[:i]) for p in commands() for i in range(len(p))}
    return sorted([list(g) for g in groups]) + commands()


@pytest.mark.parametrize("path", pages(), ids=lambda p: " ".join(p) or "dldctl")
def test_help_shows_flags_as_flags_and_arguments_plainly(path: list[str]) -> None:
    """No `<bool>` after a flag, no `[[INVENTORY]]` or `{target}` on the usage line: the page an
    operator reads, at a width where nothing is cut."""
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for pattern in (r"<bool>", r"\[\[", r"\{\w+\}"):
        assert re.search(pattern, result.output) is None, f"{pattern} in:\n{result.output}"
    options = [line for line in result.output.splitlines() if re.match(r"\W*--\w", line)]
    for line in options:  # an option's value is named (`--out OUT`), never typer's Python type
        assert re.search(r"<(str|int|float|path)>", line) is None, line


def test_usage_lines_write_arguments_as_click_does() -> None:
    usage = {
        ("up",): "Usage: dldctl up [OPTIONS] [INVENTORY]",
        ("chaos", "kill"): "Usage: dldctl chaos kill [OPTIONS] TARGET",
        ("chaos", "heal"): "Usage: dldctl chaos heal [OPTIONS] [TARGET]",
        ("logs",): "Usage: dldctl logs [OPTIONS] TARGET...",
        ("export",): "Usage: dldctl export [OPTIONS] [RUN]",
    }
    for path, line in usage.items():
        result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert line in result.output, result.output
    chaos_kill = CliRunner().invoke(app, ["chaos", "kill", "--help"], env={"COLUMNS": "200"}).output
    assert "KILL|TERM" in chaos_kill  # a choice is spelled out
    assert "safetensors|hf" in CliRunner().invoke(app, ["export", "--help"], env={"COLUMNS": "200"}).output


def test_mistakes_exit_2_with_one_red_line(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nquorom = 2\n[[hosts]]\nname = 'a'\naddress = 'local'\n")
    proc = subprocess.run(
        [sys.executable, "-m", "dldctl", "up", str(bad), "--dry-run"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "did you mean 'quorum'" in lines[0]
    assert "Traceback" not in proc.stderr
    flag = subprocess.run(
        [sys.executable, "-m", "dldctl", "chaos", "kill"], capture_output=True, text=True, timeout=120
    )
    assert flag.returncode == 2
    assert flag.stderr.strip() == "error: Missing argument 'target'. (`dldctl chaos kill -h` for help)"
    typo = subprocess.run(
        [sys.executable, "-m", "dldctl", "status", "--jsn"], capture_output=True, text=True, timeout=120
    )
    assert typo.returncode == 2 and len(typo.stderr.strip().splitlines()) == 1
    assert "No such option: --jsn" in typo.stderr and "--json" in typo.stderr
    # durations are checked before any run is looked up, and the error names the flag
    bad_span = subprocess.run(
        [sys.executable, "-m", "dldctl", "chaos", "monkey", "--mtbf", "soon", "--duration", "10m"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad_span.returncode == 2 and bad_span.stderr.strip().startswith("error: --mtbf: 'soon' is not a duration")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["up", "--timeout", "3parsecs", "--dry-run"], "error: --timeout: '3parsecs' is not a duration"),
        (["up", "--timeout", "0", "--dry-run"], "error: --timeout must be > 0"),
        (["status", "--interval", "soon"], "error: --interval: 'soon' is not a duration"),
    ],
)
def test_durations_take_units_and_a_bad_one_names_its_flag(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "dldctl", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().startswith(message), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""


def test_a_duration_with_units_is_accepted() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dldctl", "up", "--timeout", "3m", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "dry run" in proc.stdout


def test_dry_run_prints_the_plan_and_touches_nothing(tmp_path) -> None:
    env = {"DLDCTL_HOME": str(tmp_path / "home")}
    proc = subprocess.run(
        [sys.executable, "-m", "dldctl", "up", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, **env},
    )
    assert proc.returncode == 0 and "learner-3" in proc.stdout and "dry run" in proc.stdout
    assert not (tmp_path / "home").exists()
    assert "WARNING" not in proc.stdout + proc.stderr  # the defaults carry no known risk
    risky = tmp_path / "risky.toml"
    risky.write_text(
        "[run]\nH = 16\nround_clock = 'learner'\nquorum = 4\nouter_momentum = 0.9\n"
        "[[hosts]]\nname = 'a'\naddress = 'local'\nlearners = 4\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "dldctl", "up", str(risky), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, **env},
    )
    assert proc.returncode == 0 and "WARNING: outer_momentum = 0.9 at H = 16" in proc.stdout, proc.stdout


def test_version_prints_the_installed_version() -> None:
    import importlib.metadata

    proc = subprocess.run([sys.executable, "-m", "dldctl", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout == f"dldctl {importlib.metadata.version('dldctl')}\n"


@pytest.mark.parametrize(
    "args",
    [
        ["chaos", "kill", "learner-0", "--json"],
        ["chaos", "pause", "learner-0", "--duration", "5s", "--json"],
        ["chaos", "slow", "learner-0", "--factor", "2", "--duration", "5s", "--json"],
        ["chaos", "partition", "learner-0", "--duration", "5s", "--json"],
        ["chaos", "heal", "--all", "--json"],
        ["chaos", "monkey", "--mtbf", "1s", "--duration", "5s", "--json"],
        ["chaos", "run", "missing.toml", "--json"],
        ["learner", "add", "--host", "a", "--json"],
        ["learner", "remove", "learner-0", "--json"],
        ["report", "--json"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_json_is_an_option_and_an_error_prints_no_json(args: list[str], tmp_path) -> None:
    """`--json` parses (the command gets as far as looking for the run) and a failure leaves stdout empty."""
    from dldctl.errors import DldError

    result = CliRunner(env={"DLDCTL_HOME": str(tmp_path)}).invoke(app, args)
    assert isinstance(result.exception, DldError), result.output
    assert result.stdout == ""
