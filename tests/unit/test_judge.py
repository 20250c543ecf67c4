"""Judging contributions and quarantining learners (syncer/judge.py, syncer/quarantine.py,
syncer/screening.py), alone and wired into a real SyncerCore."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import numpy as np
import pytest
import torch

from syncer import checkpoint
from syncer.core import SyncerCore
from syncer.judge import WARMUP, Judge
from syncer.quarantine import RECORD, SIGNAL_MIN, WINDOW, Quarantine
from syncer.rounds import Contribution
from syncer.screening import Screen
from tests.unit.coreharness import Harness, events_of, make_settings, rounds_of, sent_of, tensor_manifest

N = 4096


def honest(seed: int, count: int, shared: torch.Tensor, spread: float = 1.0) -> list[torch.Tensor]:
    """Outer gradients that share a direction (pairwise cosine ~ 1 / (1 + spread^2) = 0.5)."""
    g = torch.Generator().manual_seed(seed)
    return [shared + spread * torch.randn(len(shared), generator=g) for _ in range(count)]


def gram(vectors: list[torch.Tensor]) -> np.ndarray:
    v = torch.stack(vectors).double()
    return (v @ v.t()).numpy()


def warm(judge: Judge, shared: torch.Tensor, rounds: int = WARMUP) -> None:
    for r in range(rounds):
        verdicts = judge.judge(0, ["a", "b", "c"], gram(honest(100 + r, 3, shared)), [1.0] * 3, set(), N, [True] * 3)
        assert all(v.ok for v in verdicts)


@pytest.mark.parametrize("bad", ["signflip", "noise", "scale", "bitflip"])
def test_the_judge_rejects_each_kind_of_bad_contribution_and_only_it(bad: str) -> None:
    shared = torch.randn(N, generator=torch.Generator().manual_seed(0))
    judge = Judge()
    warm(judge, shared)
    a, b, c = honest(7, 3, shared)
    if bad == "signflip":
        c = -c
    elif bad == "noise":
        c = torch.randn(N, generator=torch.Generator().manual_seed(9)) * c.norm() / N**0.5
    elif bad == "scale":
        c = c * 1e3
    else:  # one exponent bit: a value 2^64 times larger
        c = c.clone()
        c[5] *= 2.0**64
    verdicts = judge.judge(0, ["a", "b", "c"], gram([a, b, c]), [1.0] * 3, set(), N, [True] * 3)
    if bad == "noise":  # as aligned as noise, as an honest one now and then: the learner's record judges it
        assert all(v.ok for v in verdicts) and verdicts[2].signal is not None and abs(verdicts[2].signal) < 0.1
        assert all(v.signal is None for v in verdicts[:2])  # their others (one with the noise) do not agree
        return
    assert [v.ok for v in verdicts] == [True, True, False]
    assert verdicts[2].reason == ("size" if bad in ("scale", "bitflip") else "direction")
    assert verdicts[2].describe(judge.typical(0), judge.bound(0, N))  # the numbers that condemned it


def test_honest_contributions_of_every_size_the_fleet_makes_are_accepted() -> None:
    """A slow learner's half period, a backlog capped to 2 periods, a fresh joiner's few steps."""
    shared = torch.randn(N, generator=torch.Generator().manual_seed(0))
    judge = Judge()
    warm(judge, shared)
    a, b, c, d = honest(11, 4, shared)
    verdicts = judge.judge(
        0, list("abcd"), gram([a, 0.5 * b, 4.0 * c, 0.05 * d]), [1.0, 1.0, 0.5, 1.0], set(), N, [True] * 4
    )
    assert all(v.ok for v in verdicts), verdicts


def test_a_round_of_two_rejects_only_a_learner_with_recent_rejections() -> None:
    shared = torch.randn(N, generator=torch.Generator().manual_seed(0))
    judge = Judge()
    warm(judge, shared)
    a, b = honest(13, 2, shared)
    assert all(v.ok for v in judge.judge(0, ["a", "b"], gram([a, -b]), [1.0, 1.0], set(), N, [True] * 2))  # cannot tell
    verdicts = judge.judge(0, ["a", "b"], gram([a, -b]), [1.0, 1.0], {"b"}, N, [True] * 2)
    assert [v.ok for v in verdicts] == [True, False]


def test_no_direction_test_where_honest_learners_do_not_agree() -> None:
    """Independent directions (typical cosine ~0): the test says nothing, nothing is rejected."""
    judge = Judge()
    g = torch.Generator().manual_seed(3)
    for _ in range(WARMUP + 4):
        vectors = [torch.randn(N, generator=g) for _ in range(3)]
        assert all(v.ok for v in judge.judge(0, ["a", "b", "c"], gram(vectors), [1.0] * 3, set(), N, [True] * 3))
    assert judge.bound(0, N) is None


def cosines(pairs: float, last: float, m: int = 4) -> np.ndarray:
    """A round's Gram matrix of unit vectors: the first m - 1 agree at `pairs` among themselves,
    the last one at `last` with each of them."""
    g = np.full((m, m), pairs)
    g[-1, :], g[:, -1] = last, last
    np.fill_diagonal(g, 1.0)
    return g


@pytest.mark.parametrize(
    "pairs, last, rejected",
    [
        (0.1, -0.03, False),  # less aligned than the others this round, even negative: honest now and then
        (0.1, 0.0, False),  # as aligned as noise: the record judges it
        (0.1, -0.08, True),  # against the others, almost as much as they agree: a flipped sign
        (0.02, -0.05, False),  # the others barely agree (a fleet near its plateau): direction says nothing
    ],
)
def test_direction_is_judged_against_how_much_the_round_agrees(pairs: float, last: float, rejected: bool) -> None:
    """The test fleet's failure: on a fragment whose typical cosine was 0.1, honest learners read
    0.3x a fixed noise bound over 8 contributions when the whole fleet agreed less for a while,
    and were quarantined. A contribution is judged against the round's others now."""
    n = 30_000  # a gpt-tiny fragment: noise bound 0.017
    verdicts = Judge().judge(0, list("abcd"), cosines(pairs, last), [1.0] * 4, set(), n, [True] * 4)
    assert [v.ok for v in verdicts] == [True, True, True, not rejected]
    signal = verdicts[3].signal
    if pairs < 0.035:  # below 2 x the bound
        assert signal is None and all(v.signal is None for v in verdicts)
    else:
        assert signal == pytest.approx(last / pairs)


