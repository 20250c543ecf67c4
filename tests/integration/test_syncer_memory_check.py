"""`dldctl check` and `dldctl up` against the syncer host's real memory: the console script in a
real memory cgroup whose limit is below what the syncer's state needs (as in a container or a
Slurm job with --mem), and outside it.

gpt2-124m at GPT-2's vocabulary (a .bin corpus), one shard: 124.5 M parameters, whose three fp32
vectors alone take 1.5 GB. In a 1.2 GB cgroup `check` says the syncer does not fit and fails,
and `up` refuses before it creates a run; outside, the same inventory passes. Four CPU learners
of it at 16 x 1024 tokens do not fit this machine at all: refused the same way.

A model from a user's factory is counted by the syncer itself, from the first learner's hello: a
real syncer process refuses a learner whose model (a trillion parameters) it cannot hold, with
one line, allocates nothing, and goes on serving the run's real model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from syncer.wire import fragments
from tests import memcgroup
from tests.localrun import LocalRun, write_config
from tests.protoclient import ProtoClient, initial_values

DLDCTL = str(Path(sys.executable).parent / "dldctl")
INVENTORY = """
[run]
name = "memcheck"
model = "gpt2-124m"
data = "{data}"
seq_len = 1024
fragments = 8

[[hosts]]
name = "here"
address = "local"
learners = {learners}
batch_size = {batch}
"""
LIMIT = 1_200_000_000


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, DLDCTL_HOME=str(tmp_path / "home"), COLUMNS="200")


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    (tmp_path / "tokens.bin").write_bytes(bytes(2 * 200_000))  # uint16 ids (vocab 50304), all 0: check loads them
    path = tmp_path / "inventory.toml"
    path.write_text(INVENTORY.format(data=tmp_path / "tokens.bin", learners=1, batch=1))
    return path


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, check=False)


@pytest.mark.skipif(memcgroup.unavailable() is not None, reason=str(memcgroup.unavailable()))
def test_a_syncer_host_without_the_memory_is_refused_before_anything_starts(
    inventory: Path, env: dict[str, str]
) -> None:
    with memcgroup.limited(LIMIT) as inside:
        check = run([*inside, DLDCTL, "check", str(inventory), "--json"], env)
        up = run([*inside, DLDCTL, "up", str(inventory), "-d"], env)
    assert check.returncode == 1, check.stderr
    [memory] = json.loads(check.stdout)["syncer_memory"]
    assert memory["status"] == "fail" and memory["params"] == 124_475_904, memory
    assert memory["free_B"] < LIMIT < memory["floor_B"] and "cgroup limit" in memory["detail"]
    assert "error: host local: the syncer needs 1.7 GB" in check.stderr
    assert up.returncode == 1, up.stdout + up.stderr
    [line] = [x for x in up.stderr.splitlines() if x.strip()]
    assert line.startswith("error: host local: the syncer needs 1.7 GB to ") and "(cgroup limit)" in line
    assert "--no-memory-check" in line and "shard_hosts" in line
    runs = run([DLDCTL, "runs", "--json"], env)
    assert json.loads(runs.stdout)["runs"] == [], "a refused up must not leave a run behind"


def test_the_same_inventory_fits_this_machine(inventory: Path, env: dict[str, str]) -> None:
    check = run([DLDCTL, "check", str(inventory), "--json"], env)
    [memory] = json.loads(check.stdout)["syncer_memory"]
    assert memory["status"] in ("ok", "warn") and memory["free_B"] > memory["floor_B"], memory
    [learner] = json.loads(check.stdout)["learner_memory"]
    assert learner["ok"] and learner["learners"] == 1 and 3e9 < learner["learner_B"][0] < 8e9, learner
    assert check.returncode == 0, check.stdout + check.stderr
    text = run([DLDCTL, "check", str(inventory)], env)
    assert "syncer memory (local): the syncer needs 1.7 GB to 2.0 GB (3.5 GB while checkpointing)" in text.stdout
    assert "learner memory (here): 1 CPU learner (gpt2-124m) need 5.2 GB, beside the syncer's 1.7 GB" in text.stdout


def test_cpu_learners_the_machine_cannot_hold_are_refused_before_anything_starts(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """Four CPU learners of gpt2-124m at 16 x 1024 need ~25 GB each (bench/learner_memory.py): more
    than this machine has. `check` and `up` say so in one line; the fleet is never started."""
    path = tmp_path / "four.toml"
    path.write_text(INVENTORY.format(data=tmp_path / "tokens.bin", learners=4, batch=16))
    check = run([DLDCTL, "check", str(path), "--json"], env)
    assert check.returncode == 1, check.stderr
    record = json.loads(check.stdout)
    [syncer] = record["syncer_memory"]
    [learners] = record["learner_memory"]
    assert syncer["ok"] and not learners["ok"] and learners["learners"] == 4 and learners["host"] == "here"
    assert learners["syncer_B"] == syncer["floor_B"] and min(learners["learner_B"]) > 20e9, learners
    assert learners["free_B"] == syncer["free_B"]  # one machine, one answer for both
    assert 4 * learners["learner_B"][0] + learners["syncer_B"] > learners["free_B"]
    up = run([DLDCTL, "up", str(path), "-d"], env)
    [line] = [x for x in up.stderr.splitlines() if x.strip()]
    assert up.returncode == 1 and line.startswith("error: host here: 4 CPU learners (gpt2-124m) need "), line
    assert "beside the syncer's 1.7 GB" in line and "smaller batch_size" in line and "--no-memory-check" in line
    assert json.loads(run([DLDCTL, "runs", "--json"], env).stdout)["runs"] == []


def test_a_real_syncer_refuses_a_model_it_cannot_hold_and_serves_the_next(tmp_path: Path) -> None:
    config = write_config(tmp_path, [{}, {}], run={"round_clock": "learner"})
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        lr.wait_for(lambda s: s["syncer"]["alive"], 20, "syncer up")
        address = f"tcp://127.0.0.1:{lr.cfg.syncer.port}"
        huge = [fragments.TensorSpec(f"w{i}", (1_000_000, 250_000)) for i in range(4)]  # 10^12 parameters
        big = ProtoClient(address, "learner-0", lr.cfg.run_id, lr.dir / "keys", manifest=huge)
        try:
            big.send_hello()
            error = big.recv("error", timeout=10)
        finally:
            big.close()
        assert error["fatal"] and error["reason"].startswith("the syncer cannot hold this model: its 1,000,000.0 M")
        assert "GB free (" in error["reason"] and "shard_hosts" in error["reason"]
        status = lr.status()
        assert status["syncer"]["alive"] and status["syncer"]["rejected"] == {"manifest": 1}
        ok = ProtoClient(address, "learner-1", lr.cfg.run_id, lr.dir / "keys")
        try:
            assert ok.hello()["init_owner"], "the refused model claimed nothing"
            ok.upload_init(initial_values(ok.plan))
            assert ok.recv("ack", timeout=10)["initialized"]
        finally:
            ok.close()
