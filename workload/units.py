"""Work units: the learner's side of the data ledger (docs/data.md, "Who trains what").

The training data is a run of `sequences` windows of `seq_len + 1` tokens (sequence j starts at
token j * seq_len, so every train token is a target exactly once). Each epoch orders them by a
permutation that is a pure function of (seed, epoch), and cuts the order into units of
`unit_sequences` consecutive positions: unit `index` of epoch `e` has the global id
`e * count + index`. The syncer hands out ids (syncer/dataledger.py); a learner turns an id
into its sequences here, with no message saying which sequences they are.

The permutation is affine, i -> (a * i + b) mod S with gcd(a, S) = 1: exact, O(1) memory for any
S, and it spreads each unit (and so each batch) over the whole dataset: a unit is a sample of
the data in its own proportions, whatever part of the file it came from.

`UnitFeed` is what a workload takes its batches from: `take(n)` gives n sequence indices from the
units in hand (None if fewer are in hand: the caller samples off the ledger rather than wait),
`completed()` the units whose last sequence was taken since the last call. No I/O, no torch.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from workload import WorkloadContext

PREFETCH_UNITS = 2  # units in hand, not started, that a learner keeps at least (it never waits for data)
LOOKAHEAD_S = 3.0  # ... and enough of them for this long at its pace (6 heartbeats: a lost answer is no gap)
STARTUP_UNITS = 8  # before its pace is known (its first step not timed yet)


@dataclass(frozen=True)
class UnitPlan:
    """How an epoch's sequences are ordered and cut into units."""

    sequences: int
    unit_sequences: int
    seq_len: int
    seed: int = 0

    @property
    def count(self) -> int:
        """Units per epoch (the last one may be shorter)."""
        return math.ceil(self.sequences / self.unit_sequences)

    def affine(self, epoch: int) -> tuple[int, int]:
        """(a, b) of epoch `epoch`'s permutation i -> (a * i + b) mod sequences."""
        s = self.sequences
        if s == 1:
            return 1, 0
        rng = np.random.default_rng([int(self.seed) & (2**63 - 1), int(epoch), 0xDA7A])
        a = int(rng.integers(1, s))
        while math.gcd(a, s) != 1:
            a = a % (s - 1) + 1
        return a, int(rng.integers(0, s))

    def span(self, index: int) -> tuple[int, int]:
        """[first, stop) positions of unit `index` in its epoch's order."""
        first = index * self.unit_sequences
        return first, min(self.sequences, first + self.unit_sequences)

    def sequences_of(self, uid: int) -> np.ndarray:
        """The sequence indices of unit `uid`, in the order they are trained (int64)."""
        epoch, index = divmod(uid, self.count)
        a, b = self.affine(epoch)
        first, stop = self.span(index)
        positions = np.arange(first, stop, dtype=np.int64)
        return (positions * a + b) % self.sequences  # a, positions < S < 2**31: the product fits int64

    def tokens_of(self, uid: int) -> int:
        first, stop = self.span(uid % self.count)
        return (stop - first) * self.seq_len


def dataset_digest(tokens: Any, stop: int) -> str:
    """A cheap identity of tokens[:stop]: its length and its first and last 64 Ki tokens (learners
    of one run must read the same data: the syncer refuses one whose digest differs)."""
    h = hashlib.sha256(f"{stop}:{getattr(tokens, 'dtype', '')}".encode())
    edge = min(stop, 1 << 16)
    h.update(np.ascontiguousarray(tokens[:edge]).tobytes())
    h.update(np.ascontiguousarray(tokens[stop - edge : stop]).tobytes())
    return h.hexdigest()[:16]


@dataclass
class _Held:
    uid: int
    order: np.ndarray
    taken: int = 0


