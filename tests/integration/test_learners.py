"""Real learner processes (gpt-tiny) against a real syncer on 127.0.0.1.

Loss falls with 2 and 4 learners; every learner's replica of the global model is bit-identical
to the syncer's; a learner killed with SIGKILL rejoins and contributes again; a throttled learner
gets a smaller share of the merge weight; a syncer killed with SIGKILL resumes from its
checkpoint and the learners carry on with it.
"""

from __future__ import annotations

import json
import signal
import statistics
import time
from pathlib import Path

import pytest
import torch

from syncer.wire import fragments
from tests.localrun import LocalRun, write_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def run_of(tmp_path: Path, learners: list[dict], **run: object) -> LocalRun:
    config = write_config(tmp_path, learners, run=run)
    lr = LocalRun(tmp_path, config)
    lr.start_syncer()
    for i in range(len(learners)):
        lr.start_learner(i)
    return lr


def eval_losses(lr: LocalRun) -> list[float]:
    return [s["loss_eval"] for s in lr.metrics("sample") if s.get("loss_eval") is not None]


def wait_finished(lr: LocalRun, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(lr.procs[f"learner-{i}"].poll() is not None for i in range(n)):
            codes = [lr.procs[f"learner-{i}"].returncode for i in range(n)]
            assert codes == [0] * n, f"learners exited {codes}: {lr.log('learner-0')[-2000:]}"
            return
        time.sleep(0.5)
    raise AssertionError("learners did not finish: " + lr.log("learner-0")[-2000:])


def test_loss_falls_and_replicas_are_bit_identical(tmp_path: Path) -> None:
    n = 4  # (2 learners was a second run of the same checks: 4 covers it, with more rounds of mixed contributors)
    with run_of(tmp_path, [{} for _ in range(n)], H=8, eval_every=25) as lr:
        lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= 8 * n and s["loss"]["eval"] is not None, 150, "merges")
        # versions move every few ms and heartbeats come every 0.5 s: each learner must be seen at
        # the syncer's version of some fragment, identical there, though not all in one snapshot
        seen: set[str] = set()

        def replicas_checked(s: dict) -> bool:
            assert all(r["replica"]["identical"] == r["replica"]["current"] for r in s["learners"]), s["learners"]
            seen.update(r["id"] for r in s["learners"] if r["replica"]["current"] >= 1)
            return len(seen) == n

        lr.wait_for(replicas_checked, 30, "replicas at the syncer's versions")
        lr.wait_for(
            lambda s: len(eval_losses(lr)) >= 4 and eval_losses(lr)[-1] < eval_losses(lr)[0] - 0.3,
            150,
            "eval loss falling",
        )
        # every learner reports the share of its time its training thread waited on communication
        last = lr.metrics("sample")[-1]["learners"]
        assert sorted(last) == [f"learner-{i}" for i in range(n)]
        assert all(0.0 <= row["blocked_frac"] < 1.0 for row in last.values()), last
        export = tmp_path / "final_model.pt"
        lr.control("shutdown", export="final_model.pt")
        lr.procs["syncer"].wait(timeout=30)
        time.sleep(0.5)
        for i in range(n):
            lr.kill(f"learner-{i}", signal.SIGTERM)
        assert_replicas_identical(tmp_path, export, n)


def assert_replicas_identical(tmp_path: Path, export: Path, n: int) -> None:
    """Every learner's saved replica is the exported model bit for bit, wherever it is at the
    export's version (most fragments of most learners)."""
    saved = torch.load(export, weights_only=True)
    state, final = saved["state_dict"], saved["versions"]
    plan = fragments.plan([fragments.TensorSpec(k, tuple(v.shape)) for k, v in state.items()], 4)
    compared = 0
    for i in range(n):
        replica = torch.load(tmp_path / f"learner-{i}" / "replica.pt", weights_only=True)
        for p in range(plan.count):
            if replica["versions"][p] == final[p]:
                torch.testing.assert_close(replica["fragments"][p], plan.gather(p, state), rtol=0, atol=0)
                compared += 1
    assert compared >= n * plan.count // 2, "too few fragments at the syncer's final version to compare"


