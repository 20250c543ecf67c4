"""The data ledger (syncer/dataledger.py) and the learner's unit feed (workload/units.py):
units handed out in order, merged once every fragment merged them, a dead learner's unmerged
units queued again and its partly merged ones closed, never handed out twice; a restore that
reconciles the checkpoint with the learners' hands; and the permutation every learner computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncer.dataledger import DataLedger, DataMismatch
from syncer.rounds import Contribution
from syncer.wire import quant
from workload.units import UnitFeed, UnitPlan, unit_size

DATA = {"sequences": 100, "unit_sequences": 10, "seq_len": 8, "digest": "d1"}


def ledger(fragments: tuple[int, ...] = (0, 1)) -> DataLedger:
    led = DataLedger(fragments)
    led.adopt(DATA)
    return led


def want(n: int, received: int = 0) -> dict[str, int]:
    return {"want": n, "received": received}


def merge_all(led: DataLedger, learner: str, inc: str, uids: list[int]) -> None:
    for p in led.fragments:
        led.carried(p, learner, inc, uids)
        led.round_closed(p, [(learner, inc, uids)])


def test_units_go_out_in_order_and_close_once_every_fragment_merged_them() -> None:
    led = ledger()
    assert led.count == 10
    assert led.issue("a", "i1", want(3), 0.0) == [0, 1, 2]
    assert led.issue("b", "i1", want(2), 0.0) == [3, 4]
    # a asks again before its first three arrived: those in transit count against its want
    assert led.issue("a", "i1", want(3, received=0), 0.1) == []
    led.carried(0, "a", "i1", [0])
    led.round_closed(0, [("a", "i1", [0])])
    assert 0 in led.open and led.snapshot()["merged"] == 0  # merged on one fragment of two
    led.carried(1, "a", "i1", [0])
    led.round_closed(1, [("a", "i1", [0])])
    snap = led.snapshot()
    assert 0 not in led.open and snap["merged"] == 1 and snap["merged_tokens"] == 80
    assert snap["tokens_by_learner"] == {"a": 80}


def test_a_dead_learners_unmerged_units_are_handed_out_again_and_partly_merged_ones_never() -> None:
    led = ledger()
    led.issue("a", "i1", want(3), 0.0)  # 0, 1, 2
    merge_all(led, "a", "i1", [0])
    led.carried(0, "a", "i1", [1])
    led.carried(0, "a", "i1", [2])  # unit 2 trained; its push dropped from the round
    led.round_closed(0, [("a", "i1", [1])])  # unit 1 merged on fragment 0 only
    ended = led.ended("a", keep="i2")  # a restarted as incarnation i2
    assert ended.requeued == [2] and ended.trained == 1 and ended.partial == [(1, 1)]
    snap = led.snapshot()
    assert (snap["merged"], snap["partial"], snap["lost"]) == (1, 1, 1)
    assert snap["merged_tokens"] == 80 + 40  # the partial unit counts its merged half
    # the lost unit goes out first, to whoever asks next; the partial one never again
    assert led.issue("b", "i1", want(2), 1.0) == [2, 3]
    assert led.snapshot()["reissued"] == 1
    merge_all(led, "b", "i1", [2])
    assert led.closed[0] == [2, 1]


def test_a_push_dropped_before_its_round_closed_is_missed_not_waited_for() -> None:
    led = ledger()
    led.issue("a", "i1", want(2), 0.0)
    led.carried(0, "a", "i1", [0])  # taken into a round of fragment 0, then dropped (full queue)
    led.carried(0, "a", "i1", [1])
    led.round_closed(0, [("a", "i1", [1])])  # a later push of fragment 0 merged: unit 0's is gone
    led.carried(1, "a", "i1", [0, 1])
    led.round_closed(1, [("a", "i1", [0, 1])])
    assert led.closed[0] == [1, 1] and not led.open  # unit 1 merged, unit 0 partly (fragment 1)


def test_a_unit_whose_push_waits_in_a_round_when_its_learner_dies_is_settled_by_that_round() -> None:
    led = ledger()
    led.issue("a", "i1", want(1), 0.0)
    led.carried(0, "a", "i1", [0])
    ended = led.ended("a", keep="i2")
    assert not ended.requeued and not ended.partial and 0 in led.open  # its push of 0 is still in a round
    led.round_closed(0, [("a", "i1", [0])])  # that round merged it: the old incarnation's work counts
    assert led.closed[0] == [0, 1] and not led.open and not led.requeue


def test_a_round_that_merges_a_unit_someone_else_now_holds_does_not_count_it() -> None:
    led = ledger()
    led.issue("a", "i1", want(1), 0.0)
    led.ended("a", keep="i2")
    assert led.issue("b", "i1", want(1), 1.0) == [0]
    led.round_closed(0, [("a", "i1", [0])])
    assert led.counters["stale_merges"] == 1 and led.open[0].merged == set()


def test_a_learner_with_other_data_is_refused() -> None:
    led = ledger()
    with pytest.raises(DataMismatch, match="every learner must read the same data"):
        led.adopt({**DATA, "digest": "other"})
    with pytest.raises(DataMismatch, match="nothing to hand out"):
        DataLedger((0,)).adopt({**DATA, "sequences": 0})


def test_a_restored_ledger_takes_back_the_hands_and_loses_what_merged_after_the_checkpoint() -> None:
    led = ledger()
    led.issue("a", "i1", want(2), 0.0)  # 0, 1 at the checkpoint
    saved = led.state_dict()
    led.issue("a", "i1", want(2, received=2), 0.5)  # 2, 3 issued after it
    again = DataLedger((0, 1))
    again.load_state_dict(saved, now=10.0, hold_s=10.0)
    assert again.issue("b", "i1", want(2), 10.1) == []  # holders report first
    # a still holds 1 and 3; unit 0 it pushed everywhere (merged after the checkpoint: lost)
    drop, ended = again.hello("a", "i1", {**DATA, "hand": [1, 3]}, 10.2)
    assert drop == [] and ended.requeued == [0]
    assert again.open[3].learner == "a"
    # the hold is over (a was the only holder): unit 2, issued after the checkpoint and held by
    # nobody, goes back to the queue; the cursor moves past 3
    assert again.issue("b", "i1", want(3), 10.3) == [0, 2, 4]
    assert again.snapshot()["lost"] == 2


def test_a_hand_that_names_another_learners_unit_is_told_to_drop_it() -> None:
    led = ledger()
    led.issue("a", "i1", want(1), 0.0)
    drop, _ = led.hello("b", "i1", {**DATA, "hand": [0, 7]}, 1.0)
    assert drop == [0, 7]


def test_an_epoch_ends_when_every_unit_is_closed_and_the_next_one_goes_on() -> None:
    led = ledger(fragments=(0,))
    uids = led.issue("a", "i1", want(10), 0.0)
    assert uids == list(range(10)) and not led.epoch_done(0)
    merge_all(led, "a", "i1", uids)
    assert led.epoch_done(0)
    assert led.issue("a", "i1", want(1, received=10), 1.0) == [10]  # epoch 2's first unit
    assert led.snapshot()["epoch"] == 2 and led.snapshot()["epochs_done"] == 1


def test_a_remainder_carried_to_the_next_round_keeps_its_incarnation() -> None:
    q = quant.quantize(torch.zeros(8), "none", 8)
    c = Contribution("a", q, 8, 64, 1.0, 0.1, 0, 0.0, 0, backlog=0.5, units=[3], incarnation="i7")
    rest = c.remainder(1.0)
    assert rest is not None and rest.incarnation == "i7" and rest.units == []


def test_every_learner_computes_the_same_units_and_an_epoch_covers_each_sequence_once() -> None:
    plan = UnitPlan(sequences=1003, unit_sequences=50, seq_len=16, seed=5)
    for epoch in (0, 1):
        seen = np.concatenate([plan.sequences_of(epoch * plan.count + i) for i in range(plan.count)])
        assert sorted(seen.tolist()) == list(range(1003))
    assert not np.array_equal(plan.sequences_of(0), plan.sequences_of(plan.count))  # epochs differ
    again = UnitPlan(sequences=1003, unit_sequences=50, seq_len=16, seed=5)
    assert np.array_equal(plan.sequences_of(7), again.sequences_of(7))
    assert plan.tokens_of(plan.count - 1) == 3 * 16  # the short last unit


def test_the_feed_gives_batches_across_units_and_reports_the_units_finished() -> None:
    feed = UnitFeed()
    feed.configure(sequences=100, seq_len=8, unit_sequences=10, seed=0, digest="d")
    assert feed.take(4) is None  # nothing in hand: the caller trains off the ledger
    feed.add([0, 1])
    assert feed.want(tokens_per_s=1.0) == 0 and feed.want(tokens_per_s=8 * 10 * 10) == 30 - 2  # 3 s at 10 units/s
    assert feed.want() == 8 - 2  # its pace not known yet
    first = feed.take(6)
    second = feed.take(6)
    assert first is not None and second is not None
    assert np.array_equal(np.concatenate([first, second])[:10], feed.plan.sequences_of(0))
    assert feed.completed() == [0] and feed.completed() == []
    assert feed.hand() == [1]
    feed.drop([1])
    assert feed.hand() == [] and feed.meta()["received"] == 2


def test_the_automatic_unit_is_one_fragments_sync_period_at_the_runs_batch() -> None:
    assert unit_size({"batch_size": 16, "H": 64, "fragments": 4}) == 256
    assert unit_size({"batch_size": 16, "H": 64, "fragments": 4, "unit_sequences": 7}) == 7


def test_a_restored_ledger_moves_its_cursor_past_every_unit_a_learner_was_handed() -> None:
    led = ledger()
    saved = led.state_dict()  # nothing issued at the checkpoint
    led.issue("a", "i1", want(3), 0.0)  # 0, 1, 2 issued after it, trained, pushed: lost with the syncer
    again = DataLedger((0, 1))
    again.load_state_dict(saved, now=10.0, hold_s=10.0, known={"a", "b"})
    again.hello("a", "i1", {**DATA, "hand": [], "beyond": 3}, 10.1)
    assert again.issue("a", "i1", want(1), 10.2) == []  # b has not said hello yet
    again.hello("b", "i1", {**DATA, "hand": []}, 10.3)
    assert again.issue("b", "i1", want(4), 10.4) == [0, 1, 2, 3]  # named as lost, then the cursor
    assert again.requeued_now == [("syncer", 0), ("syncer", 1), ("syncer", 2)]


def test_a_push_that_died_with_the_syncer_is_missed_so_the_unit_still_closes() -> None:
    led = ledger()
    led.issue("a", "i1", want(1), 0.0)
    saved = led.state_dict()  # unit 0 issued, nothing pushed yet
    again = DataLedger((0, 1))
    again.load_state_dict(saved, now=10.0, hold_s=10.0, known={"a"})
    # a finished unit 0 and pushed it on fragment 0 to the syncer that died; fragment 1 is still due
    again.hello("a", "i1", {**DATA, "hand": [0], "pushed": {0: [0]}}, 10.1)
    assert again.open[0].missed == {0}
    again.carried(1, "a", "i1", [0])
    again.round_closed(1, [("a", "i1", [0])])
    assert not again.open and again.closed[0] == [0, 1]  # partly merged: the epoch can end


def test_the_desk_checks_what_a_learner_says_of_its_data_and_names_every_epoch_that_ends() -> None:
    from syncer.datadesk import DataDesk, data_meta
    from syncer.globalmodel import Outbox
    from syncer.wire.protocol import ProtocolError

    with pytest.raises(ProtocolError):
        data_meta({"data": {**DATA, "pushed": [[1, "x"]]}}, "heartbeat")
    with pytest.raises(ProtocolError):
        data_meta({"data": {**DATA, "hand": [-1]}}, "heartbeat")
    assert data_meta({"data": {**DATA, "pushed": [[3, [0, 2]]]}}, "hello")["pushed"] == {3: [0, 2]}
    desk = DataDesk(on=True)
    desk.ledger.fragments = (0,)
    out = Outbox()
    assert desk.hello("a", "i1", True, {"data": {**DATA, "want": 10}}, 0.0, out) is None
    (units,) = [m for _, m in out.sends if m.kind == "units"]
    assert units["units"] == list(range(10))
    desk.ledger.carried(0, "a", "i1", list(range(9)))
    desk.ledger.round_closed(0, [("a", "i1", list(range(9)))])
    out = Outbox()
    desk.left("a", 1.0, out)  # its last unit, never trained, back to the queue; nothing else open
    assert [e["kind"] for e in out.events] == ["units_requeued"]
    desk.hello("b", "i1", False, {"data": {**DATA, "want": 1}}, 2.0, Outbox())
    desk.ledger.carried(0, "b", "i1", [9])
    out = Outbox()
    desk.ledger.round_closed(0, [("b", "i1", [9])])
    desk.settled(3.0, out)
    assert [e["kind"] for e in out.events] == ["epoch_done"] and "epoch 1 merged: 10 units" in out.events[0]["detail"]
