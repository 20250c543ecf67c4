"""A learner gone bad is judged, quarantined, restarted and re-admitted on probation: a real
syncer and three real learners on this machine (tests/localrun.py), one of them made bad through
its control.json exactly as `dldctl chaos corrupt learner-1 --mode scale` makes it (weights x1e6).

No supervisor here: the test restarts the quarantined learner's process itself, as the supervisor
does (docs/algorithm.md, "Judging contributions")."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from dldctl.faults import procs
from dldctl.hostruntime import HostRuntime
from dldctl.hosts.local import LocalHost
from tests.localrun import LocalRun, write_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

BAD = "learner-1"


def test_a_learner_pushing_scaled_weights_is_quarantined_named_and_readmitted(tmp_path: Path) -> None:
    run = {"global_eval_every": 0, "quarantine_s": 4.0, "eval_every": 50}
    config = write_config(tmp_path, [{}, {}, {}], run=run)
    runtime = HostRuntime("here", sys.executable, "", str(tmp_path), str(config))
    tail = ["-m", "learner", "--config", str(config), "--id", BAD, "--workdir", str(tmp_path / "learners" / BAD)]
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        lr.start_learner(0)
        bad = lr.spawn(BAD, tail)
        lr.start_learner(2)
        lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= 40, 180, "merges before the fault (the judge's warm-up)")
        assert procs.apply("corrupt", LocalHost("here"), runtime, BAD, None, 6.0, 1e6, mode="scale")
        snap = lr.wait_for(
            lambda s: any(r["state"] == "quarantined" for r in s["screen"].get("learners", [])), 60, "a quarantine"
        )
        rows = snap["screen"]["learners"]
        assert [r["learner"] for r in rows] == [BAD], rows  # named, and nobody else
        assert "norm" in rows[0]["reason"] and rows[0]["rejected"] >= 3, rows
        assert [r["state"] for r in snap["learners"] if r["id"] == BAD] == ["quarantined"]
        shut = [e for e in lr.events() if e["kind"] == "quarantined"]
        assert [e["target"] for e in shut] == [BAD] and "contributions rejected" in shut[0]["detail"]
        assert bad.wait(30) == 3, lr.log(BAD)[-2000:]  # it exits to restart from the global state
        assert "quarantined by the syncer" in lr.log(BAD)
        merged = lr.status()["syncer"]["outer_steps"]
        lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= merged + 8, 60, "the others merging meanwhile")
        time.sleep(max(0.0, shut[0]["t"] + 6.5 - time.time()))  # the fault is over, as on its host
        lr.spawn(BAD, tail)  # its successor, started as the supervisor starts it
        lr.wait_for(
            lambda s: any(e["kind"] == "probation" and e["target"] == BAD for e in lr.events()), 60, "probation"
        )
        released = next(e["t"] for e in lr.events() if e["kind"] == "probation")
        lr.wait_for(
            lambda s: any(BAD in m["contributors"] and m["t"] > released for m in lr.metrics("round")),
            90,
            "its contributions merged again on probation",
        )
        assert [e["target"] for e in lr.events() if e["kind"] == "quarantined"] == [BAD], "no second quarantine"