def test_killed_learner_rejoins_and_contributes_again(tmp_path: Path) -> None:
    with run_of(tmp_path, [{}, {}], H=8) as lr:
        lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= 10, 120, "merges")
        # merges can come from learner-0 alone (quorum 1): wait until learner-1 has trained too
        snap = lr.wait_for(
            lambda s: next(r for r in s["learners"] if r["id"] == "learner-1")["step"] >= 20, 60, "learner-1 training"
        )
        step = next(r for r in snap["learners"] if r["id"] == "learner-1")["step"]
        lr.kill("learner-1", signal.SIGKILL)
        killed_at = time.time()
        lr.start_learner(1)
        lr.wait_for(lambda s: next(r for r in s["learners"] if r["id"] == "learner-1")["joins"] == 2, 60, "rejoin")
        # it continues its own step counter (its place on the lr schedule), it does not start over
        lr.wait_for(lambda s: "resuming at step" in lr.log("learner-1"), 30, "the resumed counter logged")
        resumed = int(lr.log("learner-1").split("resuming at step ")[-1].split()[0])
        assert resumed >= step > 0
        assert next(r for r in lr.status()["learners"] if r["id"] == "learner-1")["step"] >= resumed
        lr.wait_for(
            lambda s: any(r["t"] > killed_at and "learner-1" in r["contributors"] for r in lr.metrics("round")),
            90,
            "learner-1 contributing after its restart",
        )
        kinds = [(e["kind"], e["target"]) for e in lr.events()]
        assert ("rejoin", "learner-1") in kinds


def test_sigterm_sends_the_due_work_and_says_goodbye(tmp_path: Path) -> None:
    with run_of(tmp_path, [{}, {}]) as lr:
        lr.wait_for(lambda s: s["syncer"]["outer_steps"] >= 8, 120, "merges")
        asked = time.time()
        lr.kill("learner-1", signal.SIGTERM)
        assert lr.procs["learner-1"].returncode == 0
        assert "learner-1: stopped after" in lr.log("learner-1")
        assert "did not confirm the goodbye" not in lr.log("learner-1")
        lr.wait_for(
            lambda s: any(e["kind"] == "leave" and e["target"] == "learner-1" for e in lr.events()),
            20,
            "learner-1's goodbye",
        )
        # the work it had not sent yet reached the global model after the signal
        late = [r for r in lr.metrics("round") if r["t"] >= asked and "learner-1" in r["contributors"]]
        assert late, "no round merged learner-1's last work"
        assert lr.procs["syncer"].poll() is None and lr.procs["learner-0"].poll() is None
        # a signal is not a spent budget: the fleet's average goes on without learner-1 ...
        assert lr.status()["quorum"]["finished"] == []
        # ... but once `dldctl down` says the run is ending, a learner that leaves stays in it
        assert lr.control("ending")["ok"] is True
        lr.kill("learner-0", signal.SIGTERM)
        snap = lr.wait_for(lambda s: s["quorum"]["finished"], 20, "learner-0 counted as finished")
        assert snap["quorum"]["finished"] == ["learner-0"] and snap["quorum"]["ending"] is True


def test_a_warm_spare_becomes_the_learner_it_is_told_to(tmp_path: Path) -> None:
    """learner/spare.py against a real syncer: warmed up, assigned by a renamed file, trains as learner-1."""
    with run_of(tmp_path, [{}, {}]) as lr:  # only learner-0 runs: learner-1 is the spare's to be
        lr.kill("learner-1")
        assignment = tmp_path / "spare.json"
        lr.spawn("spare", ["-m", "learner", "--config", str(lr.config), "--spare", str(assignment)])
        lr.wait_log("spare", "ready; waiting for", 120)
        tmp = tmp_path / "spare.json.tmp"
        tmp.write_text(
            json.dumps(
                {
                    "id": "learner-1",
                    "workdir": str(tmp_path / "learner-1-work"),
                    "log": str(tmp_path / "learner-1.log"),
                    "restarts": 3,
                }
            )
        )
        tmp.rename(assignment)
        lr.wait_log("learner-1", "learner-1: taking over from a warm spare", 30)
        lr.wait_for(
            lambda s: any(r["id"] == "learner-1" and r["step"] > 0 for r in s["learners"]), 60, "learner-1 training"
        )
        lr.wait_for(
            lambda s: any("learner-1" in r["contributors"] for r in lr.metrics("round")), 60, "learner-1 merged"
        )
        assert not assignment.exists(), "the spare consumes its assignment"
        assert (tmp_path / "learner-1-work").is_dir() and lr.procs["spare"].poll() is None


