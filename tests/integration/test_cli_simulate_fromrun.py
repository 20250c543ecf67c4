"""`dldctl simulate goodput|bandwidth --from-run` as a user runs it, on a real recorded run."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_pilotrun import pilot_dir

pytestmark = pytest.mark.timeout(120)


def dldctl(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "dldctl", "simulate", *args], capture_output=True, text=True, timeout=90, env=env
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(pilot_dir(tmp_path_factory.mktemp("fromrun")))


def test_goodput_from_the_run_says_what_it_measured_and_plans_a_bigger_fleet(run: str) -> None:
    proc = dldctl("goodput", "--from-run", run, "--learners", "64", "--mtbf", "10s", "--duration", "1h")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for words in ("kill -> rejoin", "work lost per kill", "fitted: reproduces the measured goodput", "4 pause, 8 kill"):
        assert words in out
    assert "64 learners (2 per host), a fault every 10 s, 60 min (10 seeds): goodput 0.9" in out


def test_goodput_from_the_run_as_json_reproduces_the_run_at_its_own_rate(run: str) -> None:
    proc = dldctl("goodput", "--from-run", run, "--seeds", "50", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "dldctl.simulate.goodput-from-run/1"
    measured, pred = doc["measured"], doc["prediction"]
    assert pred["learners"] == measured["learners"] == 4
    assert pred["mtbf_s"] == pytest.approx(measured["mtbf_s"]) and pred["horizon_s"] == measured["window_s"]
    assert pred["goodput"]["p10"] - 0.01 <= measured["goodput"] <= pred["goodput"]["p90"] + 0.01
    assert len(doc["faults"]) == 12 and {c["source"].split()[0] for c in doc["constants"]} >= {"run", "fitted:"}
    fewer = json.loads(dldctl("goodput", "--from-run", run, "--mtbf", "5s", "--seeds", "50", "--json").stdout)
    assert fewer["prediction"]["goodput"]["mean"] < pred["goodput"]["mean"]


def test_bandwidth_from_the_run_predicts_each_link(run: str) -> None:
    proc = dldctl("bandwidth", "--from-run", run, "--link", "100mbit,1mbit,100kbit", "--target-loss", "2.5", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "dldctl.simulate.bandwidth-from-run/1"
    fast, mid, thin = doc["predictions"]
    assert doc["measured"]["max_lag"] == 0  # dldctl's default: a learner never waits for a reply
    assert fast["blocked"] == thin["blocked"] == pytest.approx(doc["measured"]["blocked"])
    assert fast["link_busy"] < mid["link_busy"] < 1 < thin["link_busy"] and thin["coalesced"]
    assert thin["time_to_target_s"] == fast["time_to_target_s"] > 0
    table = dldctl("bandwidth", "--from-run", run, "--link", "1mbit", "--syncer-link", "same")
    assert table.returncode == 0, table.stderr
    assert "1 Mbit/s" in table.stdout and "a push" in table.stdout and "never waits for a reply" in table.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["goodput", "--from-run", "no-such-run"], "--from-run no-such-run:"),
        (["goodput", "--from-run", "RUN", "--chips", "1M"], "drop --chips and --sweep"),
        (["goodput", "--chips", "1M", "--mtbf", "10s"], "--per-host, --monkey-seed and --actions go with --from-run"),
        (["goodput", "--from-run", "RUN", "--mtbf", "soon"], "--mtbf"),
        (["goodput", "--from-run", "RUN", "--learners", "0"], "--learners: must be >= 1"),
        (["bandwidth", "--from-run", "RUN"], "--from-run needs --link"),
        (["bandwidth", "--from-run", "RUN", "--link", "fast"], "--link: 'fast' is not a rate"),
        (["bandwidth", "--params", "1B", "--step-time", "1s", "--link", "1mbit"], "go with --from-run"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(run: str, args: list[str], message: str) -> None:
    proc = dldctl(*[run if a == "RUN" else a for a in args])
    assert proc.returncode == 2, proc.stdout
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_run_without_faults_plans_no_faults_and_refuses_to_guess_their_cost(tmp_path: Path) -> None:
    calm = pilot_dir(tmp_path)
    events = (calm / "events.jsonl").read_text().splitlines()
    (calm / "events.jsonl").write_text("\n".join(e for e in events if '"fault_inject"' not in e) + "\n")
    doc = json.loads(dldctl("goodput", "--from-run", str(calm), "--json").stdout)
    assert doc["faults"] == [] and doc["prediction"]["mtbf_s"] is None
    assert doc["prediction"]["goodput"]["mean"] == pytest.approx(doc["measured"]["goodput"])
    proc = dldctl("goodput", "--from-run", str(calm), "--mtbf", "10s")
    assert proc.returncode == 2 and "saw no fault in its window" in proc.stderr
    assert "dldctl chaos monkey" in proc.stderr


def test_a_seeded_monkey_is_planned_with_its_own_schedule(run: str) -> None:
    from dldctl.chaos.plan import monkey_schedule

    names = [f"learner-{i}" for i in range(4)]
    planned = monkey_schedule(random.Random(11), mtbf_s=10, duration_s=240, targets=names, actions=["kill", "pause"])
    args = ["--mtbf", "10s", "--duration", "240s", "--monkey-seed", "11", "--seeds", "20"]
    doc = json.loads(dldctl("goodput", "--from-run", run, *args, "--actions", "kill,pause", "--json").stdout)
    faults = doc["prediction"]["faults"]
    assert faults["max"] <= len(planned) and faults["min"] >= len(planned) - 3  # a few find no process
    unseen = dldctl("goodput", "--from-run", run, *args, "--actions", "corrupt")
    assert unseen.returncode == 2 and "--actions: the run saw no corrupt fault: its cost is unknown" in unseen.stderr
