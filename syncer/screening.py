"""The syncer's screen: every contribution judged before a round merges it, and learners that keep
failing quarantined (docs/algorithm.md, "Judging contributions").

Pure, as the rest of the core: what must be said goes into the `Outbox`. `Screen.screen` takes a
closing round's contributions and its whole-fragment Gram matrix, asks the judge
(syncer/judge.py), records each verdict with the quarantine (syncer/quarantine.py) and returns
the contributions that may be merged. A rejected one is counted and its learner told to reload
the fragment (`resync`): what it pushed came from a local state that is wrong. A learner it
quarantines is told so (`quarantine`: it restarts from the global state and waits the rest out),
its pushes are refused until it is released, and it does not count as live for quorum or round
closing meanwhile.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np

from syncer.globalmodel import Outbox
from syncer.judge import Judge, Verdict
from syncer.quarantine import WINDOW, Quarantine
from syncer.rounds import Contribution
from syncer.wire.protocol import Message

WHOLE = 0.5  # a contribution of at least this share of its learner's sync period is judged by direction
STALE = 1  # ... from a base at most this many versions old


class Screen:
    def __init__(self, size: float, agree: float, strikes: int, base_s: float, period: float = 0.0) -> None:
        self.judge = Judge(size, agree)
        self.min_steps = WHOLE * period  # inner steps a contribution needs to be judged by direction (of H)
        self.quarantine = Quarantine(strikes, base_s)
        self.counters: collections.Counter[str] = collections.Counter()
        self._said: set[str] = set()  # learners whose first rejection since their last quarantine was an event
        self.last: dict[str, list[float | None]] = {}  # the last round's [size, agreement, regular, signal]
        self.pushed: dict[str, tuple[str, set[int]]] = {}  # learner -> (incarnation, fragments it contributed to)

    @property
    def on(self) -> bool:
        return self.judge.size > 0 or self.judge.agree > 0

    def screen(
        self,
        p: int,
        contribs: Sequence[Contribution],
        gram: np.ndarray,
        backlog: Sequence[float],
        parts: Sequence[float],
        shape: tuple[int, int],
        now: float,
        out: Outbox,
    ) -> list[Contribution]:
        """The contributions the judge accepts; the rejected ones counted, told and recorded. A
        learner quarantined since it pushed is left out unjudged (what it pushed came before).
        `shape`: the fragment's values and current version."""
        numel, version = shape
        shut = self.shut_out(now)
        if shut & {c.learner for c in contribs}:
            index = [i for i, c in enumerate(contribs) if c.learner not in shut]
            self.counters["refused_pushes"] += len(contribs) - len(index)
            contribs, gram = [contribs[i] for i in index], gram[np.ix_(index, index)]
            backlog, parts = [backlog[i] for i in index], [parts[i] for i in index]
        learners, suspects = [c.learner for c in contribs], self.quarantine.suspects(now)
        whole = [self._regular(c, p, part, b, version) for c, part, b in zip(contribs, parts, backlog)]
        verdicts = self.judge.judge(p, learners, gram, backlog, suspects, numel, whole)
        self.last = {
            v.learner: [_rounded(v.size), _rounded(v.agree), int(w), _rounded(v.signal)]
            for v, w in zip(verdicts, whole)
        }
        kept = []
        for c, v in zip(contribs, verdicts):
            if v.ok:
                kept.append(c)
            else:
                self._rejected(p, c, v, numel, now, out)
            self.counters["judged"] += 1
            if seconds := self.quarantine.record(c.learner, v.ok, self._why(p, v, numel), now, v.signal):
                self._quarantined(c.learner, seconds, now, out)
        return kept

    def _regular(self, c: Contribution, p: int, part: float, backlog: float, version: int) -> bool:
        """Whether c is judged by direction: at least half a sync period of its own and half of H's
        steps (on the syncer's clock a learner 6x slower than the fleet pushes a step or two a
        period: one minibatch's noise, which quarantined a slowed learner of the test fleet), at
        most max_backlog of them, fresh (its base at most one version old), pushed (not the
        carried rest of a backlog), and not its learner process's first on p (unless that learner
        was quarantined before: a bad one's first after each restart was merged). The others are
        mostly noise, or point where the model was, not where it is (measured: a partitioned or
        paused learner's contributions, the rest carried after them, a joiner's first;
        docs/algorithm.md)."""
        fresh = version - c.base_version <= STALE and c.seq >= 0
        before = self._before(c, p) or self.quarantine.watched(c.learner)  # a quarantined one's first too
        return before and part >= WHOLE and c.c_steps >= self.min_steps and backlog >= 1.0 and fresh

    def _before(self, c: Contribution, p: int) -> bool:
        """Whether c's learner incarnation contributed to fragment p before (its first one after a
        join is judged by size only: a fresh optimizer's first steps are mostly noise)."""
        incarnation, seen = self.pushed.get(c.learner, ("", set()))
        if incarnation != c.incarnation:
            incarnation, seen = self.pushed[c.learner] = (c.incarnation, set())
        known = p in seen
        seen.add(p)
        return known

    def _why(self, p: int, v: Verdict, numel: int) -> str:
        return "" if v.ok else f"fragment {p}: {v.describe(self.judge.typical(p), self.judge.bound(p, numel))}"

    def _rejected(self, p: int, c: Contribution, v: Verdict, numel: int, now: float, out: Outbox) -> None:
        self.counters[f"rejected_{v.reason}"] += 1
        out.send(c.learner, Message("resync", {"fragment": p, "reason": f"contribution rejected ({v.reason})"}))
        if c.learner not in self._said:
            self._said.add(c.learner)
            out.event(
                now,
                "contribution_rejected",
                c.learner,
                f"{self._why(p, v, numel)}; {c.c_steps} steps, {c.c_tokens} tokens not merged "
                "(further rejections counted)",
            )

    def _quarantined(self, learner: str, seconds: float, now: float, out: Outbox) -> None:
        rec = self.quarantine.records[learner]
        self.counters["quarantines"] += 1
        self._said.discard(learner)
        reason = f"{rec.reason}; {rec.rejected} of its contributions rejected so far"
        detail = (
            f"{seconds:.0f} s (quarantine {rec.level}): {reason}; its pushes are refused, "
            "it restarts from the global state, then probation"
        )
        out.event(now, "quarantined", learner, detail)
        out.send(learner, Message("quarantine", {"seconds": seconds, "reason": reason[:300]}))

    def refuses(self, learner: str, now: float) -> bool:
        """Whether a push of `learner` is refused now (counted)."""
        if self.quarantine.remaining(learner, now) <= 0:
            return False
        self.counters["refused_pushes"] += 1
        return True

    def shut_out(self, now: float) -> set[str]:
        """Learners quarantined now: not live for quorum and round closing."""
        return {lid for lid in self.quarantine.records if self.quarantine.remaining(lid, now) > 0}

    def released(self, now: float, out: Outbox) -> None:
        """Say once when a learner's quarantine is over (it is on probation now)."""
        for lid, rec in self.quarantine.records.items():
            if rec.until and rec.until <= now:
                rec.until = 0.0
                detail = f"quarantine over; its next {WINDOW} contributions on probation"
                out.event(now, "probation", lid, detail)

    def snapshot(self, now: float) -> dict[str, Any]:
        """For status: the counters and every learner with a rejection."""
        return {**dict(self.counters), "learners": self.quarantine.snapshot(now)}

    def state_dict(self, now: float) -> dict[str, Any]:
        return {"judge": self.judge.state_dict(), "quarantine": self.quarantine.state_dict(now)}

    def load_state_dict(self, state: dict[str, Any], now: float) -> None:
        self.judge.load_state_dict(state.get("judge") or {})
        self.quarantine.load_state_dict(state.get("quarantine") or {}, now)


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
