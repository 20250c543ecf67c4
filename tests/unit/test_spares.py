"""Warm spares: which hosts keep one, the hand-over file (on a real local host), and the spare's
wait for its assignment."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from dldctl.hostruntime import HostRuntime
from dldctl.hosts import LocalHost
from dldctl.runstate import Proc, ProcStatus, RunState
from dldctl.supervise import spares
from learner import spare
from syncer.common.resolved import LearnerEntry

LEARNERS = (
    LearnerEntry("learner-0", host="a"),
    LearnerEntry("learner-1", host="b", nproc=2),
    LearnerEntry("learner-2", host="c"),
    LearnerEntry("learner-3", host="d"),
)


def test_hosts_wanting_spares_skip_islands_and_learners_that_will_not_restart() -> None:
    state = RunState(
        status="up",
        procs={
            "syncer": Proc("syncer", "a", ProcStatus.RUNNING),
            "learner-0": Proc("learner", "a", ProcStatus.DEAD),
            "learner-1": Proc("learner", "b", ProcStatus.RUNNING),  # an island
            "learner-2": Proc("learner", "c", ProcStatus.FINISHED),
            "learner-3": Proc("learner", "d", ProcStatus.STOPPED),
        },
    )
    assert spares.hosts_wanting_spares(state, LEARNERS) == {"a"}


def test_hand_over_writes_the_assignment_whole(tmp_path: Path) -> None:
    runtime = HostRuntime(host="a", python="python3", pythonpath="", run_dir=str(tmp_path), config="c.json")
    host = LocalHost("a")
    (tmp_path / "spares").mkdir()
    spares.hand_over(host, runtime, "a", LearnerEntry("learner-4"), restarts=2)
    data = json.loads(Path(spares.assignment_path(runtime, "a")).read_text())
    assert data == {
        "id": "learner-4",
        "workdir": f"{tmp_path}/learners/learner-4",
        "log": f"{tmp_path}/logs/learner-4.log",
        "restarts": 2,
    }
    assert (tmp_path / "learners" / "learner-4").is_dir() and not list((tmp_path / "spares").glob("*.tmp"))


def test_the_spare_waits_for_a_proper_assignment_and_consumes_it(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    got: list[dict] = []
    waiter = threading.Thread(target=lambda: got.append(spare.wait_for_assignment(path, poll_s=0.01)))
    waiter.start()
    path.write_text('{"id": "lear')  # half written: ignored, not consumed as garbage
    time.sleep(0.05)
    path.write_text('["not", "an", "assignment"]')
    time.sleep(0.05)
    assert not got
    path.write_text(json.dumps({"id": "learner-2", "workdir": "w", "log": "l"}))
    waiter.join(5)
    assert got == [{"id": "learner-2", "workdir": "w", "log": "l"}] and not path.exists()
