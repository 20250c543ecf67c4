"""`--json` of chaos, learner and report, from pure data: every document carries its schema, a
fault that was not injected has the same keys as one that was (nulls where it would have hit),
and `chaos run --dry-run --json` prints its plan as one line on stdout, the text on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dldctl.chaos import records
from dldctl.chaos.plan import Experiment, Fault, FaultReport, Result, parse_check
from dldctl.chaos.records import Injection
from dldctl.cli import app
from dldctl.commands import chaos as cli_chaos
from dldctl.commands import learner as cli_learner
from dldctl.commands.report import report_record
from dldctl.lifecycle.converge import Removed
from dldctl.runstate import PidRecord, Proc, ProcStatus, RunState

KILL = Injection("kill", "learner-2", "a", 4242, 100.0, 5.0, 105.0, "kill -KILL pid 4242 on a; back in >= 5 s", "KILL")
PAUSE = Injection("pause", "learner-1", "b", 77, 200.0, 20.0, 220.0, "SIGSTOP for 20 s", fault_id="ab12cd34")


def test_a_kill_reports_where_it_hit_and_when_the_hold_ends() -> None:
    doc = records.injected("e2e-1", KILL)
    assert doc == {
        "schema": "dldctl.chaos/1",
        "run": "e2e-1",
        "action": "kill",
        "target": "learner-2",
        "host": "a",
        "pid": 4242,
        "t": 100.0,
        "duration_s": 5.0,
        "until": 105.0,
        "detail": "kill -KILL pid 4242 on a; back in >= 5 s",
        "signal": "KILL",
        "factor": None,
        "fault_id": None,
        "rate": None,  # a link cap's
    }
    assert json.loads(json.dumps(doc)) == doc


def test_a_fault_line_has_the_same_keys_injected_or_not() -> None:
    fault = Fault(at=3.5, action="slow", target="learner-3", duration=10.0, factor=4.0)
    hit = records.fault_line("r", fault, PAUSE, None, 999.0)
    missed = records.fault_line("r", fault, None, "refused: slow learner-3 ...", 300.0)
    assert set(hit) == set(missed) == {"schema", "run", "record", "at", "injected", "error", *KILL.to_dict()}
    assert hit["injected"] is True and hit["error"] is None and hit["pid"] == 77 and hit["t"] == 200.0
    assert missed["injected"] is False and missed["error"].startswith("refused")
    assert (missed["action"], missed["target"], missed["duration_s"], missed["factor"]) == ("slow", "learner-3", 10, 4)
    assert missed["host"] is missed["pid"] is missed["until"] is missed["signal"] is None
    assert missed["t"] == 300.0 and missed["record"] == hit["record"] == "fault" and missed["at"] == 3.5


def test_heal_and_the_monkey_summary() -> None:
    doc = records.heal("r", None, ["pause learner-3", "hold learner-2"], 5.0)
    assert doc["healed"] == [{"kind": "pause", "target": "learner-3"}, {"kind": "hold", "target": "learner-2"}]
    assert doc["schema"] == "dldctl.chaos/1" and doc["action"] == "heal" and doc["target"] is None
    assert records.heal("r", "learner-0", [], 5.0)["healed"] == []
    schedule = [Fault(1.0, "kill", "learner-0"), Fault(2.0, "pause", "learner-1", 10.0)]
    options = {"seed": 7, "mtbf_s": 2.0, "duration_s": 8.0, "dry_run": False}
    done = records.monkey_summary("r", schedule, options, 1, None)
    assert (done["record"], done["action"], done["planned"], done["injected"]) == ("summary", "monkey", 2, 1)
    assert done["interrupted"] is False and done["healed"] == [] and done["seed"] == 7
    assert done["schedule"][0] == {
        "at": 1.0,
        "action": "kill",
        "target": "learner-0",
        "duration_s": 0.0,
        "signal": "KILL",
        "factor": None,
        "rate": None,
    }
    stopped = records.monkey_summary("r", schedule, options, 1, ["pause learner-1"])
    assert stopped["interrupted"] is True and stopped["healed"] == [{"kind": "pause", "target": "learner-1"}]


def _experiment() -> Experiment:
    faults = (Fault(1.0, "kill", "learner-3"), Fault(3.0, "pause", "learner-2", 3.0))
    return Experiment("smoke", 14.0, faults, steady=(parse_check("quorum.live >= 3"),), path="/tmp/exp.toml")


def test_an_experiment_summary_carries_its_plan_and_its_verdict() -> None:
    exp = _experiment()
    dry = records.experiment_summary(None, exp, None)
    assert dry["dry_run"] is True and dry["passed"] is None and dry["faults"] == [] and dry["run"] is None
    assert dry["plan"]["steady"] == ["quorum.live >= 3"] and len(dry["plan"]["faults"]) == 2
    report = FaultReport(exp.faults[0], injected_at=10.0, detected_at=10.5, back_at=14.0)
    result = Result(False, ["aborted: interrupted"], [report], "interrupted", ["/r/chaos/smoke-1.json"])
    done = records.experiment_summary("r", exp, result)
    assert set(done) == set(dry)
    assert done["passed"] is False and done["aborted"] == "interrupted" and done["files"] == ["/r/chaos/smoke-1.json"]
    assert done["faults"][0]["detected_after_s"] == 0.5 and done["faults"][0]["back_after_s"] == 4.0


def test_learner_add_says_which_new_learners_run() -> None:
    state = RunState(
        "up",
        {
            "learner-4": Proc("learner", "a", ProcStatus.RUNNING, PidRecord(31, 9)),
            "learner-5": Proc("learner", "a", ProcStatus.STARTING),
        },
    )
    doc = cli_learner.added("r", "a", ["learner-4", "learner-5"], state, 1.0)
    assert doc["schema"] == "dldctl.learner/1" and doc["action"] == "add" and doc["host"] == "a"
    assert doc["added"] == ["learner-4", "learner-5"] and doc["all_running"] is False
    assert doc["learners"] == [
        {"id": "learner-4", "status": "running", "pid": 31, "running": True},
        {"id": "learner-5", "status": "starting", "pid": None, "running": False},
    ]
    gone = cli_learner.removed("r", Removed("learner-4", "a", 31, False), 2.0)
    assert (gone["action"], gone["learner"], gone["pid"], gone["result"]) == ("remove", "learner-4", 31, "stopped")
    assert cli_learner.removed("r", Removed("learner-4", "a", 31, True), 2.0)["result"] == "leaving"


def test_report_lists_the_files_it_wrote(tmp_path: Path) -> None:
    doc = report_record(tmp_path / "run-1", tmp_path / "out", [tmp_path / "out" / "loss.png"])
    assert doc == {
        "schema": "dldctl.report/1",
        "run": "run-1",
        "dir": str(tmp_path / "run-1"),
        "out": str(tmp_path / "out"),
        "files": [str(tmp_path / "out" / "loss.png")],
    }


def test_chaos_run_dry_run_json_is_one_line_on_stdout(tmp_path: Path) -> None:
    exp = tmp_path / "exp.toml"
    exp.write_text('[experiment]\nname = "smoke"\n[[fault]]\nat = 1\naction = "kill"\ntarget = "learner-3"\n')
    result = CliRunner().invoke(app, ["chaos", "run", str(exp), "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    doc = json.loads(lines[0])
    assert (doc["schema"], doc["record"], doc["experiment"]) == ("dldctl.chaos/1", "summary", "smoke")
    assert doc["dry_run"] is True and doc["run"] is None
    assert doc["plan"]["faults"][0]["target"] == "learner-3"
    assert "experiment smoke" in result.stderr and "kill" in result.stderr


@pytest.mark.parametrize("tty", [True, False])
def test_the_guard_asks_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch, tty: bool) -> None:
    class Stdin:
        def isatty(self) -> bool:
            return tty

    monkeypatch.setattr(cli_chaos.sys, "stdin", Stdin())
    assert (cli_chaos._confirmer() is cli_chaos._confirm) is tty
