"""The parts SyncerCore composes (syncer/core.py), each driven on its own: admission, push
checks, the round book, the outer step and the accounting. Real settings, real contributions."""

from __future__ import annotations

import collections

import torch

from syncer.accounting import Accounting, ClosedRound
from syncer.admission import Admission
from syncer.fleet import Ledger
from syncer.globalmodel import Outbox
from syncer.outerstep import OuterStep
from syncer.pushcheck import PushChecks
from syncer.roundbook import MISSED_ROUNDS, RoundBook
from syncer.rounds import Contribution, GraceFn, Round
from syncer.screening import Screen
from syncer.wire import fragments, quant
from syncer.wire.protocol import Message
from tests.unit.coreharness import RUN, Harness, make_settings, rounds_of, small_manifest, wire


def _hello(
    run: str = RUN,
    count: int = 2,
    manifest: list[fragments.TensorSpec] | None = None,
    codecs: tuple[str, ...] = ("int4",),
) -> Message:
    meta = {"run": run, "fragments": count, "manifest": fragments.manifest_to_json(manifest or small_manifest())}
    return Message("hello", {**meta, "codecs": list(codecs)})


def test_admission_refuses_another_run_another_model_and_a_model_that_does_not_fit() -> None:
    adm = Admission(RUN, 2)
    assert adm.check(_hello(), None, 0, 1)[1] is None
    assert adm.check(_hello(run="other"), None, 0, 1)[1] == ("wrong_run", f"this syncer serves run {RUN}, not other")
    assert adm.check(_hello(count=3), None, 0, 1)[1][0] == "manifest"  # type: ignore[index]
    adm.memory_free = (100, "MemAvailable")  # less than the model's three vectors
    reason, detail = adm.check(_hello(), None, 0, 1)[1]  # type: ignore[misc]
    assert reason == "manifest" and "MemAvailable" in detail


def test_admission_refuses_a_learner_that_cannot_decode_the_runs_updates() -> None:
    """An older learner (no topk decoder) joining a topk run is told why, not fed blobs it refuses."""
    adm = Admission(RUN, 2, "topk")
    assert adm.check(_hello(codecs=("none", "bf16", "int8", "int4", "2bit", "topk")), None, 0, 1)[1] is None
    reason, detail = adm.check(_hello(codecs=("int8", "int4")), None, 0, 1)[1]  # type: ignore[misc]
    assert reason == "codec" and "topk" in detail and "int8, int4" in detail


def test_admission_takes_the_init_upload_from_its_owner_only() -> None:
    adm, manifest = Admission(RUN, 2), small_manifest()
    plan = fragments.plan(manifest, 2)
    fleet = Ledger(["a", "b"], 3.0, 0.0)
    assert adm.may_upload("a", fleet, 3.0, 0.0)
    adm.start_upload("a", manifest, plan.sizes())
    values = [torch.arange(n, dtype=torch.float32) for n in plan.sizes()]

    def chunk(p: int) -> Message:
        n = values[p].numel()
        meta = {"fragment": p, "offset": 0, "numel": n, "total": n}
        return wire(Message("init", meta, [values[p].numpy().tobytes()]))

    assert adm.chunk("b", chunk(0), None) is None, "not the owner"
    assert adm.chunk("a", chunk(0), None) is False and adm.chunk("a", chunk(1), None) is True
    got_manifest, buffers = adm.take()
    assert got_manifest == manifest and all(torch.equal(b, v) for b, v in zip(buffers, values))


def _push(seq: int, base: int = 0, epoch: int = 1) -> Message:
    return Message("push", {"seq": seq, "epoch": epoch, "base_version": base})


def test_push_checks_refuse_replays_and_versions_from_the_future() -> None:
    checks = PushChecks(collections.Counter())
    assert checks.problem("a", "i1", 0, _push(1), 1, 0) is None
    assert checks.problem("a", "i1", 0, _push(1), 1, 0) == ("replay", "push seq 1 after 1")
    assert checks.problem("a", "i2", 0, _push(1), 1, 0) is None, "a new incarnation counts again"
    assert checks.problem("a", "i1", 0, _push(2, base=3), 1, 2)[0] == "future_version"  # type: ignore[index]
    assert checks.problem("a", "i1", 0, _push(2, base=3, epoch=0), 1, 2) is None, "another epoch's versions"


