"""The data-parallel baseline (bench/ddp_baseline.py + bench/ddp_worker.py) on real torchrun jobs.

gpt-tiny, seq_len 32, batch 8, 2 gloo workers on this machine:
- a clean run (DDP, throttled x1.5: an emulated slower device, as a host's throttle): the eval loss falls,
  the bytes all-reduced equal the closed-form count (steps x 4 bytes x parameters handed to
  all-reduce; a ring sends 2(N-1)/N of that per worker), the checkpoint holds the final step;
- a run (explicit all-reduce) with one worker SIGKILLed mid-way and --max-restarts=1: torchrun restarts the job, which
  resumes from the checkpoint (its step continues, not from 0) and finishes.
Every process the jobs started is gone afterwards.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from bench.ddp_baseline import failure_schedule, run_ddp
from bench.ddp_comm import ring_wire_bytes
from bench.ddp_worker import fast_forward, load_config
from workload import data as data_mod
from workload import gpt as model_mod

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SETTINGS = {"model": "gpt-tiny", "seq_len": 32, "batch_size": 8, "seed": 0, "eval_every": 50}


def tiny_params() -> int:
    """Parameters of gpt-tiny on the byte corpus at seq_len 32 (tied head counted once)."""
    return sum(p.numel() for p in model_mod.build("gpt-tiny", vocab_size=256, block_size=32).parameters())


def processes_mentioning(text: str) -> list[int]:
    """Live pids whose command line mentions `text` (looked up only, never signalled)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry))
    return found


def assert_cleaned_up(summary: dict, out_dir: Path) -> None:
    assert summary["pids_alive_after"] == []
    assert processes_mentioning(str(out_dir)) == []


def test_ring_bytes_and_failure_schedule() -> None:
    assert ring_wire_bytes(1000, 1) == 0
    assert ring_wire_bytes(1000, 2) == 1000
    assert ring_wire_bytes(1000, 4) == 1500
    a, b = failure_schedule(120, 20, seed=3), failure_schedule(120, 20, seed=3)
    assert a == b and a == sorted(a) and all(0 < t < 120 for t in a)
    assert failure_schedule(120, 20, seed=4) != a


def test_resume_draws_the_batches_an_uninterrupted_run_would() -> None:
    tokens = (torch.arange(10_000) % 251).numpy().astype("uint8")
    straight = data_mod.Batches(tokens, 0, 10_000, batch_size=4, seq_len=16, seed=7)
    for _ in range(5):
        straight.next()
    resumed = data_mod.Batches(tokens, 0, 10_000, batch_size=4, seq_len=16, seed=7)
    assert fast_forward(resumed.next, 5)
    for _ in range(3):
        (x1, y1), (x2, y2) = straight.next(), resumed.next()
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not fast_forward(lambda: None, 5)


def test_clean_run_learns_counts_bytes_and_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "clean"
    s = run_ddp(
        SETTINGS, 2, out, budget_tokens=50_000, duration_s=None, checkpoint_every_s=0.5, timeout_s=150, throttle=1.5
    )
    assert s["ok"], s.get("log_tail")
    assert load_config(str(out / "config.json")).throttle == 1.5  # the emulated slower device reached the ranks
    assert_cleaned_up(s, out)
    steps, n = s["steps"], tiny_params()
    assert s["tokens"] == steps * 2 * 8 * 32 >= 50_000 > (steps - 1) * 2 * 8 * 32
    assert s["n_params"] == n
    assert s["eval_loss"] < s["initial_eval_loss"] - 1.0, (s["initial_eval_loss"], s["eval_loss"])
    assert s["allreduce_payload_bytes"] == steps * 4 * n
    assert s["wire_bytes_sent_per_worker"] == pytest.approx(2 * (2 - 1) / 2 * steps * 4 * n)
    assert s["wire_bytes_per_token"] == pytest.approx(2 * s["wire_bytes_sent_per_worker"] / s["tokens"])
    assert 0 < s["goodput"] < 1 and s["restarts"] == 0
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["finished"] and ckpt["counters"]["step"] == steps
    assert set(ckpt["model"]) >= {"transformer.wte.weight", "lm_head.weight"}
    assert ckpt["optimizer"]["state"], "AdamW state is checkpointed"


def test_killed_worker_restarts_from_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "killed"
    # killed 1 s into training (after the first checkpoints, long before the 300-step budget); the
    # explicit all-reduce ("flat") here, DDP's comm hook above: both reducers are covered, and a
    # restart re-inits gloo the same way for both (the TORCH_DISABLE_SHARE_RDZV_TCP_STORE pitfall)
    s = run_ddp(
        SETTINGS,
        2,
        out,
        budget_tokens=300 * 2 * 8 * 32,
        duration_s=None,
        max_restarts=1,
        kill_schedule=[1.0],
        kill_from="train",
        checkpoint_every_s=0.2,
        seed=1,
        reducer="flat",
        timeout_s=150,
    )
    assert s["ok"], s.get("log_tail")
    assert_cleaned_up(s, out)
    assert len(s["kills"]) == 1 and s["restarts"] == 1
    kill = s["kills"][0]
    assert kill["resumed_step"] > 0, "the restarted job resumed from the checkpoint, not from step 0"
    assert s["steps"] == 300 > kill["resumed_step"], "and trained on from there to the budget"
    assert kill["restart_cost_s"] > 0
    if kill["lost_steps"] is not None:
        assert kill["lost_steps"] >= 0
    assert s["allreduce_payload_bytes"] == s["steps"] * 4 * tiny_params()  # the survivors' lineage only
    assert s["eval_loss"] < s["initial_eval_loss"]
