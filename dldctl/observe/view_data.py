"""The rich-free half of the status view: formatting a snapshot's figures, and their history.

Number and duration formatting (a figure a snapshot does not know is None, rendered as "-"),
the colour and one-word health of the quorum, the goodput and the supervisor, sparklines drawn
as text, and `History`, the bounded series of earlier snapshots' numbers that the sparklines
draw. Everything is a pure function of a typed `Snapshot` (observe/snapshot_model.py, where an
older or partial snapshot's missing and odd values were settled once) and an injected `now`;
nothing reads a clock or does I/O.

`dldctl.observe.view_panels` builds the rich panels from these, `dldctl.observe.view` lays them out and is the
public face (it re-exports what callers need); `dldctl.observe.report` formats with them too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from dldctl.observe.snapshot_fields import num
from dldctl.observe.snapshot_model import Learner, Quorum, Snapshot, as_snapshot

BLOCKS = "▁▂▃▄▅▆▇█"
DASH = "-"

STATE_STYLES = {
    "running": "green",
    "slow": "yellow",
    "paused": "yellow",
    "joining": "yellow",
    "starting": "yellow",
    "partitioned": "bold magenta",
    "dead": "bold red",
    "refused": "red",
    "quarantined": "bold red",
    "corrupt": "bold magenta",
    "restarting": "cyan",
    "queued": "cyan",
    "degraded": "yellow",
    "stopped": "dim",
}


# ---------------------------------------------------------------- formatting


def text_of(value: Any) -> str:
    """A string field for display: "-" for None or empty."""
    return DASH if value is None or value == "" else str(value)


def _scaled(value: float, units: Sequence[str], base: float) -> str:
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in units[:-1]:
        if value < base:
            return f"{sign}{value:.0f}{unit}" if unit in ("", " B") else f"{sign}{value:.1f}{unit}"
        value /= base
    return f"{sign}{value:.1f}{units[-1]}"


def fmt_bytes(value: Any) -> str:
    """Bytes in decimal units: 512 B, 41.2 MB, 12.1 GB; "-" for None."""
    v = num(value)
    return DASH if v is None else _scaled(v, (" B", " kB", " MB", " GB", " TB", " PB"), 1000.0)


def fmt_count(value: Any) -> str:
    """A count with an SI suffix: 950, 12.3k, 1.2M; "-" for None."""
    v = num(value)
    return DASH if v is None else _scaled(v, ("", "k", "M", "G", "T"), 1000.0)


def fmt_rate(value: Any, unit: str = "B") -> str:
    """A per-second rate: bytes as "420.0 kB/s", anything else as "12.3k tok/s"."""
    if num(value) is None:
        return DASH
    return f"{fmt_bytes(value)}/s" if unit == "B" else f"{fmt_count(value)} {unit}/s"


def fmt_duration(seconds: Any) -> str:
    """A duration for humans: 0.4s, 45s, 3m05s, 1h02m, 2d03h; "-" for None; negatives count as 0."""
    s = num(seconds)
    if s is None:
        return DASH
    s = max(0.0, s)
    if s < 10:
        return f"{s:.1f}s"
    whole = int(s)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def fmt_pct(value: Any) -> str:
    """A 0..1 fraction as a percentage with one decimal: 87.3%; "-" for None."""
    v = num(value)
    return DASH if v is None else f"{100.0 * v:.1f}%"


def fmt_float(value: Any, digits: int = 3) -> str:
    """A float with fixed decimals, "-" for None."""
    v = num(value)
    return DASH if v is None else f"{v:.{digits}f}"


def fmt_int(value: Any) -> str:
    """An integer as is, "-" for None."""
    v = num(value)
    return DASH if v is None else str(int(v))


# ---------------------------------------------------------------- colours


def state_style(state: Any) -> str:
    """The colour of a learner state (unknown states are plain)."""
    return STATE_STYLES.get(str(state), "")


def goodput_style(value: Any) -> str:
    """Green from 80 %, yellow from 50 %, red below; dim when unknown."""
    v = num(value)
    if v is None:
        return "dim"
    return "green" if v >= 0.8 else "yellow" if v >= 0.5 else "red"


def supervisor_note(snap: Snapshot, now: float) -> tuple[str, str] | None:
    """What to say about the supervisor and its watchdog, with its colour; None when all is well
    (or the snapshot predates the `supervisor` field, or the run is not up)."""
    sup = snap.supervisor
    if sup is None:
        return None
    dog = sup.watchdog.alive if sup.watchdog is not None else None
    age = fmt_duration(live_age(snap, sup.heartbeat_age_s, now))
    heal = (
        "the watchdog restarts it"
        if dog is True
        else f"no watchdog either: `dldctl up --resume {text_of(snap.run)}` restarts it"
    )
    return {
        "missing": (f"SUPERVISOR MISSING for {age}: {heal}", "bold red"),
        "hung": (f"supervisor not heard for {age}: {heal}", "bold red"),
        "stale": (f"supervisor not heard for {age}", "yellow"),
        "ok": ("no watchdog: the supervisor restarts it", "yellow") if dog is False else None,
    }.get(sup.state)


def quorum_colour(snap: Snapshot) -> str:
    """green: live >= min and every declared learner is live; yellow: live >= min but some learner
    is not (dead, restarting, partitioned), or no round has closed yet; red: live < min,
    below_quorum, or the syncer is down. Rounds with fewer contributors than live learners are the
    normal case with a small quorum (Decoupled DiLoCo does not wait): they do not colour it."""
    q = snap.quorum
    if not snap.syncer.alive or q.below_quorum or q.live < q.min:
        return "red"
    if q.live < q.total or _no_rounds(q):
        return "yellow"
    return "green"


def _no_rounds(q: Quorum) -> bool:
    return not q.recent_contributors and not q.last_round_contributors


def quorum_label(snap: Snapshot) -> str:
    """One word for the quorum's health, matching `quorum_colour`."""
    if not snap.syncer.alive:
        return "syncer down"
    colour = quorum_colour(snap)
    if colour == "yellow" and _no_rounds(snap.quorum):
        return "NO ROUNDS YET"
    return {"green": "OK", "yellow": "DEGRADED", "red": "BELOW QUORUM"}[colour]