def test_quarantine_after_strikes_doubles_and_probation_is_strict() -> None:
    q = Quarantine(strikes=3, base_s=30.0)
    assert q.record("x", False, "r1", 0.0) == 0.0
    assert q.record("x", True, "", 1.0) == 0.0
    assert q.record("x", False, "r2", 2.0) == 0.0
    assert q.record("x", False, "r3", 3.0) == 30.0
    assert q.remaining("x", 10.0) == pytest.approx(23.0)
    assert q.snapshot(10.0)[0]["state"] == "quarantined"
    assert q.remaining("x", 33.0) == 0.0 and q.snapshot(33.0)[0]["state"] == "probation"
    assert q.record("x", False, "noise?", 40.0) == 0.0  # one rejection on probation may be a restart's noise
    assert q.record("x", False, "again", 41.0) == 60.0  # two are enough
    for t in range(WINDOW):  # released, a whole probation clean
        assert q.record("x", True, "", 200.0 + t) == 0.0
    assert q.snapshot(300.0)[0]["state"] == "admitted"
    for t in range(SIGNAL_MIN):  # noise, however large: it does not move with the others, consistently
        seconds = q.record("y", True, "", 500.0 + t, signal=0.05 if t % 2 else -0.04)
    assert seconds == 30.0 and "move with the others'" in q.records["y"].reason
    assert q.remaining("y", 600.0) == 0.0
    assert q.record("y", True, "", 600.0, signal=0.5) == 0.0, "released: its record starts anew"
    for t in range(SIGNAL_MIN):  # cured by its restart: a fresh optimizer's first signals are low, then honest
        assert q.record("y", True, "", 601.0 + t, signal=0.1 if t < 2 else 0.9) == 0.0
    for t in range(RECORD * 3):  # an honest learner: one as aligned as noise now and then
        assert q.record("z", True, "", 600.0 + t, signal=0.0 if t % 5 == 0 else 1.2) == 0.0
    for t in range(RECORD * 3):  # ... or a stretch of low agreement that is not consistently low
        assert q.record("w", True, "", 700.0 + t, signal=(-0.4, 0.1, 0.9, 0.2)[t % 4]) == 0.0
    restored = Quarantine(3, 30.0)
    restored.load_state_dict(q.state_dict(50.0), 1000.0)
    assert restored.records["x"].level == 2


# -- wired into the core -----------------------------------------------------------------------