def test_push_checks_keep_a_stopping_learners_last_windows_out_with_one_event() -> None:
    counters: collections.Counter[str] = collections.Counter()
    checks, out = PushChecks(counters), Outbox()
    checks.keep_out("a", 100, 1.0, out)
    checks.keep_out("a", 50, 1.0, out)
    assert [e["kind"] for e in out.events] == ["last_windows_kept_out"]
    assert counters["last_tokens_kept_out"] == 150 and counters["kept_out:a"] == 2


def _contribution(learner: str, now: float, numel: int = 8) -> Contribution:
    q = quant.quantize(torch.ones(numel), "int8")
    meta = {"c_steps": 8, "c_tokens": 128, "c_time": 8.0, "step_time": 1.0, "base_version": 0, "seq": 1}
    return Contribution.of_push(learner, "i1", q, meta, now, 10, [])


def test_the_round_book_bounds_its_queue_and_counts_who_missed_a_round() -> None:
    s = make_settings(quorum=2, max_queue=2)
    counters: collections.Counter[str] = collections.Counter()
    book, out = RoundBook(s, counters), Outbox()
    book.add(_contribution("a", 1.0), 0, None)
    book.add(_contribution("b", 2.0), 1, None)
    book.add(_contribution("c", 3.0), 1, None)
    book.bound(3.0, out)
    assert counters["dropped_pushes"] == 1 and [e["kind"] for e in out.events] == ["drop"]
    closing = list(book.ready(100.0, {"a", "b", "c"}))
    assert [r.fragment for r in closing] == [1] and book.missed == {"a": 1, "b": 0, "c": 0}
    book.closed(1, list(closing[0].contributions.values()))
    assert [p for p, _ in book.take_unsettled()] == [1] and book.take_unsettled() == []
    assert MISSED_ROUNDS >= 1


def test_the_outer_step_alone_publishes_what_the_core_publishes_and_keeps_no_share() -> None:
    """Two identical harnesses: one closes its round through the core, the other hands the same
    round to a fresh OuterStep of its own. The same bits, the same period share."""
    s = make_settings(merge="rda", robust_clip=2.0)
    runs = [Harness(s), Harness(s)]
    for h in runs:
        h.join_all()
        for i, lid in enumerate(("a", "b", "c")):
            h.push(lid, 0, h.delta(0, seed=i), now=2.0)
    core_out = runs[0].tick(2.5)
    alone = runs[1].core
    assert alone.model is not None
    rnd: Round = alone.rounds[0]
    outer = OuterStep(s, alone.fleet, alone.round_clock, Screen(2, 0.5, 3, 60.0, s.H), collections.Counter())
    out = Outbox()
    ranked = sorted(rnd.contributions.values(), key=lambda c: c.learner)
    contribs, grams = outer.screened(0, ranked, alone.model, None, 2.5, out)
    outer.cap_backlogs(0, contribs, 2.5, out)
    step = outer.step(0, contribs, alone.model, None, 2.5, grams, want_crc=True)
    assert runs[0].core.model is not None
    assert torch.equal(alone.model.theta[0], runs[0].core.model.theta[0]), "bit-exact"
    assert step.crc == runs[0].core.model.crc(0)
    assert rounds_of(core_out)[0]["period_share"] == round(step.share, 4)
    assert set(vars(outer)) == {"s", "fleet", "round_clock", "screen", "counters", "norm_history", "backlogged"}


def test_accounting_counts_a_round_and_a_checkpoint() -> None:
    acct, out = Accounting(0.0), Outbox()
    fleet = Ledger(["a"], 3.0, 0.0)
    rnd = Round(0)
    c = _contribution("a", 1.0)
    rnd.add(c, 1, GraceFn(0.5, 2, 0.0))
    acct.round_closed(ClosedRound(rnd, [c], 1, 2, 100, 0.5, 1.0, None), fleet, 1, 2.0, out)
    acct.round_closed(ClosedRound(rnd, [c], 2, 2, 100, 0.5, 1.0, None), fleet, 1, 3.0, out)
    assert acct.outer_steps == 2 and acct.since_checkpoint == 2 and acct.checkpoint_due(2)
    assert acct.t_sync is not None and [m["version"] for m in out.metrics] == [1, 2]
    acct.checkpoint_written(1)
    assert acct.since_checkpoint == 1 and acct.checkpoint_outer_step == 1 and not acct.checkpoint_due(2)
    acct.reject("replay", "a", "push seq 1 after 1", 4.0, out)
    assert acct.rejected == {"replay": 1} and out.events[-1]["detail"] == "replay: push seq 1 after 1"