# ---------------------------------------------------------------- sparklines


SPARK_FLOOR = 0.05  # a free scale spans at least 5 % of the values' magnitude: noise draws flat


def spark_scale(
    values: Sequence[Any], lo: float | None = None, hi: float | None = None, floor: float = SPARK_FLOOR
) -> tuple[float, float] | None:
    """The bottom and top a sparkline of `values` is drawn between (None when none is a number).

    `lo`/`hi` fix an end; a free scale is min..max, widened about its middle to at least `floor`
    times the largest magnitude, so a loss moving from 2.700 to 2.703 draws flat, not as a cliff.
    """
    real = [v for v in map(num, values) if v is not None]
    if not real:
        return None
    bottom = min(real) if lo is None else lo
    top = max(real) if hi is None else hi
    need = floor * max(abs(bottom), abs(top)) if lo is None and hi is None else 0.0
    if top - bottom < need:
        mid = (top + bottom) / 2
        bottom, top = mid - need / 2, mid + need / 2
    return bottom, top


def sparkline(
    values: Sequence[Any], width: int, lo: float | None = None, hi: float | None = None, floor: float = SPARK_FLOOR
) -> str:
    """The last `width` values as unicode blocks ▁..█ (one per value, at most `width` chars).

    The scale is `spark_scale` of what is shown (min..max, at least `floor` of the magnitude wide,
    unless `lo`/`hi` fix it); a constant series draws mid-height blocks; None, NaN and inf draw a space.
    """
    if width <= 0:
        return ""
    shown = [num(v) for v in list(values)[-width:]]
    scale = spark_scale(shown, lo, hi, floor)
    if scale is None:
        return " " * len(shown)
    bottom, top = scale
    span = top - bottom
    flat = lo is None and hi is None and len({v for v in shown if v is not None}) == 1
    out = []
    for v in shown:
        if v is None:
            out.append(" ")
        elif flat or (span <= 0 and lo is None and hi is None):
            out.append(BLOCKS[3])
        elif span <= 0:
            out.append(BLOCKS[0 if v <= bottom else -1])
        else:
            frac = min(1.0, max(0.0, (v - bottom) / span))
            out.append(BLOCKS[min(len(BLOCKS) - 1, int(frac * (len(BLOCKS) - 1) + 0.5))])
    return "".join(out)


# ---------------------------------------------------------------- ages and learner picks


def run_uptime(snap: Snapshot, now: float) -> float | None:
    """How long the run has been up, advanced to `now`; a run that is down does not age."""
    if snap.status == "down":
        return snap.uptime_s
    return live_age(snap, snap.uptime_s, now)


def live_age(snap: Snapshot, age: float | None, now: float) -> float | None:
    """An age recorded in the snapshot, advanced to `now` (ages grow while a snapshot is shown)."""
    if age is None:
        return None
    return age + max(0.0, now - snap.now) if snap.now is not None else age


def pick_learners(learners: Sequence[Learner], room: int, keep: str | None = None) -> list[Learner]:
    """At most `room` learners in their given order: the one named `keep` (the selected one) and
    the troubled ones (not running, or stragglers) first."""
    if len(learners) <= room:
        return list(learners)

    def trouble(item: tuple[int, Learner]) -> int:
        if keep is not None and item[1].id == keep:
            return -1
        return 0 if item[1].state not in ("running", "") or item[1].straggler else 1

    kept = sorted(sorted(enumerate(learners), key=trouble)[: max(0, room)], key=lambda i: i[0])
    return [learner for _, learner in kept]


# ---------------------------------------------------------------- history for the sparklines


SERIES = (
    "goodput",
    "goodput_window",
    "tokens_per_s",
    "up_per_s",
    "down_per_s",
    "bytes_per_s",
    "loss_train",
    "loss_eval",
    "loss_global",
    "quorum_live",
    "contributors",
    "t",
    "dropped_sends",
    "rejected",
)


