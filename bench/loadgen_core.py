"""The pure parts of the syncer load generator (bench/loadgen.py): no sockets, no processes.

- **Model shapes** as parameter manifests, from the GPT formulas of workload/presets.py, without
  building a model: the built-in presets (tiny ones for tests) and GPT-2 small / medium / large
  shapes (124M, 355M, 774M parameters at the padded GPT-2 vocabulary of 50,304).
- **The schedule** a learner follows: fragment p is due after step s when
  s % H == ((p + 1) * H / P) % H (its own clock, learner/outer.py), or when the syncer calls it
  (`round_clock = "syncer"`, the default: the call comes every H/P fleet steps, syncer/clock.py).
  Either way the fleet offers P rounds every H steps: `offered_rate = P / (H * step_time)`.
- **Latency**, defined from the learners' side. For the round that made version v of fragment p:
      last push   = the latest time one of its contributors handed its push to the socket
      merge latency = (the time the last of those contributors received the update) - last push
  i.e. from the moment the last contribution left until every contributor holds the merged
  fragment: decode of the queued pushes, merge, outer step, publish, encode, and the sends to
  every learner (CURVE both ways). The syncer's side of the same round: `sent latency` =
  round record time + merge_s - last push (the update leaves the syncer).
- **Rates** over a window: rounds per second from the syncer's `round` records (a stall at
  either end of the window counts against it), parameters merged per second.
- **The search's stop rule** and which fleet size to try next.
All times are wall-clock seconds (time.time()), the same clock the syncer's records use.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from syncer.wire import fragments
from workload.presets import PRESETS, GPTConfig

GPT2_VOCAB = 50304  # GPT-2's 50,257 tokens padded to a multiple of 64 (nanoGPT)
EMBEDDINGS = ("transformer.wte.weight", "transformer.wpe.weight")  # merged by a plain mean
SHAPES: dict[str, GPTConfig] = {
    **{name: PRESETS[name] for name in ("gpt-tiny", "gpt-small", "gpt-medium")},
    "gpt2-124m": GPTConfig(vocab_size=GPT2_VOCAB, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-350m": GPTConfig(vocab_size=GPT2_VOCAB, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-774m": GPTConfig(vocab_size=GPT2_VOCAB, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
}


def gpt_shapes(c: GPTConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a GPT's parameters in named_parameters() order, as workload/presets.py
    computes them for its presets (the LM head is tied to wte)."""
    e = c.n_embd
    out: list[tuple[str, tuple[int, ...]]] = [
        ("transformer.wte.weight", (c.vocab_size, e)),
        ("transformer.wpe.weight", (c.block_size, e)),
    ]

    def linear(prefix: str, n_in: int, n_out: int) -> None:
        out.append((f"{prefix}.weight", (n_out, n_in)))
        if c.bias:
            out.append((f"{prefix}.bias", (n_out,)))

    def norm(prefix: str) -> None:
        out.append((f"{prefix}.weight", (e,)))
        if c.bias:
            out.append((f"{prefix}.bias", (e,)))

    for i in range(c.n_layer):
        h = f"transformer.h.{i}"
        norm(f"{h}.ln_1")
        linear(f"{h}.attn.c_attn", e, 3 * e)
        linear(f"{h}.attn.c_proj", e, e)
        norm(f"{h}.ln_2")
        linear(f"{h}.mlp.c_fc", e, 4 * e)
        linear(f"{h}.mlp.c_proj", 4 * e, e)
    norm("transformer.ln_f")
    return out