def test_throttled_learner_gets_a_smaller_weight(tmp_path: Path) -> None:
    def weights(snap: dict) -> dict[str, float]:
        return {r["id"]: r["weight"] for r in snap["learners"]}

    with run_of(tmp_path, [{}, {"throttle": 4.0}], H=8) as lr:
        lr.wait_for(
            lambda s: s["syncer"]["outer_steps"] >= 30 and all(r["step"] > 0 for r in s["learners"]), 150, "merges"
        )
        # the share covers the last 60 s: one learner may have trained alone for a second or two
        # before the other joined (the full suite loads the machine), so give the rates time to show
        snap = lr.wait_for(
            lambda s: weights(s).get("learner-1", 1.0) < 0.4 < weights(s).get("learner-0", 0.0),
            60,
            "the throttled learner's share below 0.4",
        )
        assert weights(snap)["learner-1"] < weights(snap)["learner-0"] / 1.5, weights(snap)


def test_syncer_sigkill_resumes_from_checkpoint(tmp_path: Path) -> None:
    with run_of(tmp_path, [{}, {}], H=8, checkpoint_every=5) as lr:
        lr.wait_for(lambda s: s["syncer"]["checkpoint_outer_step"] >= 10, 120, "a checkpoint")
        lr.expect_dead = {"syncer"}
        lr.kill("syncer", signal.SIGKILL)
        time.sleep(1.0)  # learners keep training with the syncer gone
        lr.start_syncer()
        lr.expect_dead = set()
        snap = lr.wait_for(lambda s: s["syncer"]["epoch"] == 2, 30, "restarted syncer")
        resumed = snap["syncer"]["outer_steps"]
        assert resumed >= 10, "did not resume from the checkpoint"
        lr.wait_for(
            lambda s: s["syncer"]["outer_steps"] >= resumed + 10 and s["quorum"]["live"] == 2,
            120,
            "learners reconnected and merging again",
        )
        kinds = [e["kind"] for e in lr.events()]
        assert "syncer_resume" in kinds


def test_torchrun_island_keeps_its_ranks_identical(tmp_path: Path) -> None:
    """A learner of 2 ranks (DDP over gloo) next to a plain one: both merge, ranks stay equal."""
    with run_of(tmp_path, [{"nproc": 2}, {}], H=8, steps=60) as lr:
        lr.wait_for(
            lambda s: any("learner-0" in r["contributors"] for r in lr.metrics("round")), 150, "the island contributing"
        )
        wait_finished(lr, 2, 150)
        log = lr.log("learner-0")
        assert "island of world 2" in log
        # every eval_every (20) steps the ranks compare crc32s of all their parameters
        assert log.count("island of 2 ranks identical") >= 2 and "DIVERGED" not in log
        # the budget marker says what the loop did (bench/learner_throughput.py reads it)
        done = json.loads((tmp_path / "learner-1" / "finished").read_text())
        assert (done["steps"], done["tokens"], done["device"]) == (60, 60 * 8 * 32, "cpu")
        assert (
            done["busy_s"] > 0
            and done["blocked_s"] >= 0
            and done["busy_s"] + done["blocked_s"] <= done["train_s"] * 1.01
        )


def test_the_syncer_calls_rounds_that_gather_the_whole_fleet(tmp_path: Path) -> None:
    """At the defaults (quorum 1, overlap, the syncer's round clock) rounds gather every live
    learner; on each learner's own clock (round_clock = learner) most pushes close a round alone."""

    def contributors(lr: LocalRun) -> list[int]:
        """Contributors per round from the round after every learner's first push of that
        fragment on: before it, a round may find a learner still joining (on a loaded machine a
        learner's start can take several rounds)."""
        rounds, seen, after = lr.metrics("round"), set(), []
        for r in rounds:
            if len(seen) == 3 * 4:  # (learner, fragment) pairs: 3 learners, 4 fragments
                after.append(len(r["contributors"]))
            seen |= {(c, r["fragment"]) for c in r["contributors"]}
        return after

    def merged_after_join(lr: LocalRun, merges: int) -> list[int]:
        lr.wait_for(lambda s: len(contributors(lr)) >= merges, 150, f"{merges} merges after the fleet joined")
        return contributors(lr)

    with run_of(tmp_path / "syncer", [{}, {}, {}], H=16, quorum=1) as lr:
        gathered = merged_after_join(lr, 36)
    with run_of(tmp_path / "learner", [{}, {}, {}], H=16, quorum=1, round_clock="learner") as lr:
        alone = merged_after_join(lr, 36)
    mean = statistics.fmean
    assert mean(gathered) >= 2.5 > mean(alone) + 0.5, (gathered, alone)
