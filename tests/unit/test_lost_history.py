"""Lost history is never silent: a brand-new run starts from a learner's weights; a run that had
merged and lost every checkpoint is refused (one line, a marker, an event) unless
`on_no_checkpoint = "from-learner"`, and then its counters continue and the status warns.

The decision (syncer/checkpoint.py), the syncer's start-up (SyncerServer.open on real sockets,
no learners), the setting's validation and the supervisor's rule for a refused syncer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from dldctl.ports import free_port
from dldctl.runstate import PidRecord, ProcStatus, RunState
from dldctl.supervise import reconcile
from dldctl.supervise.reconcile import Observation, decide, new_proc, started
from syncer import checkpoint, status
from syncer.common import jsonlread, keys
from syncer.common.settings import RunSettings, SettingsError, settings_from_dict
from syncer.config import SyncerConfig
from syncer.core import SyncerCore
from syncer.server import SyncerServer
from tests.unit.coreharness import RUN, Harness, make_settings

pytestmark = [pytest.mark.timeout(60)]


def _merged(h: Harness, rounds: int, start: float = 10.0) -> float:
    now = start
    for r in range(rounds):
        p = r % h.s.fragments
        for i, lid in enumerate(("a", "b", "c")):
            h.push(lid, p, h.delta(p, 100 * i + r), now=now)
        h.tick(now)
        now += 1.0
    return now


def _history_run(directory: Path, checkpoints: int = 2) -> Harness:
    """A run that merged and wrote `checkpoints` checkpoints (each also writes history.json)."""
    h = Harness(make_settings(quorum=2))
    h.join_all()
    now = 10.0
    for _ in range(checkpoints):
        now = _merged(h, 3, start=now)
        checkpoint.save(directory, checkpoint.state_dict(h.core, wall=now))
    return h


def _corrupt_all(directory: Path) -> list[Path]:
    files = checkpoint.list_checkpoints(directory)
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if i == 0:
            data[len(data) // 2] ^= 0xFF  # a flipped byte in the body
        else:
            data = data[:20]  # truncated
        path.write_bytes(bytes(data))
    return files


# -- the decision ---------------------------------------------------------------------------------
def test_a_brand_new_run_starts_fresh(tmp_path: Path) -> None:
    core = SyncerCore(make_settings(), RUN, ["a"], now=0.0)
    for directory in (tmp_path / "missing", tmp_path):
        restored, problems = checkpoint.resume(core, directory, now=1.0)
        assert (restored, problems) == (False, [])
        lost = checkpoint.lost_history(directory, problems)
        assert lost is None
        assert checkpoint.start_decision(lost, "refuse") == checkpoint.start_decision(lost, "from-learner") == "fresh"


def test_every_checkpoint_writes_the_runs_history(tmp_path: Path) -> None:
    h = _history_run(tmp_path)
    record, problem = checkpoint.read_history(tmp_path)
    assert problem is None and record is not None
    newest = checkpoint.list_checkpoints(tmp_path)[0]
    assert (record["outer_steps"], record["checkpoint"], record["run_id"]) == (6, newest.name, RUN)
    assert record["versions"] == h.core.model.versions
    assert (
        record["fleet"]["merged_tokens"] == pytest.approx(h.core.fleet.merged_tokens)
        and record["fleet"]["merged_tokens"] > 0
    )
    assert not list(tmp_path.glob(".*.tmp"))


def test_all_checkpoints_corrupt_is_lost_history_refused_by_default(tmp_path: Path) -> None:
    h = _history_run(tmp_path)
    files = _corrupt_all(tmp_path)
    core = SyncerCore(h.s, RUN, ["a", "b", "c"], now=0.0)
    restored, problems = checkpoint.resume(core, tmp_path, now=1.0)
    assert not restored and len(problems) == 2 and core.model is None and core.outer_steps == 0
    lost = checkpoint.lost_history(tmp_path, problems)
    assert lost is not None and lost.outer_steps == 6 and lost.merged_tokens == int(h.core.fleet.merged_tokens)
    assert checkpoint.start_decision(lost, RunSettings().on_no_checkpoint) == "refuse"
    assert checkpoint.start_decision(lost, "from-learner") == "from-learner"
    line = lost.refusal()
    assert "\n" not in line and str(tmp_path) in line and "outer step 6" in line
    assert all(f.name in line for f in files) and "checksum mismatch" in line and "bad magic or truncated" in line
    assert "restore a checkpoint" in line.lower() and 'on_no_checkpoint = "from-learner"' in line


def test_history_without_any_checkpoint_file_is_lost_history(tmp_path: Path) -> None:
    _history_run(tmp_path)
    for path in checkpoint.list_checkpoints(tmp_path):
        path.unlink()
    lost = checkpoint.lost_history(tmp_path, [])
    assert lost is not None and lost.outer_steps == 6
    assert "no checkpoint file left" in lost.refusal()


def test_corrupt_files_without_history_still_count_and_name_the_outer_step(tmp_path: Path) -> None:
    """A run from before history.json: the file names still say how far it had come."""
    _history_run(tmp_path)
    (tmp_path / checkpoint.HISTORY).unlink()
    _corrupt_all(tmp_path)
    core = SyncerCore(make_settings(quorum=2), RUN, [], now=0.0)
    lost = checkpoint.lost_history(tmp_path, checkpoint.resume(core, tmp_path, now=1.0)[1])
    assert lost is not None and (lost.epoch, lost.outer_steps, lost.merged_tokens) == (1, 6, None)
    assert checkpoint.continue_counters(core, lost, now=2.0) != []  # tokens could not be carried on
    assert core.outer_steps == 6


def test_an_unreadable_history_file_is_evidence_too(tmp_path: Path) -> None:
    (tmp_path / checkpoint.HISTORY).write_text("{ not json")
    lost = checkpoint.lost_history(tmp_path, [])
    assert lost is not None and "history.json: unreadable" in lost.refusal()


def test_a_checkpoint_path_that_is_not_a_directory_is_no_history(tmp_path: Path) -> None:
    """An unwritable checkpoint directory (here: a file in its place) says nothing about the past."""
    (tmp_path / "checkpoints").write_text("not a directory")
    assert checkpoint.lost_history(tmp_path / "checkpoints", []) is None


def test_a_checkpoint_that_does_not_fit_is_skipped_for_an_older_one(tmp_path: Path) -> None:
    h = _history_run(tmp_path, checkpoints=1)
    # the newest file (epoch 9) is valid but another run's: skipped for this run's older one
    checkpoint.save(tmp_path, dict(checkpoint.state_dict(h.core, wall=50.0), run_id="other-run", epoch=9))
    core = SyncerCore(h.s, RUN, [], now=0.0)
    restored, problems = checkpoint.resume(core, tmp_path, now=60.0)
    assert restored and len(problems) == 1 and "other-run" in problems[0]
    assert core.outer_steps == 3 and core.model is not None


def test_from_learner_carries_the_counters_on_and_warns(tmp_path: Path) -> None:
    h = _history_run(tmp_path)
    _corrupt_all(tmp_path)
    core = SyncerCore(h.s, RUN, ["a", "b", "c"], now=100.0, epoch=2)
    lost = checkpoint.lost_history(tmp_path, checkpoint.resume(core, tmp_path, now=100.0)[1])
    assert lost is not None
    assert checkpoint.continue_counters(core, lost, now=100.0) == []
    assert core.model is None and core.outer_steps == 6 and core.checkpoint_outer_step == 0
    assert core.fleet.merged_tokens == pytest.approx(h.core.fleet.merged_tokens)
    snap = status.snapshot(core, 101.0)
    assert snap["syncer"]["outer_steps"] == 6 and snap["tokens"]["merged"] == int(h.core.fleet.merged_tokens)
    [warning] = snap["syncer"]["warnings"]
    assert warning.startswith("history lost at outer step 6") and "from-learner" in warning


def test_the_warning_lasts_through_later_checkpoints(tmp_path: Path) -> None:
    h = Harness(make_settings(quorum=2))
    h.core.warnings = ["history lost at outer step 6 (epoch 1): ..."]  # type: ignore[attr-defined]
    h.join_all()
    _merged(h, 2)
    checkpoint.save(tmp_path, checkpoint.state_dict(h.core, wall=20.0))
    fresh = SyncerCore(h.s, RUN, [], now=30.0, epoch=3)
    assert checkpoint.resume(fresh, tmp_path, now=30.0)[0]
    assert status.snapshot(fresh, 31.0)["syncer"]["warnings"] == h.core.warnings
    assert checkpoint.read_history(tmp_path)[0]["warnings"] == h.core.warnings


def test_the_epoch_never_goes_back_even_without_its_file(tmp_path: Path) -> None:
    _history_run(tmp_path / "checkpoints")
    epoch_file = tmp_path / "syncer.epoch"
    assert checkpoint.next_epoch(epoch_file, checkpoint.newest_name(tmp_path / "checkpoints")[0] + 1) == 2
    assert checkpoint.next_epoch(epoch_file) == 3 and epoch_file.read_text() == "3"
    assert checkpoint.newest_name(tmp_path / "nothing") == (0, 0)


# -- the setting ----------------------------------------------------------------------------------
def test_on_no_checkpoint_setting() -> None:
    assert RunSettings().on_no_checkpoint == "refuse"
    assert settings_from_dict({"on_no_checkpoint": "from-learner"}).on_no_checkpoint == "from-learner"
    with pytest.raises(SettingsError) as info:
        settings_from_dict({"on_no_checkpoint": "start-over"})
    assert info.value.key == "on_no_checkpoint"
    assert "'start-over' is not one of refuse, from-learner" in str(info.value)


# -- the syncer's start-up ------------------------------------------------------------------------
@pytest.fixture()
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """A run directory whose syncer merged, checkpointed and then lost every checkpoint."""
    _history_run(tmp_path / "checkpoints")
    _corrupt_all(tmp_path / "checkpoints")
    yield tmp_path


def _server(run_dir: Path, **run: object) -> SyncerServer:
    fields = {f.name for f in dataclasses.fields(RunSettings)}
    extra = {"global_eval_every": 0} if "global_eval_every" in fields else {}  # no evaluator thread here
    s = dataclasses.replace(make_settings(quorum=2, insecure=True), **extra, **run)
    cfg = SyncerConfig(
        RUN, s, f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", run_dir, ("a", "b", "c"), None
    )
    return SyncerServer(cfg)


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in jsonlread.read(run_dir / "events.jsonl") if e["kind"] == kind]


def test_the_syncer_refuses_to_start_a_new_model_by_default(run_dir: Path) -> None:
    server = _server(run_dir)
    try:
        with pytest.raises(checkpoint.HistoryLostError) as info:
            server.open()
        assert server.learner_sock is None and server.control_sock is None, "it must bind nothing"
    finally:
        server.close()
    line = str(info.value)
    assert "\n" not in line and str(run_dir / "checkpoints") in line
    assert (run_dir / checkpoint.REFUSED).read_text().strip() == line
    assert [e["detail"] for e in _events(run_dir, "syncer_refused")] == [line]
    assert not _events(run_dir, "syncer_start") and not _events(run_dir, "history_lost")


def test_from_learner_starts_with_the_counters_going_on(run_dir: Path) -> None:
    (run_dir / checkpoint.REFUSED).write_text("an earlier refusal\n")
    server = _server(run_dir, on_no_checkpoint="from-learner")
    try:
        server.open()
        snap = server.status(server.wall())
    finally:
        server.close()
    assert not (run_dir / checkpoint.REFUSED).exists(), "a start clears an earlier refusal's marker"
    assert snap["syncer"]["outer_steps"] == 6 and snap["syncer"]["epoch"] == 2 and not snap["syncer"]["initialized"]
    assert snap["tokens"]["merged"] > 0
    assert snap["syncer"]["warnings"] and "history lost at outer step 6" in snap["syncer"]["warnings"][0]
    [event] = _events(run_dir, "history_lost")
    assert (
        "outer step 6" in event["detail"]
        and "tokens merged" in event["detail"]
        and "checksum mismatch" in event["detail"]
    )
    assert _events(run_dir, "syncer_start") and not _events(run_dir, "syncer_refused")
    assert server.core.since_checkpoint >= server.cfg.settings.checkpoint_every, "the new model is checkpointed at once"


def test_a_brand_new_run_dir_starts_quietly(tmp_path: Path) -> None:
    server = _server(tmp_path)
    try:
        server.open()
    finally:
        server.close()
    kinds = [e["kind"] for e in jsonlread.read(tmp_path / "events.jsonl")]
    assert "syncer_start" in kinds and not {"history_lost", "syncer_refused", "checkpoint_corrupt"} & set(kinds)


def test_python_m_syncer_exits_1_with_one_line(
    run_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from syncer import __main__ as entry

    monkeypatch.setattr(entry.signal, "signal", lambda *_: None)  # keep pytest's own handlers
    main = entry.main
    keys.create(run_dir / "keys", "syncer")
    config = {
        "version": 1,
        "run_id": RUN,
        "run": {"fragments": 2, "H": 8, "global_eval_every": 0},
        "syncer": {"bind_host": "127.0.0.1", "port": free_port(), "control_port": free_port(), "dir": "."},
        "learners": [{"id": "learner-0"}],
        "keys": {"dir": "keys"},
    }
    (run_dir / "config.json").write_text(json.dumps(config))
    assert main(["--config", str(run_dir / "config.json")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("syncer: error: no valid checkpoint in ")


# -- the supervisor -------------------------------------------------------------------------------
def test_a_refused_syncer_is_stopped_not_restarted() -> None:
    e, _ = started(new_proc("syncer", "local"), PidRecord(1, 2), 0.0)
    st = RunState(status="up", procs={"syncer": e})
    why = "refused: no valid checkpoint in /run/checkpoints, but this run had merged (outer step 6): ..."
    st, actions, events = decide(st, {"syncer": Observation(False, why)}, 100.0, 2.0, 60.0)
    assert st.procs["syncer"].status is ProcStatus.STOPPED and actions == []
    [(kind, target, detail)] = events
    assert (kind, target) == ("refused", "syncer") and detail.startswith(why) and "not restarted" in detail
    for now in (200.0, 10_000.0):
        assert decide(st, {}, now, 2.0, 60.0)[1] == [], "never restarted in a loop"
    # an ordinary syncer death is still restarted
    e2, _ = started(new_proc("syncer", "local"), PidRecord(3, 4), 0.0)
    st2 = RunState(status="up", procs={"syncer": e2})
    st2, _, events2 = reconcile.decide(st2, {"syncer": Observation(False)}, 100.0, 2.0, 60.0)
    assert st2.procs["syncer"].status is ProcStatus.DEAD and events2[0][0] == "syncer_death"
