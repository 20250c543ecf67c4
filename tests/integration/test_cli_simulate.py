"""`dldctl simulate` as a user runs it: a real subprocess, its stdout, stderr and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

SWEEP = "chips=150000,300000,600000,1200000,2400000"


def dldctl(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dldctl", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        cwd=cwd,
    )


def run_json(*args: str) -> dict:
    proc = dldctl(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_goodput_json_shape_and_ordering() -> None:
    doc = run_json("goodput", "--chips", "1.2M", "--learners", "8", "--seeds", "4", "--hours", "12")
    assert doc["schema"] == "dldctl.simulate.goodput/2" and doc["mode"] == "single"
    params = doc["params"]
    assert params["chips"] == 1_200_000 and params["learners"] == 8 and params["seeds"] == [0, 1, 2, 3]
    assert params["mtbi_s"] == pytest.approx(365.25 * 86400) and params["horizon_s"] == 12 * 3600
    results = {r["strategy"]: r for r in doc["results"]}
    assert list(results) == ["data_parallel", "elastic_data_parallel", "decoupled_diloco"]
    assert results["decoupled_diloco"]["learners"] == 8 and results["data_parallel"]["learners"] is None
    for r in doc["results"]:
        for metric in ("goodput", "uptime", "failures"):
            spread = r[metric]
            assert set(spread) == {"mean", "std", "p10", "p50", "p90", "min", "max", "n"}
            assert spread["n"] == 4 and spread["min"] <= spread["p10"] <= spread["p90"] <= spread["max"]
    g = {k: v["goodput"]["mean"] for k, v in results.items()}
    # 1.2M chips lose one every ~26 s: the calibrated model gives the paper's 27 / 58 / 88 % or so.
    assert 0.15 < g["data_parallel"] < 0.4 < g["elastic_data_parallel"] < 0.7 < 0.8 < g["decoupled_diloco"]
    assert doc["params"]["restart_s"] == pytest.approx(52.9) and doc["params"]["rate_cv"] == 1.0
    assert doc["checkpoint_interval_s"]["1200000"] == pytest.approx((2 * 365.25 * 86400 / 1.2e6) ** 0.5)
    assert any("Young/Daly" in line for line in doc["assumptions"])
    assert results["decoupled_diloco"]["uptime"]["mean"] > 0.999
    # ~3300 failures a day at 1.2M chips: about 1650 in 12 h.
    assert results["elastic_data_parallel"]["failures"]["mean"] == pytest.approx(1642, rel=0.05)


def test_goodput_without_failures_is_one() -> None:
    doc = run_json("goodput", "--chips", "2.4M", "--learners", "16", "--mtbi-years", "inf", "--seeds", "2")
    assert doc["params"]["mtbi_s"] is None
    assert [r["goodput"]["mean"] for r in doc["results"]] == [1.0, 1.0, 1.0]
    assert [r["uptime"]["mean"] for r in doc["results"]] == [1.0, 1.0, 1.0]


def test_goodput_table_output() -> None:
    proc = dldctl("goodput", "--chips", "600k", "--learners", "4", "--seeds", "2", "--hours", "6")
    assert proc.returncode == 0, proc.stderr
    for text in (
        "600,000 chips",
        "data-parallel",
        "elastic data-parallel",
        "Decoupled DiLoCo M=4",
        "goodput",
        "system uptime",
        "model (docs/simulate.md):",
        "restart 52.9s, started over by a failure during it",
        "fitted on the paper's table at 150k chips",
    ):
        assert text in proc.stdout
    assert proc.stderr == ""


def test_sweep_table_and_plot(tmp_path) -> None:
    png = tmp_path / "sweep.png"
    proc = dldctl("goodput", "--sweep", SWEEP, "--learners", "1,2,4,8,16", "--seeds", "3", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for col in ("150k chips", "300k chips", "600k chips", "1.2M chips", "2.4M chips"):
        assert col in out
    rows = [line for line in out.splitlines() if "Decoupled DiLoCo M=" in line]
    assert len(rows) == 2 * 5  # goodput and uptime tables, five learner counts each
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"plot written to {png}" in out


def test_sweep_json_values() -> None:
    doc = run_json(
        "goodput",
        "--sweep",
        "chips=150000,2400000",
        "--learners",
        "1,16",
        "--seeds",
        "2",
        "--hours",
        "6",
        "--learner-reconfig",
        "24.6s",
    )
    assert doc["mode"] == "sweep" and doc["plot"] is None
    assert doc["params"]["chips"] == [150_000, 2_400_000] and doc["params"]["learners"] == [1, 16]
    cells = {(r["strategy"], r["chips"], r["learners"]): r for r in doc["results"]}
    assert len(cells) == 2 * (2 + 2)
    for n in (150_000, 2_400_000):
        # One learner is the elastic job on the same chips, draw for draw.
        assert cells[("decoupled_diloco", n, 1)]["goodput"] == cells[("elastic_data_parallel", n, None)]["goodput"]
    # Rule of thumb: 16 learners on 2.4M chips ~ one elastic job on 150k.
    assert cells[("decoupled_diloco", 2_400_000, 16)]["goodput"]["mean"] == pytest.approx(
        cells[("elastic_data_parallel", 150_000, None)]["goodput"]["mean"], abs=0.03
    )


def test_quorum_flag_lowers_uptime_in_the_sweep() -> None:
    loose = run_json("goodput", "--chips", "1.2M", "--learners", "4", "--seeds", "2", "--hours", "6")
    strict = run_json("goodput", "--chips", "1.2M", "--learners", "4", "--quorum", "4", "--seeds", "2", "--hours", "6")
    up = lambda doc: doc["results"][2]["uptime"]["mean"]
    assert strict["params"]["quorum"] == 4
    assert up(strict) < up(loose) - 0.3
    assert strict["results"][2]["goodput"] == loose["results"][2]["goodput"]


def test_bandwidth_json_values() -> None:
    doc = run_json(
        "bandwidth",
        "--params",
        "12B",
        "--step-time",
        "1s",
        "--H",
        "64",
        "--fragments",
        "4",
        "--bits",
        "4",
        "--link-gbps",
        "10",
    )
    assert doc["schema"] == "dldctl.simulate.bandwidth/1"
    dp, dl = doc["strategies"]["data_parallel"], doc["strategies"]["decoupled_diloco"]
    # 12B bf16 gradients, ring over 4 sites: 36 GB per step; hidden 2/3 s; 1/19 s stall allowed.
    assert dp["bytes_per_transfer"] == pytest.approx(36e9)
    assert dp["required_gbps"] == pytest.approx(288 / (2 / 3 + 1 / 19))
    # One int4 fragment (3B values * 4.25 bits) every 16 steps, reply within 2 steps.
    assert dl["bytes_per_transfer"] == pytest.approx(3e9 * 4.25 / 8)
    assert dl["required_gbps"] == pytest.approx(12.75 / (2 + 16 / 19))
    assert dp["utilization_at_link"] == pytest.approx(1 / (1 + 28.8 - 2 / 3))
    assert dl["utilization_at_link"] == 1.0
    assert doc["reduction"] == pytest.approx(dp["required_gbps"] / dl["required_gbps"])


def test_bandwidth_table_output() -> None:
    proc = dldctl("bandwidth", "--params", "100B", "--step-time", "5", "--link-gbps", "10")
    assert proc.returncode == 0, proc.stderr
    assert "100B parameters" in proc.stdout and "busy on 10 Gbit/s" in proc.stdout
    assert "Decoupled DiLoCo needs" in proc.stdout


def test_calibrate_on_the_paper_table_meets_the_target() -> None:
    doc = run_json("calibrate", "--hours", "48", "--seeds", "3")
    assert doc["schema"] == "dldctl.simulate.calibrate/1" and doc["column"] == 150_000
    assert set(doc["constants_s"]) == {"restart_s", "reconfig_s", "learner_reconfig_s"}
    assert all(5 < v < 300 for v in doc["constants_s"].values())  # seconds to minutes
    assert doc["errors"]["cells"] == 15 and len(doc["cells"]) == 20
    assert doc["errors"]["mean_abs_points"] <= 3 and doc["errors"]["max_abs_points"] <= 8


def test_calibrate_own_table_as_text(tmp_path: Path) -> None:
    table = tmp_path / "fleet.csv"
    table.write_text("strategy,learners,20000,40000\nelastic_data_parallel,,90,82\n")
    proc = dldctl("calibrate", "--reference", str(table), "--mtbi-years", "0.1", "--hours", "12", "--seeds", "2")
    assert proc.returncode == 0, proc.stderr
    assert f"reference: {table}; fitted on 20k chips" in proc.stdout
    assert "constants: --reconfig " in proc.stdout and "1 predicted cells" in proc.stdout
    assert "elastic data-parallel" in proc.stdout and "(fit)" in proc.stdout


@pytest.mark.parametrize(
    ("content", "args", "expect"),
    [
        ("strategy,learners,100\nmagic,,50\n", [], "line 2: strategy 'magic'"),
        ("strategy,learners,100\nelastic_data_parallel,,50\n", ["--column", "200"], "--column 200: not a column"),
        (None, [], "cannot read it"),
    ],
)
def test_calibrate_bad_reference_is_one_line(tmp_path: Path, content: str | None, args: list[str], expect: str) -> None:
    table = tmp_path / "t.csv"
    if content is not None:
        table.write_text(content)
    proc = dldctl("calibrate", "--reference", str(table), *args)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert expect in lines[0] and (str(table) in lines[0] or "--column" in lines[0]) and proc.stdout == ""


@pytest.mark.parametrize("command", ["goodput", "bandwidth", "calibrate"])
def test_help_has_an_example(command) -> None:
    proc = dldctl(command, "--help")
    assert proc.returncode == 0 and "Example: dldctl simulate " + command in proc.stdout


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["goodput", "--chips", "-5"], "--chips"),
        (["goodput", "--chips", "10", "--learners", "20"], "--learners"),
        (["goodput", "--sweep", "chips=150000,x"], "--sweep"),
        (["goodput", "--sweep", "learners=1,2"], "--sweep"),
        (["goodput", "--sweep", "chips=1000,4", "--learners", "1,8"], "--learners"),
        (["goodput", "--chips", "1M", "--step-time", "5parsecs"], "--step-time"),
        (["goodput", "--chips", "1M", "--plot", "x.png"], "--plot"),
        (["goodput", "--chips", "1M", "--quorum", "9"], "--quorum"),
        (["goodput", "--chips", "1e15"], "--hours"),
        (["goodput", "--chips", "1M", "--rate-cv", "-1"], "--rate-cv"),
        (["goodput", "--chips", "1M", "--checkpoint-every", "soon"], "--checkpoint-every"),
        (["goodput", "--chips", "1M", "--learner-reconfig", "-5s"], "--learner-reconfig"),
        (["goodput"], "--chips"),
        (["bandwidth", "--params", "12B", "--step-time", "1", "--bits", "3"], "--bits"),
        (["bandwidth", "--params", "12B", "--step-time", "1", "--sites", "1"], "--sites"),
        (["bandwidth", "--params", "lots", "--step-time", "1"], "--params"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, flag) -> None:
    proc = dldctl(*args)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and flag in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
