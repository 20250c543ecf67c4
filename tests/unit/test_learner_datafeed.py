"""The learner's end of the ledger (learner/datafeed.py): finished units wait for every fragment's
next push and are logged by the learner itself; the hand names what is not pushed everywhere yet;
a factory's own loader state is saved and handed back after a restart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from learner.datafeed import LOADER_STATE, LearnerUnits, last_unit, restore_loader, save_loader
from workload import Workload


def test_finished_units_ride_each_fragments_next_push_and_stay_in_hand_until_then(tmp_path: Path) -> None:
    units = LearnerUnits(tmp_path, "learner-2", fragments=2, incarnation="i9", on=True)
    assert units.feed is not None and units.meta() is None  # no data described yet: off the ledger
    units.feed.configure(sequences=40, seq_len=4, unit_sequences=4, seed=1, digest="d")
    units.receive([0, 1, 2], [])
    assert units.feed.take(6) is not None
    units.stepped(7)
    assert units.meta()["hand"] == [1, 2, 0]  # 1 under way, 2 not started, 0 finished but not pushed
    assert units.for_push(0) == (0,) and units.for_push(0) == ()
    assert units.meta()["hand"] == [1, 2, 0]  # fragment 1 has not carried it yet
    assert units.meta()["pushed"] == [[0, [0]]]  # a restored syncer counts that push as lost
    assert units.for_push(1) == (0,) and units.meta()["hand"] == [1, 2]
    # that push of fragment 1 has not left yet (the syncer is down): not pushed, still in hand
    queued = units.meta(queued={1: (0,)})
    assert queued["hand"] == [1, 2, 0] and queued["pushed"] == [[0, [0]]]
    units.receive([], [2])  # the syncer gave unit 2 to another learner
    assert units.feed.hand() == [1]
    (row,) = [json.loads(line) for line in (tmp_path / "units.jsonl").read_text().splitlines()]
    assert row["unit"] == 0 and row["step"] == 7 and row["learner"] == "learner-2" and row["inc"] == "i9"


class Loader:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def workload(loader: Loader) -> Workload:
    return Workload(
        model=torch.nn.Linear(1, 1),
        next_batch=lambda: None,
        loss=lambda m, b: torch.zeros(()),
        tokens=lambda b: 1,
        eval_batches=[],
        state_dict=loader.state_dict,
        load_state_dict=loader.load_state_dict,
    )


def test_a_factorys_loader_resumes_where_the_last_process_saved_it(tmp_path: Path) -> None:
    before = Loader()
    before.position = 1234
    save_loader(workload(before), tmp_path)
    after = Loader()
    restore_loader(workload(after), tmp_path)
    assert after.position == 1234
    (tmp_path / LOADER_STATE).write_bytes(b"torn")
    fresh = Loader()
    restore_loader(workload(fresh), tmp_path)  # a torn file: said, and the loader starts afresh
    assert fresh.position == 0


def test_a_restarted_learner_says_how_far_its_slot_got_so_a_restored_syncer_skips_it(tmp_path: Path) -> None:
    LearnerUnits(tmp_path, "learner-0", 1, "i1", on=True)  # no log yet
    (tmp_path / "units.jsonl").write_text('{"unit": 41}\n{"unit": 7}\n{"unit": 4')  # torn at a kill
    assert last_unit(tmp_path / "units.jsonl") == 41
    again = LearnerUnits(tmp_path, "learner-0", 1, "i2", on=True)
    assert again.feed is not None and again.feed.beyond == 42
    assert last_unit(tmp_path / "nothing.jsonl") == -1


def test_the_every_step_publish_works_the_hand_out_at_most_every_tenth_of_a_second(tmp_path: Path) -> None:
    units = LearnerUnits(tmp_path, "learner-0", fragments=1, incarnation="i1", on=True)
    assert units.feed is not None
    units.feed.configure(sequences=40, seq_len=4, unit_sequences=4, seed=1, digest="d")
    asked: list[int] = []

    def queued() -> dict[int, tuple[int, ...]]:
        asked.append(1)
        return {}

    first = units.published(0.0, queued)
    assert units.published(0.0, queued) is first and len(asked) == 1  # the link's locks taken once
