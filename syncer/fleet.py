"""What the syncer knows of its learners: liveness, reported progress, goodput accounting.

Pure (clock passed in). Goodput, as ALGORITHM.md defines it:
    goodput = (learner compute time whose tokens were merged) / (provisioned learner time)
A merged contribution for one fragment covers its learner's steps for 1/P of the model, so it
adds c_time / P of merged compute time. Provisioned time grows with the declared fleet size.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

WEIGHT_WINDOW_S = 60.0
RATE_WINDOW_S = 2.0  # a learner's step rate is measured over heartbeats at least this far apart


@dataclass
class LearnerInfo:
    """One learner as seen by the syncer (the latest incarnation wins)."""

    id: str
    incarnation: str = ""
    host: str = ""
    device: str = ""
    pid: int | None = None
    batch_size: int = 0
    last_seen: float = 0.0
    state: str = "joining"
    step: int = 0
    tokens: int = 0  # tokens trained by this incarnation
    tokens_base: int = 0  # tokens of earlier incarnations
    tokens_per_s: float = 0.0
    step_time: float = 0.0
    blocked_frac: float = 0.0
    loss: float | None = None
    eval_loss: float | None = None
    left: bool = False
    finished: bool = False  # left with its budget spent (its bye said so)
    # the learner's replica, as last reported (JSON from its heartbeat: the items are not checked)
    versions: list[object] = field(default_factory=list)
    crcs: list[object] = field(default_factory=list)
    crc_mismatches: int = 0
    joins: int = 0
    merged_tokens: float = 0.0
    merged_here: float = 0.0  # of those, this incarnation's: it trained at least these (its heartbeat lags)
    step_tokens: float = 0.0  # tokens per inner step, as its contributions show
    step_rate: float = 0.0  # inner steps per second, measured from its heartbeats
    rate_anchor: tuple[int, float] | None = None  # (step, time) the rate is measured from

    def seconds_per_step(self) -> float:
        """Wall time per inner step: measured (waits, evals and syncs included) once known,
        else the reported step time (compute only)."""
        return 1.0 / self.step_rate if self.step_rate > 0 else self.step_time

    def measure_rate(self, step: int, now: float) -> None:
        """Update the step rate over at least RATE_WINDOW_S of `now`: the learner's own clock when
        its heartbeat said when it was sent (heartbeats that queued while the syncer was busy
        must not read as a burst of steps), else the syncer's. Restarted when the counter or
        the clock goes back."""
        if self.rate_anchor is None or step < self.rate_anchor[0] or now < self.rate_anchor[1]:
            self.rate_anchor = (step, now)
            return
        step0, t0 = self.rate_anchor
        if now - t0 >= RATE_WINDOW_S:
            rate = (step - step0) / (now - t0)
            self.step_rate = rate if self.step_rate <= 0 else 0.5 * self.step_rate + 0.5 * rate
            self.rate_anchor = (step, now)

    @property
    def trained_here(self) -> int:
        """Tokens this incarnation trained: its last heartbeat's count, or what was merged of it if
        more (its last pushes can leave after its last heartbeat: merged must never exceed trained)."""
        return max(self.tokens, int(self.merged_here))

    @property
    def total_tokens(self) -> int:
        return self.tokens_base + self.trained_here

    def live(self, now: float, liveness_s: float) -> bool:
        return not self.left and now - self.last_seen < liveness_s


class Ledger:
    """Registry of learners plus run-wide accounting."""

    def __init__(self, declared: list[str], liveness_s: float, started: float) -> None:
        self.learners: dict[str, LearnerInfo] = {}
        self.declared = list(declared)
        self.liveness_s = liveness_s
        self.provisioned_s = 0.0
        self.ending = False  # `dldctl down` began: every learner that leaves now has finished
        self.merged_s = 0.0
        self.merged_tokens = 0.0
        self.steps_total = 0
        self._last_tick = started
        # (t, merged_s, provisioned_s) and (t, learner, merge weight)
        self._window: collections.deque[tuple[float, float, float]] = collections.deque()
        self._weights: collections.deque[tuple[float, str, float]] = collections.deque()

    # -- membership -------------------------------------------------------------------------
    def hello(self, meta: dict[str, Any], now: float) -> tuple[LearnerInfo, bool]:
        """Register a hello; returns (info, is_new_incarnation)."""
        lid = meta["learner"]
        info = self.learners.get(lid)
        if info is None:
            info = self.learners[lid] = LearnerInfo(id=lid)
        fresh = info.incarnation != meta["incarnation"]
        if fresh:  # its step counter (the inner lr schedule's position) resumes; see resume_step
            resume = info.step if info.joins else self.resume_step(lid, now)
            info.tokens_base += info.trained_here
            info.tokens, info.merged_here, info.step, info.state = 0, 0.0, resume, "joining"
            info.rate_anchor, info.step_rate = None, 0.0
            info.incarnation = meta["incarnation"]
            info.joins += 1
        info.host, info.device = meta["host"], meta["device"]
        info.pid, info.batch_size = meta["pid"], meta["batch_size"]
        info.left, info.finished, info.last_seen = False, False, now
        return info, fresh

    def resume_step(self, lid: str, now: float) -> int:
        """Where a new learner's inner step counter starts: the median counter of the other live,
        training learners (0 at the start of a run). A learner that joins a fleet under way (a
        spare, a late host) so takes up the fleet's place on the lr schedule instead of warming
        up to the peak rate while the others decay. A rejoining learner (a new incarnation of a
        known id) continues its own counter instead (hello)."""
        steps = [
            i.step
            for i in self.learners.values()
            if i.id != lid and i.state != "joining" and i.live(now, self.liveness_s)
        ]
        return int(statistics.median(steps)) if steps else 0

    def heartbeat(self, lid: str, meta: dict[str, Any], now: float) -> None:
        """Fold a heartbeat's progress report into the learner's record."""
        info = self.learners[lid]
        step = int(meta["step"])
        if step >= info.step:  # below it: a new incarnation still joining, before its resume step
            self.steps_total += step - info.step
            info.step = step
        info.tokens = int(meta["tokens"])
        info.state = str(meta["state"])[:16]
        if info.state == "running":
            sent = meta.get("sent_at")  # the learner's monotonic clock when it sent this
            if isinstance(sent, (int, float)) and not isinstance(sent, bool) and math.isfinite(sent):
                info.measure_rate(step, float(sent))
            else:
                info.measure_rate(step, now)
        else:  # joining, slow, paused: the rate starts over when it trains normally again
            info.rate_anchor = None
        for key in ("tokens_per_s", "step_time", "blocked_frac"):
            value = meta.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0:
                setattr(info, key, float(value))
        versions, crcs = meta.get("versions"), meta.get("crcs")
        if isinstance(versions, list) and isinstance(crcs, list) and len(versions) == len(crcs) <= 4096:
            info.versions, info.crcs = versions, crcs
        if isinstance(meta.get("crc_mismatches"), int):
            info.crc_mismatches = meta["crc_mismatches"]
        for key in ("loss", "eval_loss"):
            value = meta.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                setattr(info, key, float(value))
        info.last_seen = now

    def seen(self, lid: str, now: float) -> None:
        if lid in self.learners:
            self.learners[lid].last_seen = now

    def leave(self, lid: str, finished: bool = False) -> None:
        """A bye: the learner stopped; `finished`: its budget is spent, or the whole run is
        `ending` (`dldctl down`): the outer step keeps it in the fleet's average (`_fleet_share`)."""
        if lid in self.learners:
            self.learners[lid].left = True
            self.learners[lid].finished = finished or self.ending
            self.learners[lid].state = "stopped"

    def finished(self) -> set[str]:
        """Learners that left having spent their budget (not rejoined since)."""
        return {lid for lid, info in self.learners.items() if info.left and info.finished}

    def observe_rate(self, lid: str, tokens_per_step: float) -> None:
        if lid in self.learners and tokens_per_step > 0:
            self.learners[lid].step_tokens = tokens_per_step

    def tokens_per_step(self, lid: str, seq_len: int) -> float:
        """Tokens per inner step of a learner (from its pushes; batch x seq_len as a first guess)."""
        info = self.learners.get(lid)
        if info is None:
            return 0.0
        return info.step_tokens or float(info.batch_size * seq_len)

    def live(self, now: float) -> set[str]:
        """Learners heard from recently that are training (not joining, not left)."""
        return {
            lid
            for lid, info in self.learners.items()
            if info.live(now, self.liveness_s) and info.state not in ("joining", "starting")
        }

    def connected(self, now: float) -> set[str]:
        """Learners heard from recently, joining ones included (they receive updates too)."""
        return {lid for lid, info in self.learners.items() if info.live(now, self.liveness_s)}

    # -- accounting -------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Accrue provisioned time for the declared fleet."""
        dt = max(0.0, now - self._last_tick)
        self.provisioned_s += dt * len(self.declared)
        self._last_tick = now
        self._window.append((now, self.merged_s, self.provisioned_s))
        while self._window and now - self._window[0][0] > 60.0:
            self._window.popleft()

    def merged(self, lid: str, tokens: int, c_time: float, fragments: int, weight: float, now: float) -> None:
        """A contribution of `lid` made it into a merge with this (token) weight."""
        self.merged_s += c_time / fragments
        self.merged_tokens += tokens / fragments
        if lid in self.learners:
            self.learners[lid].merged_tokens += tokens / fragments
            self.learners[lid].merged_here += tokens / fragments
        self._weights.append((now, lid, weight))
        while self._weights and now - self._weights[0][0] > WEIGHT_WINDOW_S:
            self._weights.popleft()

    def weight_shares(self, now: float) -> dict[str, float]:
        """Each learner's share of the merge weight of the last minute: how much of the recent
        global progress came from it (a slower or smaller-batch learner has a smaller share)."""
        recent = [(lid, w) for t, lid, w in self._weights if now - t <= WEIGHT_WINDOW_S]
        total = sum(w for _, w in recent)
        shares: dict[str, float] = collections.defaultdict(float)
        for lid, w in recent:
            shares[lid] += w / total if total > 0 else 0.0
        return shares

    def goodput(self) -> float:
        return min(1.0, self.merged_s / self.provisioned_s) if self.provisioned_s > 0 else 0.0

    def goodput_window(self) -> float:
        if len(self._window) < 2:
            return self.goodput()
        (_, m0, p0), (_, m1, p1) = self._window[0], self._window[-1]
        return min(1.0, (m1 - m0) / (p1 - p0)) if p1 > p0 else 0.0

    def trained_tokens(self) -> int:
        return sum(info.total_tokens for info in self.learners.values())

    def tokens_per_s(self, now: float) -> float:
        return sum(i.tokens_per_s for i in self.learners.values() if i.live(now, self.liveness_s))

    def mean_loss(self, now: float, key: str) -> float | None:
        values = [
            getattr(i, key)
            for i in self.learners.values()
            if getattr(i, key) is not None and i.live(now, self.liveness_s)
        ]
        return sum(values) / len(values) if values else None

    def rows(self, now: float) -> list[dict[str, Any]]:
        """Per-learner rows of the status snapshot (syncer's view)."""
        speeds = [i.tokens_per_s for i in self.learners.values() if i.live(now, self.liveness_s) and i.tokens_per_s > 0]
        median = statistics.median(speeds) if speeds else 0.0
        out = []
        shares = self.weight_shares(now)
        for lid in sorted(self.learners, key=_learner_order):
            info = self.learners[lid]
            live = info.live(now, self.liveness_s)
            out.append(
                {
                    "id": lid,
                    "host": info.host,
                    "device": info.device,
                    "pid": info.pid,
                    "state": info.state if live or info.left else "unreachable",
                    "step": info.step,
                    "tokens": info.total_tokens,
                    "merged_tokens": int(info.merged_tokens),
                    "tokens_per_s": info.tokens_per_s if live else 0.0,
                    "weight": shares.get(lid, 0.0),
                    "heartbeat_age_s": max(0.0, now - info.last_seen) if info.last_seen else None,
                    "blocked_frac": info.blocked_frac,
                    "joins": info.joins,
                    "straggler": bool(live and median > 0 and info.tokens_per_s < 0.5 * median),
                    "loss": info.loss,
                    "eval_loss": info.eval_loss,
                }
            )
        return out

    # -- persistence ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "provisioned_s": self.provisioned_s,
            "merged_s": self.merged_s,
            "merged_tokens": self.merged_tokens,
            "steps_total": self.steps_total,
            "declared": self.declared,
            "learners": {
                lid: {
                    "incarnation": i.incarnation,
                    "tokens_base": i.tokens_base,
                    "tokens": i.trained_here,
                    "step": i.step,
                    "joins": i.joins,
                    "merged_tokens": i.merged_tokens,
                }
                for lid, i in self.learners.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any], now: float, saved_at: float, closed: bool = False) -> None:
        """Restore counters. The time the syncer was down counts as provisioned (the fleet was
        there, waiting), unless the run was `closed` (stopped by `down`: nobody was provisioned)."""
        self.merged_s = float(state["merged_s"])
        self.merged_tokens = float(state["merged_tokens"])
        self.steps_total = int(state["steps_total"])
        self.declared = list(state.get("declared", self.declared))
        downtime = 0.0 if closed else max(0.0, now - saved_at)
        self.provisioned_s = float(state["provisioned_s"]) + downtime * len(self.declared)
        # the same incarnation saying hello again is a reconnect: its counters continue from here
        for lid, saved in state.get("learners", {}).items():
            self.learners[lid] = LearnerInfo(
                id=lid,
                incarnation=str(saved["incarnation"]),
                tokens_base=int(saved["tokens_base"]),
                tokens=int(saved["tokens"]),
                step=int(saved["step"]),
                joins=int(saved["joins"]),
                merged_tokens=float(saved["merged_tokens"]),
                state="unreachable",
            )
        self._last_tick = now


