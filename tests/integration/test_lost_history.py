"""Lost history is never silent, with real processes: a syncer and two gpt-tiny learners run until
checkpoints exist; the syncer is stopped and every checkpoint file corrupted. Restarted, it
refuses by default (one line on stderr, exit 1, the marker and the event); with
`on_no_checkpoint = "from-learner"` it starts a new global model whose counters continue, says so
with a `history_lost` event and carries a warning that `dldctl status --json` shows.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from pathlib import Path

import pytest

from dldctl.observe import snapshot
from dldctl.rundir import RunDir
from dldctl.runstate import RunState
from syncer import checkpoint
from syncer.common import resolved
from syncer.common.settings import RunSettings
from tests.localrun import LocalRun, write_config

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

# no global-model evaluator thread where the setting exists (it only slows a 2-core test machine)
NO_EVAL = {"global_eval_every": 0} if "global_eval_every" in {f.name for f in dataclasses.fields(RunSettings)} else {}


def _corrupt_every_checkpoint(directory: Path) -> list[str]:
    names = []
    for path in checkpoint.list_checkpoints(directory):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        names.append(path.name)
    assert names, "no checkpoint to corrupt"
    return names


def _refused_start(lr: LocalRun, ckpt_dir: Path, names: list[str]) -> None:
    """The default: exit 1 with one line naming the directory, each file and the fix."""
    seen = len(lr.log("syncer"))
    proc = lr.start_syncer()
    assert proc.wait(timeout=90) == 1, lr.log("syncer")[seen:]
    errors = [line for line in lr.log("syncer")[seen:].splitlines() if line.startswith("syncer: error:")]
    assert len(errors) == 1, lr.log("syncer")[seen:]
    line = errors[0]
    assert f"no valid checkpoint in {ckpt_dir}" in line and all(f"{n}: checksum mismatch" in line for n in names)
    assert "Restore a checkpoint" in line and 'on_no_checkpoint = "from-learner"' in line
    assert "serving run" not in lr.log("syncer")[seen:], "it must not have started"
    marker = lr.dir / checkpoint.REFUSED
    assert marker.read_text().strip() == line.removeprefix("syncer: error: ")
    assert [e["detail"] for e in lr.events() if e["kind"] == "syncer_refused"] == [marker.read_text().strip()]


def _status_json(run_path: Path) -> dict:
    """What `dldctl status --json` assembles for this run directory (the live syncer's answer)."""
    run = RunDir(run_path)
    with run.locked():
        run.write_state(RunState(status="up", created=time.time()))
    return snapshot.collect(run)


def test_all_checkpoints_corrupt_refused_then_continued_from_a_learner(tmp_path: Path) -> None:
    config = write_config(tmp_path, [{}, {}], run={"H": 8, "checkpoint_every": 5, **NO_EVAL})
    ckpt_dir = tmp_path / "checkpoints"
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        lr.start_learner(0)
        lr.start_learner(1)
        lr.wait_for(lambda s: s["syncer"]["checkpoint_outer_step"] >= 10, 180, "checkpoints")
        lr.expect_dead = {"syncer"}
        lr.kill("syncer", signal.SIGTERM)  # a final checkpoint, then history.json says it all
        before = json.loads((ckpt_dir / checkpoint.HISTORY).read_text())
        assert before["outer_steps"] >= 10 and before["fleet"]["merged_tokens"] > 0
        names = _corrupt_every_checkpoint(ckpt_dir)

        _refused_start(lr, ckpt_dir, names)

        cfg = resolved.load(config)
        resolved.save(
            config, dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, on_no_checkpoint="from-learner"))
        )
        lr.start_syncer()
        lr.expect_dead = set()
        snap = lr.wait_for(
            lambda s: s["syncer"]["epoch"] == 3 and s["syncer"]["initialized"],
            120,
            "the syncer started with a new global model",
        )
        assert snap["syncer"]["outer_steps"] >= before["outer_steps"], "the outer step counter went back"
        assert snap["tokens"]["merged"] >= int(before["fleet"]["merged_tokens"]), "merged tokens went back"
        assert not (lr.dir / checkpoint.REFUSED).exists()
        [lost] = [e for e in lr.events() if e["kind"] == "history_lost"]
        assert f"outer step {before['outer_steps']}" in lost["detail"] and "checksum mismatch" in lost["detail"]
        assert any(e["kind"] == "initialized" and e["t"] >= lost["t"] for e in lr.events())

        lr.wait_for(
            lambda s: (
                s["syncer"]["outer_steps"] >= before["outer_steps"] + 10
                and s["quorum"]["live"] == 2
                and s["syncer"]["checkpoint_outer_step"] > before["outer_steps"]
            ),
            180,
            "merging and checkpointing the new model, counters going on",
        )
        shown = _status_json(tmp_path)
        assert shown["syncer"]["alive"] is True
        [warning] = shown["syncer"]["warnings"]
        assert warning.startswith(f"history lost at outer step {before['outer_steps']}") and "from-learner" in warning
        resumed, _ = checkpoint.load_latest(ckpt_dir)
        assert resumed is not None and resumed["warnings"] == [warning], "the warning outlives the next restart"