def push_round(h: Harness, p: int, vectors: dict[str, torch.Tensor], now: float) -> list:
    for lid, v in vectors.items():
        h.push(lid, p, v, now=now)
    return [h.tick(now)]


def test_a_learner_pushing_flipped_signs_is_rejected_quarantined_refused_and_readmitted() -> None:
    h = Harness(make_settings(quorum=2, compression="none", quarantine_s=30.0, max_queue=1024))
    h.join_all()
    shared = torch.randn(h.plan.numel(0), generator=torch.Generator().manual_seed(0)) * 1e-3
    now = 2.0
    for r in range(WARMUP + 1):  # a learner's first contribution to a fragment is judged by size only
        a, b, c = honest(r, 3, shared, spread=1e-3)
        h.beat_all(now)
        push_round(h, 0, {"a": a, "b": b, "c": c}, now)
        now += 1.0
    outs = []
    for r in range(3):  # c goes bad: three rejections quarantine it
        a, b, c = honest(50 + r, 3, shared, spread=1e-3)
        h.beat_all(now)
        outs.append(h.push("c", 0, -c, now=now))
        outs += push_round(h, 0, {"a": a, "b": b}, now)
        now += 1.0
    rounds = [m for o in outs for m in rounds_of(o)]
    assert [sorted(m["contributors"]) for m in rounds] == [["a", "b"]] * 3
    assert all(m["judged"]["c"][1] < 0 for m in rounds)
    events = [e for o in outs for e in o.events]
    assert [e["kind"] for e in events if e["target"] == "c"] == ["contribution_rejected", "quarantined"]
    assert [m.meta["reason"] for o in outs for to, m in sent_of(o, "resync") if to == ["c"]]
    assert [m.meta["seconds"] for o in outs for to, m in sent_of(o, "quarantine") if to == ["c"]] == [30.0]
    before = h.core.model.versions[0]
    h.beat_all(now)
    h.push("c", 0, honest(99, 1, shared, 1e-3)[0], now=now)  # refused while quarantined
    assert h.core.screen.counters["refused_pushes"] == 1 and not h.core.rounds.get(0)
    assert "c" not in h.core.fleet.live(now) - h.core.screen.shut_out(now)
    welcome = sent_of(h.hello("c", now), "welcome")[0][1]
    assert 0 < welcome.meta["quarantine_s"] <= 30.0
    state = checkpoint.state_dict(h.core, now)
    later = now + 31.0
    h.beat_all(later)
    assert [e["kind"] for e in events_of(h.tick(later), "probation")] == ["probation"]
    a, b, c = honest(77, 3, shared, spread=1e-3)
    out = push_round(h, 0, {"a": a, "b": b, "c": c}, later)[0]
    assert sorted(rounds_of(out)[0]["contributors"]) == ["a", "b", "c"] and h.core.model.versions[0] == before + 1
    fresh = SyncerCore(h.s, h.core.run_id, ["a", "b", "c"], now=now)
    checkpoint.restore(fresh, state, now)
    assert fresh.screen.quarantine.remaining("c", now) > 0 and fresh.screen.judge.typical(0) is not None


def test_a_round_whose_every_contribution_is_rejected_publishes_nothing() -> None:
    h = Harness(make_settings(quorum=1, compression="none", max_queue=1024), declared=("a",))
    h.join_all(("a",))
    shared = torch.randn(h.plan.numel(0), generator=torch.Generator().manual_seed(0)) * 1e-3
    for r in range(WARMUP + 1):  # a learner's first contribution to a fragment is judged by size only
        h.beat_all(2.0 + r)
        push_round(h, 0, {"a": honest(r, 1, shared, 1e-3)[0]}, 2.0 + r)
    version, theta = h.core.model.versions[0], h.core.model.theta[0].clone()
    out = push_round(h, 0, {"a": shared * 1e4}, 10.0)[0]
    assert not rounds_of(out) and h.core.model.versions[0] == version
    assert torch.equal(h.core.model.theta[0], theta)
    assert h.core.screen.counters["rejected_size"] == 1