@dataclass
class UnitFeed:
    """The units this learner holds, and where it is in them. Unconfigured until a workload
    says what its data is (`configure`); a workload that never does trains off the ledger."""

    plan: UnitPlan | None = None
    digest: str = ""
    held: deque[_Held] = field(default_factory=deque)
    done: list[int] = field(default_factory=list)
    off_ledger: int = 0  # sequences taken without a unit
    received: int = 0  # units handed to this feed (the syncer counts those still on their way)
    beyond: int = 0  # 1 + the highest unit id handed to it (a restored syncer moves its cursor past it)

    def configure(self, *, sequences: int, seq_len: int, unit_sequences: int, seed: int, digest: str) -> None:
        if sequences < 1 or unit_sequences < 1:
            raise ValueError(f"the data ledger needs >= 1 sequence and unit size, got {sequences}, {unit_sequences}")
        self.plan = UnitPlan(sequences, min(unit_sequences, sequences), seq_len, seed)
        self.digest = digest

    @property
    def configured(self) -> bool:
        return self.plan is not None

    def add(self, uids: list[int]) -> None:
        """Units handed out by the syncer, appended in the order given (already held: ignored)."""
        assert self.plan is not None
        have = {h.uid for h in self.held}
        self.received += len(uids)
        self.beyond = max([self.beyond, *(u + 1 for u in uids)])
        for uid in uids:
            if uid not in have:
                self.held.append(_Held(uid, self.plan.sequences_of(uid)))
                have.add(uid)

    def drop(self, uids: list[int]) -> None:
        """Units the syncer took back (handed to another learner): never trained here from now on."""
        gone = set(uids)
        self.held = deque(h for h in self.held if h.uid not in gone)

    def take(self, n: int) -> np.ndarray | None:
        """n sequence indices from the units in hand, oldest first; None (nothing taken) if
        fewer than n are in hand."""
        if sum(len(h.order) - h.taken for h in self.held) < n:
            return None
        parts: list[np.ndarray] = []
        while n:
            head = self.held[0]
            k = min(n, len(head.order) - head.taken)
            parts.append(head.order[head.taken : head.taken + k])
            head.taken += k
            n -= k
            if head.taken == len(head.order):
                self.done.append(self.held.popleft().uid)
        return np.concatenate(parts)

    def completed(self) -> list[int]:
        """Units whose last sequence was taken since the last call."""
        out, self.done = self.done, []
        return out

    def hand(self) -> list[int]:
        """Units held and not finished (the one under way first)."""
        return [h.uid for h in self.held]

    def want(self, tokens_per_s: float = 0.0) -> int:
        """How many more units to ask for: enough that the units not started hold LOOKAHEAD_S of
        training at `tokens_per_s` (STARTUP_UNITS while it is not known), and at least PREFETCH_UNITS."""
        if self.plan is None:
            return 0
        p = self.plan
        paced = (
            math.ceil(tokens_per_s * LOOKAHEAD_S / (p.seq_len * p.unit_sequences)) if tokens_per_s else STARTUP_UNITS
        )
        ahead = max(PREFETCH_UNITS, paced)
        return max(0, ahead - sum(1 for h in self.held if h.taken == 0))

    def meta(self, tokens_per_s: float = 0.0) -> dict[str, Any] | None:
        """What the hello and heartbeats say of the data (None: off the ledger)."""
        if self.plan is None:
            return None
        p = self.plan
        return {
            "sequences": p.sequences,
            "unit_sequences": p.unit_sequences,
            "seq_len": p.seq_len,
            "digest": self.digest,
            "hand": self.hand(),
            "want": self.want(tokens_per_s),
            "received": self.received,
            "beyond": self.beyond,
            "off_ledger": self.off_ledger * p.seq_len,
        }


def unit_size(settings: dict[str, Any]) -> int:
    """Sequences per unit: `unit_sequences`, or one fragment's sync period at the run's batch
    size (batch_size * H / fragments): the work one push carries, so a dead learner's loss is
    about one unit, and a unit is named by about one push of each fragment."""
    explicit = int(settings.get("unit_sequences", 0) or 0)
    if explicit:
        return explicit
    return max(1, int(settings["batch_size"]) * int(settings["H"]) // max(1, int(settings["fragments"])))


def ledger_batches(
    ctx: WorkloadContext, tokens: Any, stop: int, seq_len: int, fallback: Callable[[], Any]
) -> Callable[[], Any]:
    """`next_batch` over the units in `ctx.units`: the train tokens are tokens[:stop], cut into
    sequences of seq_len + 1 (sequence j starts at j * seq_len); a batch is ctx.batch_size of
    them. With too few in hand (the syncer unreachable, or not answered yet) the batch comes
    from `fallback`, counted as off the ledger: a learner never waits for data."""
    from workload.data import _windows

    feed = ctx.units
    assert feed is not None
    feed.configure(
        sequences=(stop - 1) // seq_len,
        seq_len=seq_len,
        unit_sequences=unit_size(ctx.settings),
        seed=int(ctx.settings.get("seed", 0)),
        digest=dataset_digest(tokens, stop),
    )

    def next_batch() -> Any:
        picked = feed.take(ctx.batch_size)
        if picked is None:
            feed.off_ledger += ctx.batch_size
            return fallback()
        return _windows(tokens, picked * seq_len, seq_len, ctx.device)

    return next_batch