class History:
    """Bounded series of earlier snapshots' numbers, for sparklines (a plain data structure).

    Holds the last `maxlen` values of each name in SERIES and of each learner's tokens/s. Adding
    the same snapshot twice (same `now`) is a no-op, so a loop may poll faster than snapshots
    change; a learner that leaves the snapshot's list loses its series. Bytes/s missing from a
    snapshot are derived from the byte counters of successive snapshots. It also keeps each
    snapshot's time and the syncer's lifetime counters (`dropped_sends`, `rejected`), so
    `recent_rise` tells whether they still grow (the header warns only while they do).
    """

    def __init__(self, maxlen: int = 120) -> None:
        if maxlen < 1:
            raise ValueError(f"History maxlen must be at least 1, got {maxlen}")
        self.maxlen = maxlen
        self._series: dict[str, deque] = {name: deque(maxlen=maxlen) for name in SERIES}
        self._learners: dict[str, deque] = {}
        self._last_now: float | None = None
        self._last_bytes: tuple[float | None, float | None] = (None, None)

    def add(self, snapshot: Snapshot | Mapping[str, Any]) -> None:
        """Append this snapshot's values (None where it has none)."""
        snap = as_snapshot(snapshot)
        taken = snap.now
        if taken is not None and taken == self._last_now:
            return
        values = self._values(snap)
        self._derive_rates(snap, values, taken)
        self._last_now = taken
        for name, value in values.items():
            self._series[name].append(value)
        self._add_learners(snap.learners)

    @staticmethod
    def _values(snap: Snapshot) -> dict[str, float | None]:
        up, down = snap.bytes.up_per_s, snap.bytes.down_per_s
        contributors = snap.quorum.last_round_contributors
        return {
            "goodput": snap.goodput,
            "goodput_window": snap.goodput_window,
            "tokens_per_s": snap.tokens.per_s,
            "up_per_s": up,
            "down_per_s": down,
            "bytes_per_s": None if up is None and down is None else (up or 0.0) + (down or 0.0),
            "loss_train": snap.loss.train,
            "loss_eval": snap.loss.eval,
            "loss_global": snap.loss.global_,
            "quorum_live": float(snap.quorum.live),
            "contributors": float(contributors) if contributors is not None else None,
            "t": snap.now,
            "dropped_sends": float(snap.syncer.dropped_sends) if snap.syncer.dropped_sends is not None else None,
            "rejected": snap.syncer.rejected_total,
        }

    def _derive_rates(self, snap: Snapshot, values: dict[str, float | None], taken: float | None) -> None:
        totals: tuple[float | None, float | None] = (snap.bytes.up, snap.bytes.down)
        dt = taken - self._last_now if taken is not None and self._last_now is not None else None
        for name, total, before in zip(("up_per_s", "down_per_s"), totals, self._last_bytes):
            if values[name] is None and dt and dt > 0 and total is not None and before is not None and total >= before:
                values[name] = (total - before) / dt
        up, down = values["up_per_s"], values["down_per_s"]
        values["bytes_per_s"] = None if up is None and down is None else (up or 0.0) + (down or 0.0)
        self._last_bytes = totals

    def recent_rise(self, name: str, window_s: float = 60.0) -> float | None:
        """How much a lifetime counter (`dropped_sends`, `rejected`) grew over the last `window_s`
        seconds of snapshots: the sum of its rises between successive ones (a counter that starts
        over, as after a syncer restart, counts from 0). None until two snapshots are in."""
        times, values = list(self._series["t"]), list(self._series.get(name, ()))
        if len(times) < 2 or times[-1] is None:
            return None
        rise, newest = 0.0, times[-1]
        for i in range(1, len(times)):
            t, before, after = times[i], values[i - 1], values[i]
            if t is None or after is None or t < newest - window_s:
                continue
            rise += after - before if before is not None and after >= before else after
        return rise

    def latest(self, name: str) -> float | None:
        """The newest value of a series (None if empty)."""
        series = self._series.get(name)
        return series[-1] if series else None

    def _add_learners(self, learners: Sequence[Learner]) -> None:
        seen = set()
        for learner in learners:
            if not learner.id:
                continue
            seen.add(learner.id)
            self._learners.setdefault(learner.id, deque(maxlen=self.maxlen)).append(learner.tokens_per_s)
        for gone in set(self._learners) - seen:
            del self._learners[gone]

    def get(self, name: str) -> list[float | None]:
        """One series, oldest first (empty for an unknown name)."""
        return list(self._series.get(name, ()))

    def learner(self, learner_id: str) -> list[float | None]:
        """One learner's tokens/s, oldest first."""
        return list(self._learners.get(str(learner_id), ()))

    def learner_ids(self) -> list[str]:
        """Learners that have a series."""
        return list(self._learners)

    def __len__(self) -> int:
        return len(self._series["goodput"])