def test_a_joiners_first_steps_are_not_judged_by_direction_nor_judge_the_others() -> None:
    """A contribution of a step or two is mostly one minibatch's noise (cosine ~0 with the others,
    measured on a real fleet): it is judged by size only, and left out of the others' agreement."""
    shared = torch.randn(N, generator=torch.Generator().manual_seed(0))
    judge = Judge()
    warm(judge, shared)
    a, b = honest(17, 2, shared)
    first = torch.randn(N, generator=torch.Generator().manual_seed(5)) * 0.1
    whole = [True, True, False]
    verdicts = judge.judge(0, ["a", "b", "c"], gram([a, b, first]), [1.0] * 3, set(), N, whole)
    assert all(v.ok for v in verdicts) and verdicts[2].agree is None
    verdicts = judge.judge(0, ["a", "b", "c"], gram([a, b, first]), [1.0] * 3, set(), N, [True] * 3)
    assert verdicts[2].signal is not None and verdicts[2].signal < 1  # claimed as a whole period: noise


def test_a_learner_sending_noise_is_merged_at_first_then_quarantined_by_its_record() -> None:
    """On gpt-tiny's fragments (a noise bound of 3 / sqrt(n) well below the honest cosine)."""
    h = Harness(make_settings(quorum=2, compression="none", max_queue=1024), manifest=tensor_manifest())
    h.join_all()
    shared = torch.randn(h.plan.numel(0), generator=torch.Generator().manual_seed(0)) * 1e-3
    now, quarantined_at = 2.0, None
    for r in range(WARMUP + 1 + RECORD + 2):
        a, b, c = honest(r, 3, shared, spread=1e-3)
        if r > WARMUP:  # c goes bad: noise of its own norm
            c = torch.randn(len(c), generator=torch.Generator().manual_seed(1000 + r)) * c.norm() / len(c) ** 0.5
        h.beat_all(now)
        outs = push_round(h, 0, {"a": a, "b": b, "c": c}, now)
        if quarantined_at is None and [e for e in events_of(outs[0], "quarantined") if e["target"] == "c"]:
            quarantined_at = r - WARMUP
        now += 1.0
    # its honest record first has to leave the window: at most RECORD bad ones (SIGNAL_MIN from a start)
    assert quarantined_at is not None and quarantined_at <= RECORD, quarantined_at
    assert "move with the others'" in h.core.screen.quarantine.records["c"].reason
    assert set(h.core.screen.quarantine.records) == {"c"} or not any(
        r.level for lid, r in h.core.screen.quarantine.records.items() if lid != "c"
    )


def test_a_quarantined_learners_first_contribution_after_its_restart_is_judged_by_direction() -> None:
    """An honest joiner's first contribution is judged by size only; a learner quarantined before
    gets no such pass (a bad one's first contribution after every restart was merged)."""
    settings = make_settings(quorum=2, compression="none", quarantine_s=5.0, max_queue=1024)
    h = Harness(settings, manifest=tensor_manifest())  # gpt-tiny's fragments: a noise bound well below honest cosines
    h.join_all()
    shared = torch.randn(h.plan.numel(0), generator=torch.Generator().manual_seed(0)) * 1e-3
    now = 2.0
    for r in range(WARMUP + 4):  # c flips its signs after the warm-up: quarantined
        a, b, c = honest(r, 3, shared, spread=1e-3)
        h.beat_all(now)
        push_round(h, 0, {"a": a, "b": b, "c": -c if r > WARMUP else c}, now)
        now += 1.0
    assert h.core.screen.quarantine.watched("c")
    now += 6.0  # released; its new process says hello and pushes its first contribution, flipped
    h.hello("c", now)
    h.beat_all(now)
    a, b, c = honest(90, 3, shared, spread=1e-3)
    out = push_round(h, 0, {"a": a, "b": b, "c": -c}, now)[0]
    assert sorted(rounds_of(out)[0]["contributors"]) == ["a", "b"]


def test_a_learner_slowed_to_a_step_a_period_is_judged_by_size_only() -> None:
    """On the syncer's clock a learner 6x slower than the fleet pushes a step or two a period,
    a whole period of its own: one minibatch's noise (a test fleet's slowed learner read 0.04x the
    others' agreement and was quarantined). Below half of H's steps it is judged by size only."""
    screen = Screen(16.0, 3.0, 3, 30.0, period=8)
    one = Contribution(
        "c", cast(Any, None), 1, 256, 1.0, 6.0, base_version=5, arrived=0.0, nbytes=0, incarnation="x", seq=3
    )
    screen._before(one, 0)  # its process contributed to fragment 0 before
    assert not screen._regular(one, 0, part=1.0, backlog=1.0, version=5)
    assert screen._regular(dataclasses.replace(one, c_steps=4), 0, part=1.0, backlog=1.0, version=5)
