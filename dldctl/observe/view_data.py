"""The rich-free half of the status view: reading a snapshot, formatting it, and its history.

Safe field access (a snapshot from an older or partial source may lack any field or hold null
where a number is expected: every accessor answers None for that and every formatter renders
None as "-"), number and duration formatting, the colour and one-word health of the quorum, the
goodput and the supervisor, sparklines drawn as text, and `History`, the bounded series of earlier
snapshots' numbers that the sparklines draw. Everything is a pure function of a snapshot dict (the
`dldctl status --json` schema) and an injected `now`; nothing reads a clock or does I/O.

`dldctl.observe.view_panels` builds the rich panels from these, `dldctl.observe.view` lays them out and is the
public face (it re-exports what callers need); `dldctl.observe.report` formats with them too.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

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


# ---------------------------------------------------------------- safe access and formatting


def dig(data: Any, *keys: str) -> Any:
    """`data[k1][k2]...`, or None as soon as a level is missing or not a dict."""
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def num(value: Any) -> float | None:
    """A finite number as float, else None (bools, strings, NaN and inf are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def section(snapshot: Any, key: str) -> dict:
    """A sub-object of the snapshot (`syncer`, `quorum`, ...), {} when missing or malformed."""
    value = dig(snapshot, key)
    return value if isinstance(value, dict) else {}


def text_of(value: Any) -> str:
    """A string field for display: "-" for None or empty."""
    return DASH if value is None or value == "" else str(value)


def dicts(value: Any) -> list[dict]:
    """The dict items of a list field (a missing field or stray entries are skipped)."""
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


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


def syncer_alive(snapshot: dict) -> bool:
    """Whether the snapshot says the syncer answered (a missing flag counts as down)."""
    return dig(snapshot, "syncer", "alive") is True


def supervisor_note(snapshot: dict, now: float) -> tuple[str, str] | None:
    """What to say about the supervisor and its watchdog, with its colour; None when all is well
    (or the snapshot predates the `supervisor` field, or the run is not up)."""
    sup = section(snapshot, "supervisor")
    word, dog = sup.get("state"), dig(sup, "watchdog", "alive")
    age = fmt_duration(live_age(snapshot, sup.get("heartbeat_age_s"), now))
    heal = (
        "the watchdog restarts it"
        if dog is True
        else f"no watchdog either: `dldctl up --resume {text_of(snapshot.get('run'))}` restarts it"
    )
    return {
        "missing": (f"SUPERVISOR MISSING for {age}: {heal}", "bold red"),
        "hung": (f"supervisor not heard for {age}: {heal}", "bold red"),
        "stale": (f"supervisor not heard for {age}", "yellow"),
        "ok": ("no watchdog: the supervisor restarts it", "yellow") if dog is False else None,
    }.get(str(word))


def quorum_colour(snapshot: dict) -> str:
    """green: live >= min and every declared learner is live; yellow: live >= min but some learner
    is not (dead, restarting, partitioned), or no round has closed yet; red: live < min,
    below_quorum, or the syncer is down. Rounds with fewer contributors than live learners are the
    normal case with a small quorum (Decoupled DiLoCo does not wait): they do not colour it."""
    q = section(snapshot, "quorum")
    live, minimum, total = num(dig(q, "live")), num(dig(q, "min")), num(dig(q, "total"))
    if not syncer_alive(snapshot) or dig(q, "below_quorum") is True:
        return "red"
    if live is None or minimum is None:
        return "yellow"
    if live < minimum:
        return "red"
    if (total is not None and live < total) or _no_rounds(q):
        return "yellow"
    return "green"


def _no_rounds(q: dict) -> bool:
    return not q.get("recent_contributors") and not num(q.get("last_round_contributors"))


def quorum_label(snapshot: dict) -> str:
    """One word for the quorum's health, matching `quorum_colour`."""
    if not syncer_alive(snapshot):
        return "syncer down"
    colour = quorum_colour(snapshot)
    if colour == "yellow" and _no_rounds(section(snapshot, "quorum")):
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


def run_uptime(snapshot: dict, now: float) -> float | None:
    """How long the run has been up, advanced to `now`; a run that is down does not age."""
    if snapshot.get("status") == "down":
        return num(snapshot.get("uptime_s"))
    return live_age(snapshot, snapshot.get("uptime_s"), now)


def live_age(snapshot: dict, age: Any, now: float) -> float | None:
    """An age recorded in the snapshot, advanced to `now` (ages grow while a snapshot is shown)."""
    a = num(age)
    if a is None:
        return None
    taken = num(snapshot.get("now"))
    return a + max(0.0, now - taken) if taken is not None else a


def pick_learners(learners: list[dict], room: int, keep: str | None = None) -> list[dict]:
    """At most `room` learners in their given order: the one named `keep` (the selected one) and
    the troubled ones (not running, or stragglers) first."""
    if len(learners) <= room:
        return learners

    def trouble(item: tuple[int, dict]) -> int:
        if keep is not None and str(item[1].get("id")) == keep:
            return -1
        return 0 if item[1].get("state") not in ("running", None) or item[1].get("straggler") else 1

    kept = sorted(sorted(enumerate(learners), key=trouble)[: max(0, room)], key=lambda i: i[0])
    return [learner for _, learner in kept]


# ---------------------------------------------------------------- history for the sparklines


def _rejected_total(snapshot: dict) -> float | None:
    rejected = dig(snapshot, "syncer", "rejected")
    if not isinstance(rejected, dict):
        return None
    return sum(v for v in map(num, rejected.values()) if v is not None)


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

    def add(self, snapshot: dict) -> None:
        """Append this snapshot's values (None where it has none)."""
        if not isinstance(snapshot, dict):
            return
        taken = num(snapshot.get("now"))
        if taken is not None and taken == self._last_now:
            return
        values = self._values(snapshot)
        self._derive_rates(snapshot, values, taken)
        self._last_now = taken
        for name, value in values.items():
            self._series[name].append(value)
        self._add_learners(snapshot.get("learners"))

    @staticmethod
    def _values(snapshot: dict) -> dict[str, float | None]:
        up, down = num(dig(snapshot, "bytes", "up_per_s")), num(dig(snapshot, "bytes", "down_per_s"))
        return {
            "goodput": num(snapshot.get("goodput")),
            "goodput_window": num(snapshot.get("goodput_window")),
            "tokens_per_s": num(dig(snapshot, "tokens", "per_s")),
            "up_per_s": up,
            "down_per_s": down,
            "bytes_per_s": None if up is None and down is None else (up or 0.0) + (down or 0.0),
            "loss_train": num(dig(snapshot, "loss", "train")),
            "loss_eval": num(dig(snapshot, "loss", "eval")),
            "loss_global": num(dig(snapshot, "loss", "global")),
            "quorum_live": num(dig(snapshot, "quorum", "live")),
            "contributors": num(dig(snapshot, "quorum", "last_round_contributors")),
            "t": num(snapshot.get("now")),
            "dropped_sends": num(dig(snapshot, "syncer", "dropped_sends")),
            "rejected": _rejected_total(snapshot),
        }

    def _derive_rates(self, snapshot: dict, values: dict[str, float | None], taken: float | None) -> None:
        totals = (num(dig(snapshot, "bytes", "up")), num(dig(snapshot, "bytes", "down")))
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

    def _add_learners(self, learners: Any) -> None:
        if not isinstance(learners, list):
            return
        seen = set()
        for learner in dicts(learners):
            if learner.get("id") is None:
                continue
            key = str(learner["id"])
            seen.add(key)
            self._learners.setdefault(key, deque(maxlen=self.maxlen)).append(num(learner.get("tokens_per_s")))
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