def manifest(shape: str) -> list[fragments.TensorSpec]:
    """The parameter manifest a learner of model shape `shape` sends in its hello."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; shapes: {', '.join(SHAPES)}")
    return [
        fragments.TensorSpec(name, dims, "embedding" if name in EMBEDDINGS else "dense")
        for name, dims in gpt_shapes(SHAPES[shape])
    ]


def param_count(specs: Iterable[fragments.TensorSpec]) -> int:
    return sum(math.prod(s.shape) for s in specs)


# --------------------------------------------------------------------------- the schedule


@dataclass(frozen=True)
class Schedule:
    """The push schedule of a fleet: H inner steps per fragment sync, P fragments, one step every
    `step_time` seconds."""

    H: int
    fragments: int
    step_time: float

    def offset(self, p: int) -> int:
        """Step (mod H) after which fragment p is due on a learner's own clock (learner/outer.py)."""
        return ((p + 1) * self.H // self.fragments) % self.H

    def due(self, step: int) -> list[int]:
        """Fragments due right after inner step `step` (1-based), on a learner's own clock."""
        return [p for p in range(self.fragments) if step % self.H == self.offset(p)]

    @property
    def sync_period_s(self) -> float:
        """Seconds between two syncs of one fragment (H steps)."""
        return self.H * self.step_time

    @property
    def round_interval_s(self) -> float:
        """Seconds between two rounds of the fleet (one fragment every H/P steps)."""
        return self.sync_period_s / self.fragments

    @property
    def offered_rate(self) -> float:
        """Merge rounds per second the fleet offers: P rounds every H steps."""
        return 1.0 / self.round_interval_s

    def offered_params_per_s(self, total_params: int) -> float:
        """Parameters per second the rounds must merge to keep up: the whole model every H steps."""
        return total_params / self.sync_period_s


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def achieved_rate(times: Iterable[float], start: float, end: float, interval: float) -> float:
    """Rounds per second in [start, end) from their close times: (count - 1) intervals over the
    time from the first to the last, so a window that cuts a steady stream anywhere measures its
    rate. A gap of more than one `interval` (the offered one) between the window's edge and the
    nearest round is a stall and counts as time without rounds."""
    inside = sorted(t for t in times if start <= t < end)
    if len(inside) < 2:
        return len(inside) / (end - start) if end > start else 0.0
    lead = max(0.0, inside[0] - start - interval)
    tail = max(0.0, end - inside[-1] - interval)
    return (len(inside) - 1) / (inside[-1] - inside[0] + lead + tail)


@dataclass(frozen=True)
class Reply:
    """A learner's push and the update that merged it, as the learner saw them (wall clock). A
    round is (global fragment, version): versions count per fragment, so they are unique across
    the shards of a sharded syncer too."""

    learner: str
    fragment: int
    version: int  # the version the round made
    pushed_at: float  # handed to the socket
    received_at: float  # the update came off the socket
    missed: int = 0  # rounds of the fragment that closed without this push after it left
    shard: int = 0  # the syncer shard that merged it (`fragment` is the global index)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Reply:
        return cls(
            str(d["learner"]),
            int(d["fragment"]),
            int(d["version"]),
            float(d["pushed_at"]),
            float(d["received_at"]),
            int(d.get("missed", 0)),
            int(d.get("shard", 0)),
        )


@dataclass
class RoundTiming:
    """What the contributors of one round saw: their last push and first and last receipt."""

    fragment: int
    version: int
    last_push: float = -math.inf
    first_received: float = math.inf
    last_received: float = -math.inf
    seen: int = 0  # contributors whose reply was recorded

    @property
    def latency(self) -> float:
        """Merge latency: the last contribution leaving -> the last contributor holding the update."""
        return self.last_received - self.last_push

    @property
    def first_latency(self) -> float:
        """The last contribution leaving -> the first contributor holding the update."""
        return self.first_received - self.last_push


def round_timings(replies: Iterable[Reply]) -> dict[tuple[int, int], RoundTiming]:
    """Replies grouped by round (fragment, version)."""
    out: dict[tuple[int, int], RoundTiming] = {}
    for r in replies:
        t = out.setdefault((r.fragment, r.version), RoundTiming(r.fragment, r.version))
        t.last_push = max(t.last_push, r.pushed_at)
        t.first_received = min(t.first_received, r.received_at)
        t.last_received = max(t.last_received, r.received_at)
        t.seen += 1
    return out


def sent_latencies(records: Iterable[Mapping[str, Any]], timings: Mapping[tuple[int, int], RoundTiming]) -> list[float]:
    """The syncer's side: for each round record with client timings, the last push -> the update
    sent (record time, taken when the round closed, plus the merge's duration)."""
    out = []
    for rec in records:
        t = timings.get((int(rec["fragment"]), int(rec["version"])))
        if t is not None:
            out.append(float(rec["t"]) + float(rec.get("merge_s", 0.0)) - t.last_push)
    return out


def spread(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """p50, p99 and max of `values` times `scale` (None where empty), and the sample count."""
    p50, p99 = percentile(values, 50), percentile(values, 99)
    return {
        "p50": None if p50 is None else p50 * scale,
        "p99": None if p99 is None else p99 * scale,
        "max": max(values) * scale if values else None,
        "n": float(len(values)),
    }


@dataclass(frozen=True)
class WindowStats:
    """One measurement window's merge rounds, as the syncer recorded them and the learners saw them."""

    rounds: int
    achieved_rate: float  # rounds per second (achieved_rate())
    params_per_s: float  # parameters of the global model merged per second
    contribution_params_per_s: float  # parameters of the learners' outer gradients merged per second
    contributors_mean: float
    latency: dict[str, float | None]  # merge latency (client side), seconds
    latency_clear: dict[str, float | None]  # the same, rounds that no checkpoint stalled
    sent_latency: dict[str, float | None]  # the syncer's side, seconds
    merge_s: dict[str, float | None]  # the syncer's merge time per round
    replies: int
    missed: int  # replies whose push missed at least one round
    missed_share: float
    extra: dict[str, Any] = field(default_factory=dict)


def window_stats(
    records: Sequence[Mapping[str, Any]],
    replies: Sequence[Reply],
    sizes: Sequence[int],
    start: float,
    end: float,
    schedule: Schedule,
    stalls: Sequence[tuple[float, float]] = (),
) -> WindowStats:
    """Summarize the rounds closed in [start, end) and the replies received in it (`stalls`: the
    syncer's checkpoints, `checkpoint_stalls`)."""
    rounds = [r for r in records if start <= float(r["t"]) < end]
    seen = [r for r in replies if start <= r.received_at < end]
    timings = round_timings(replies)  # all replies: a round's pushes may predate the window
    in_window = [timings[k] for k in sorted({(r.fragment, r.version) for r in seen})]
    span = end - start
    merged = sum(sizes[int(r["fragment"])] for r in rounds)
    contributed = sum(sizes[int(r["fragment"])] * len(r["contributors"]) for r in rounds)
    missed = sum(1 for r in seen if r.missed > 0)
    return WindowStats(
        rounds=len(rounds),
        achieved_rate=achieved_rate((float(r["t"]) for r in rounds), start, end, schedule.round_interval_s),
        params_per_s=merged / span,
        contribution_params_per_s=contributed / span,
        contributors_mean=sum(len(r["contributors"]) for r in rounds) / len(rounds) if rounds else 0.0,
        latency=spread([t.latency for t in in_window]),
        latency_clear=spread([t.latency for t in in_window if not overlaps(t.last_push, t.last_received, stalls)]),
        sent_latency=spread(sent_latencies(rounds, timings)),
        merge_s=spread([float(r.get("merge_s", 0.0)) for r in rounds]),
        replies=len(seen),
        missed=missed,
        missed_share=missed / len(seen) if seen else 0.0,
    )


_CHECKPOINT = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) (?:final )?checkpoint at outer step \d+: \S+, [\d.]+ \w+ in ([\d.]+) s"
)


