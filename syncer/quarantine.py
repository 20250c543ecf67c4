"""Quarantine: a learner whose contributions keep failing the judge is shut out for a while.

Pure (times passed in, no I/O). Each learner's last `WINDOW` judged contributions are kept; when
`strikes` of them were rejected, or its record says with confidence that it does not move with
the others (the mean of its last `RECORD` signals, its cosine relative to the others' among
themselves, syncer/judge.py, is below `LOW` by two standard errors: it sends noise, however
large, or points against them), the learner is quarantined for `base_s` seconds, doubled each
time it is quarantined again (at most `MAX_S`): its pushes are refused, its process is told to
restart from the global state, and it waits out the rest. Released, it is on probation: two
rejections among its next `WINDOW` judged contributions quarantine it again (a single one may be
the noise of a freshly restarted learner), and its record of signals starts anew. `FORGIVE_S`
without a rejection brings its level back to 0.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

WINDOW = 8  # judged contributions remembered per learner (and the length of a probation)
PROBATION_STRIKES = 2  # rejections on probation that quarantine again
RECORD = 16  # signals remembered per learner
SIGNAL_MIN = 8  # signals before a learner's record is judged
LOW = 0.15  # quarantined when its mean signal is below this by two standard errors: noise's is 0 +- 0.05;
# an honest learner's lowest on the test fleet (kills, restarts, 2 of 4 at half speed) was 0.28
CLIP = 3.0  # each signal clipped to +-this (one round whose others barely agree says little)
MAX_S = 3600.0
FORGIVE_S = 1800.0


@dataclass
class Record:
    """One learner's standing."""

    recent: collections.deque[bool] = field(default_factory=lambda: collections.deque(maxlen=WINDOW))
    signals: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=RECORD))
    level: int = 0  # quarantines so far (since it was last forgiven)
    until: float = 0.0  # quarantined before this time
    probation: int = 0  # judged contributions left on probation
    last_reject: float = 0.0
    rejected: int = 0  # every rejection, for status
    reason: str = ""  # the numbers behind the last quarantine


@dataclass
class Quarantine:
    strikes: int = 3  # rejections among the last WINDOW that quarantine (0: never)
    base_s: float = 30.0
    records: dict[str, Record] = field(default_factory=dict)

    def _of(self, learner: str) -> Record:
        return self.records.setdefault(learner, Record())

    def remaining(self, learner: str, now: float) -> float:
        """Seconds of quarantine left (0: not quarantined)."""
        rec = self.records.get(learner)
        return max(0.0, rec.until - now) if rec is not None else 0.0

    def watched(self, learner: str) -> bool:
        """Whether `learner` was quarantined and is not forgiven yet."""
        rec = self.records.get(learner)
        return rec is not None and rec.level > 0

    def suspects(self, now: float) -> set[str]:
        """Learners with a rejection among their recent contributions (they lose a round of two)."""
        return {lid for lid, rec in self.records.items() if not all(rec.recent) and now - rec.last_reject < FORGIVE_S}

    def record(self, learner: str, ok: bool, reason: str, now: float, signal: float | None = None) -> float:
        """A judged contribution of `learner` (`signal`: its cosine with the others over the noise
        bound, when judged by direction); the seconds of a quarantine it starts (0: none)."""
        rec = self._of(learner)
        if rec.until > now:
            return 0.0  # quarantined: its pushes are not judged
        if rec.level and now - rec.last_reject >= FORGIVE_S:
            rec.level = 0
        rec.recent.append(ok)
        if signal is not None:
            rec.signals.append(max(-CLIP, min(CLIP, signal)))
        on_probation = rec.probation > 0
        rec.probation = max(0, rec.probation - 1)
        if self.strikes > 0 and signal is not None and (low := _low(rec.signals)) is not None:
            reason = (
                f"its contributions move with the others' at {low[0]:.2f}x their agreement among themselves "
                f"(at most {low[1]:.2f}x, last {len(rec.signals)}; honest ~1)"
            )
        elif ok:
            return 0.0
        else:
            rec.rejected += 1
            rec.last_reject = now
            needed = min(self.strikes, PROBATION_STRIKES) if on_probation else self.strikes
            if self.strikes <= 0 or list(rec.recent).count(False) < needed:
                return 0.0
        return self._shut(rec, reason, now)

    def _shut(self, rec: Record, reason: str, now: float) -> float:
        """Quarantine `rec`'s learner: the seconds it lasts."""
        seconds = min(MAX_S, self.base_s * 2.0**rec.level)
        rec.level += 1
        rec.until = now + seconds
        rec.probation = WINDOW
        rec.recent.clear()
        rec.signals.clear()  # kept, a learner cured by its restart was quarantined again at its
        # first signal (a fresh optimizer's is low); still bad, a new record takes < 1 s
        rec.last_reject = now
        rec.reason = reason
        return seconds

    def snapshot(self, now: float) -> list[dict[str, Any]]:
        """The learners quarantined now, on probation or with rejections, for status."""
        rows = []
        for lid, rec in sorted(self.records.items()):
            if not rec.rejected and not rec.level:
                continue
            left = max(0.0, rec.until - now)
            state = "quarantined" if left > 0 else ("probation" if rec.probation else "admitted")
            rows.append(
                {
                    "learner": lid,
                    "state": state,
                    "remaining_s": round(left, 1),
                    "quarantines": rec.level,
                    "rejected": rec.rejected,
                    "reason": rec.reason,
                }
            )
        return rows

    def state_dict(self, now: float) -> dict[str, Any]:
        """Standing a checkpoint keeps: remaining time, level, probation (times made relative)."""
        return {
            lid: {
                "remaining_s": max(0.0, r.until - now),
                "level": r.level,
                "probation": r.probation,
                "rejected": r.rejected,
                "reason": r.reason,
            }
            for lid, r in self.records.items()
            if r.rejected or r.level
        }

    def load_state_dict(self, state: dict[str, Any], now: float) -> None:
        for lid, r in (state or {}).items():
            rec = self._of(str(lid))
            rec.until = now + float(r.get("remaining_s", 0.0))
            rec.level, rec.probation = int(r.get("level", 0)), int(r.get("probation", 0))
            rec.rejected, rec.reason = int(r.get("rejected", 0)), str(r.get("reason", ""))
            rec.last_reject = now


def _low(signals: collections.deque[float]) -> tuple[float, float] | None:
    """(mean, mean + 2 standard errors) of a record that is confidently below LOW (None: not, or
    too short to say)."""
    k = len(signals)
    if k < SIGNAL_MIN:
        return None
    mean = statistics.fmean(signals)
    upper = mean + 2.0 * statistics.stdev(signals) / math.sqrt(k)
    return (mean, upper) if upper < LOW else None
