"""An FSDP2 island (`island = "fsdp"`, 2 ranks over gloo) in a real fleet beside a plain learner.

The island's ranks each hold a shard of the model; rank 0 gathers every pushed fragment's outer
gradient from both ranks' parts and applies the global fragments it receives to its part. Both
learners merge, the island's replica of the global model is bit-identical to the syncer's, the
eval loss falls, and the island ends its step budget cleanly (its ranks' exits are clean: a
mesh alive at exit used to abort some of them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.localrun import LocalRun, write_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_an_fsdp_island_trains_merges_and_stays_exact(tmp_path: Path) -> None:
    config = write_config(tmp_path, [{"nproc": 2, "island": "fsdp"}, {}], run={"steps": 80, "eval_every": 20})
    with LocalRun(tmp_path, config) as lr:
        lr.start_syncer()
        lr.start_learner(0)
        lr.start_learner(1)
        lr.wait_for(
            lambda s: any(
                r["id"] == "learner-0"
                and r["replica"]["current"] >= 1
                and r["replica"]["identical"] == r["replica"]["current"]
                for r in s["learners"]
            ),
            150,
            "the island's replica at the syncer's versions",
        )
        deadline = time.monotonic() + 150
        while any(lr.procs[f"learner-{i}"].poll() is None for i in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.5)
        log = lr.log("learner-0")
        assert [lr.procs[f"learner-{i}"].returncode for i in (0, 1)] == [0, 0], log[-3000:]
        assert "island of world 2" in log and "identical" not in log, "FSDP ranks hold different shards"
        rounds = lr.metrics("round")
        assert sum("learner-0" in r["contributors"] for r in rounds) >= 4, "the island's pushes merged"
        evals = [float(line.split(" eval ")[1].split()[0]) for line in log.splitlines() if " eval " in line]
        assert len(evals) == 4 and evals[0] < 4.5 and evals[-1] < evals[0], evals  # from ln(vocab) = 5.5
        done = json.loads((tmp_path / "learner-0" / "finished").read_text())
        assert (done["steps"], done["tokens"]) == (80, 80 * 8 * 32 * 2), "both ranks' tokens"