class Membership:
    """The fleet's membership events, from one tick's live set to the next."""

    def __init__(self) -> None:
        self.live_prev: set[str] = set()
        self.lost_once: set[str] = set()
        self.quorum_ok: bool | None = None
        self.reached = False  # this syncer has had its quorum: the first time is reached, not regained

    def events(self, fleet: Ledger, live: set[str], quorum: int, now: float, out: Any) -> None:
        """learner_lost when a training learner goes silent past liveness_s, learner_back when it
        returns (one that is live no more because it is joining again, a restart quicker than
        liveness_s, has its `rejoin` event instead); quorum_reached (the first time since this syncer
        started: a start is not a recovery) / quorum_lost / quorum_regained."""
        for lid in sorted(self.live_prev - live):
            info = fleet.learners.get(lid)
            if info is not None and not info.left and now - info.last_seen >= fleet.liveness_s:
                out.event(now, "learner_lost", lid, f"silent for {now - info.last_seen:.1f} s")
                self.lost_once.add(lid)
        for lid in sorted(live - self.live_prev):
            if lid in self.lost_once:
                out.event(now, "learner_back", lid, "heard from again")
                self.lost_once.discard(lid)
        self.live_prev = live
        ok = len(live) >= quorum
        if self.quorum_ok is not None and ok != self.quorum_ok:
            kind = ("quorum_regained" if self.reached else "quorum_reached") if ok else "quorum_lost"
            out.event(now, kind, "syncer", f"{len(live)} live learners, minimum quorum {quorum}")
        self.quorum_ok = ok
        self.reached = self.reached or ok


def _learner_order(lid: str) -> tuple[str, int]:
    head, _, tail = lid.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (lid, 0)