def checkpoint_stalls(log: str, start: float, end: float) -> list[tuple[float, float]]:
    """(began, seconds) of each checkpoint the syncer logged that overlaps [start, end): the syncer
    writes them in its loop, and nothing else moves meanwhile. Its log's stamps are whole local
    seconds, so `began` is up to 1 s early."""
    out = []
    for line in log.splitlines():
        m = _CHECKPOINT.match(line)
        if m is not None:
            began = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
            seconds = float(m.group(2))
            if began < end and began + seconds + 1.0 > start:
                out.append((began, seconds))
    return out


def stalled_seconds(stalls: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """How much of [start, end) the stalls covered."""
    return sum(max(0.0, min(end, began + seconds) - max(start, began)) for began, seconds in stalls)


def overlaps(lo: float, hi: float, stalls: Iterable[tuple[float, float]], pad: float = 1.0) -> bool:
    """Whether [lo, hi] meets one of the stalls (began, seconds), each widened by `pad` at its end."""
    return any(lo <= began + seconds + pad and began <= hi for began, seconds in stalls)


# --------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class StopRule:
    """When a syncer has fallen behind: it merges under `min_rate` of the offered rounds, its p99
    merge latency is over `max_latency_s`, or more than `max_missed` of the pushes missed their round."""

    max_latency_s: float
    min_rate: float = 0.95
    max_missed: float = 0.05

    def problems(self, stats: WindowStats, offered_rate: float) -> list[str]:
        """Why the syncer did not keep up (empty: it did)."""
        out = []
        if stats.rounds == 0:
            return ["no round merged"]
        if stats.achieved_rate < self.min_rate * offered_rate:
            out.append(f"{stats.achieved_rate:.4f} rounds/s < {self.min_rate:g} x offered {offered_rate:.4f}")
        p99 = stats.latency["p99"]
        if p99 is None:
            out.append("no merge latency measured")
        elif p99 > self.max_latency_s:
            out.append(f"latency p99 {p99:.2f} s > {self.max_latency_s:.2f} s")
        if stats.missed_share > self.max_missed:
            out.append(f"{stats.missed_share:.1%} of the pushes missed their round (> {self.max_missed:.0%})")
        return out


def next_learners(history: Sequence[tuple[int, bool]], start: int, max_learners: int, refine: int) -> int | None:
    """The fleet size to try next, None when the search is done. Doubles from `start` while the
    syncer keeps up (capped at `max_learners`); after the first size it cannot sustain, bisects
    between the largest size it sustained and the smallest it did not, at most `refine` times."""
    if not history:
        return min(start, max_learners)
    bad = [n for n, ok in history if not ok]
    if not bad:
        last = history[-1][0]
        return None if last >= max_learners else min(2 * last, max_learners)
    lo = max((n for n, ok in history if ok), default=0)
    hi = min(bad)
    first_fail = next(i for i, (_, ok) in enumerate(history) if not ok)
    if len(history) - 1 - first_fail >= refine or hi - lo <= 1:
        return None
    return (lo + hi) // 2


def sustained(history: Sequence[tuple[int, bool]]) -> int:
    """The largest fleet size the syncer kept up with (0: none)."""
    return max((n for n, ok in history if ok), default=0)
