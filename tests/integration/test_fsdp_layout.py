"""FSDP2 islands (learner/fsdp.py) on two real gloo ranks over loopback (tests/integration/fsdp_worker.py).

gpt-tiny sharded by `shard_model` against the same model left whole, from the same seed:
- sharding keeps the manifest (names, full shapes, the tied head listed once);
- `gather_full` of every fragment's local vector is the reference's full fragment bit for bit,
  with 4 fragments (whole tensors) and 15 (row ranges, some across the ranks' shard boundary);
- `local_part` of a full fragment is the rank's local vector;
- a changed fragment scattered into `local_params()` (views of the shards) is what `gather_full`
  returns and what the next forward computes with, even after an eval forward;
- a small model whose 1-row tensor leaves rank 1 two fragments with no local element, and whose
  3-row tensors leave rank 1 a padded shard: layout, gather, scatter and forward all hold;
- one AdamW step with clipping under FSDP lands where the same step on the whole model lands.
Both ranks run once for the whole module (about 3 s on 2 cores); they are killed in `finally`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dldctl.ports import free_port

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
LIMIT_S = 120


def rank_env(rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    return env | {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(WORLD),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",  # gloo's own sockets on loopback too
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }


def run_ranks(out_dir: Path) -> list[dict[str, str]]:
    """Start both ranks, wait for them (killing both on any failure or timeout), read their results."""
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(WORLD):
            argv = [
                sys.executable,
                "-X",
                "faulthandler",
                "-m",
                "tests.integration.fsdp_worker",
                str(out_dir / f"rank{rank}.json"),
            ]
            procs.append(
                subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    env=rank_env(rank, port),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        logs = [proc.communicate(timeout=LIMIT_S)[0] for proc in procs]
        for rank, (proc, log) in enumerate(zip(procs, logs)):
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{log[-4000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_ranks(tmp_path_factory.mktemp("fsdp"))


def passed(results: list[dict[str, str]], *checks: str) -> None:
    for rank, found in enumerate(results):
        for check in checks:
            assert check in found, f"rank {rank} never ran {check}"
            assert found[check] == "", f"rank {rank}, {check}: {found[check]}"


@pytest.mark.parametrize("tag", ["gpt4", "gpt15"])
def test_gather_full_is_the_unsharded_fragment_bit_for_bit(results: list[dict[str, str]], tag: str) -> None:
    passed(results, f"{tag}/manifest", f"{tag}/split", f"{tag}/exact")


@pytest.mark.parametrize("tag", ["gpt4", "gpt15", "empty"])
def test_local_part_cuts_the_local_vector_out_of_the_full_one(results: list[dict[str, str]], tag: str) -> None:
    passed(results, f"{tag}/local_part")


@pytest.mark.parametrize("tag", ["gpt4", "gpt15", "empty"])
def test_a_scattered_fragment_changes_the_sharded_model(results: list[dict[str, str]], tag: str) -> None:
    passed(results, f"{tag}/scatter", f"{tag}/forward")


def test_a_fragment_with_nothing_on_a_rank(results: list[dict[str, str]]) -> None:
    passed(results, "empty/layout", "empty/gather", "empty/exact")


def test_a_training_step_under_fsdp_matches_the_whole_model(results: list[dict[str, str]]) -> None:
    passed(results[:1], "train/changed", "train/matches")
