"""Record tests/data/run_faults: a real local fleet (three gpt-tiny learners) through a learner
kill and a syncer kill (its restart from the last checkpoint rolls tokens merged back), driven by
the real `dldctl up`, `dldctl chaos kill` and `dldctl down`; copies metrics.jsonl, events.jsonl
and the run's state.json into tests/data/run_faults (the `report` tests' recorded run).

    .venv/bin/python tests/data/record_run_faults.py      # about 2 minutes
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from dldctl.testing import DldctlHome, inventory_text, local_host, wait_until
from tests.e2e.fleetutil import run_table

OUT = Path(__file__).resolve().parent / "run_faults"


def outer_steps(dl: DldctlHome) -> int:
    return int(dl.status()["syncer"]["outer_steps"])


def record(home: Path) -> Path:
    inv = home / "inv.toml"
    home.mkdir(parents=True, exist_ok=True)
    inv.write_text(
        run_table("faults", quorum=2, H=64, fragments=2, checkpoint_every=16)
        + inventory_text({}, [local_host("here", 3)]).split("\n", 1)[1]
    )
    with DldctlHome(home / "home") as dl:
        dl("up", str(inv), "-d", "--wait")
        wait_until(lambda: outer_steps(dl) >= 8, 120, "eight outer steps")
        time.sleep(6)
        dl.kill("learner-1")
        dl("chaos", "pause", "learner-2", "--duration", "4", "--force")
        wait_until(lambda: dl.events("rejoin"), 90, "learner-1's rejoin")
        time.sleep(8)
        ckpts = len(dl.events("checkpoint"))
        wait_until(lambda: len(dl.events("checkpoint")) > ckpts, 90, "a checkpoint")
        time.sleep(8)  # merges after the checkpoint: the restarted syncer rolls them back
        dl.kill("syncer")
        wait_until(lambda: len(dl.events("syncer_start")) >= 2, 90, "the syncer's restart")
        wait_until(lambda: len(dl.events("quorum_regained")) >= 2, 90, "the restarted syncer's quorum")
        time.sleep(25)
        summary = dl.down()
        run = dl.run_dir
        assert run is not None
        if OUT.exists():
            shutil.rmtree(OUT)
        OUT.mkdir()
        for name in ("metrics.jsonl", "events.jsonl"):
            shutil.copy(run / name, OUT / name)
        (OUT / "down_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return OUT


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dld-record-") as tmp:
        print(record(Path(tmp)))
