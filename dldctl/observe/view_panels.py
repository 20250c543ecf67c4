"""The rich building blocks of the status view: a sparkline renderable, one-line rows, and one
function per panel of the live view (header, quorum, goodput, loss, throughput, bandwidth,
events; the learners panel is in `dldctl.observe.view`).

Everything here is a pure function of a typed `Snapshot` (observe/snapshot_model.py), the
series kept by a `History`, and an injected `now`; nothing reads a clock or does I/O. The field
access, formatting and colours the panels use, and `History` itself, are in `dldctl.observe.view_data`.
`dldctl.observe.view` is the public face and re-exports what callers need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dldctl.observe.snapshot_model import Event, Learner, Snapshot, SyncerPart
from dldctl.observe.view_data import (
    DASH,
    History,
    fmt_bytes,
    fmt_count,
    fmt_duration,
    fmt_float,
    fmt_int,
    fmt_pct,
    fmt_rate,
    goodput_style,
    num,
    quorum_colour,
    quorum_label,
    run_uptime,
    sparkline,
    state_style,
    supervisor_note,
    text_of,
)
from syncer.common import unscored

EVENT_STYLES = {
    "join": "green",
    "quorum_reached": "green",
    "quorum_regained": "green",
    "syncer_start": "green",
    "death": "bold red",
    "syncer_death": "bold red",
    "quorum_lost": "bold red",
    "host_unreachable": "red",
    "fault_inject": "magenta",
    "fault_undo": "cyan",
    "restart": "cyan",
    "resync": "cyan",
    "checkpoint": "blue",
    "reject": "yellow",
    "leave": "dim",
    "global_eval_off": "yellow",
    "epoch_done": "green",  # the data ledger (docs/data.md): an epoch of the dataset merged
    "units_requeued": "yellow",  # work units of a learner that left, back in the queue
    "units_partial": "yellow",  # a unit closed partly merged
    "data_mismatch": "red",  # a learner refused: its dataset differs from the run's
}

# ---------------------------------------------------------------- one-line renderables


MIN_SPARK = 4  # a sparkline narrower than this leaves its scale out


class Spark:
    """A one-line renderable: `prefix` + a sparkline as wide as the space left + its scale
    (" min–max" of what it draws, formatted by `fmt`; a fixed `lo`/`hi` end is shown as fixed)
    where there is room for it + `suffix`. The scale is `spark_scale`: noise draws flat."""

    def __init__(
        self,
        prefix: Text | str,
        values: Sequence[Any],
        suffix: Text | str = "",
        *,
        lo: float | None = None,
        hi: float | None = None,
        style: str = "cyan",
        fmt: Callable[[float], str] | None = None,
    ) -> None:
        self.prefix, self.suffix = Text(prefix) if isinstance(prefix, str) else prefix, suffix
        self.values, self.lo, self.hi, self.style, self.fmt = values, lo, hi, style, fmt

    def scale_text(self, width: int) -> str:
        """ " min–max" of the last `width` values ("" without a formatter or a number)."""
        shown = [v for v in map(num, list(self.values)[-width:]) if v is not None] if width > 0 else []
        if self.fmt is None or len(shown) < 2:  # one point has no range to speak of
            return ""
        low = self.lo if self.lo is not None else min(shown)
        high = self.hi if self.hi is not None else max(shown)
        return f" {self.fmt(low)}–{self.fmt(high)}"

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        suffix = Text(self.suffix) if isinstance(self.suffix, str) else self.suffix
        room = options.max_width - self.prefix.cell_len - suffix.cell_len
        scale = self.scale_text(room)
        if room - len(scale) < min(MIN_SPARK, len(self.values)):
            scale = ""
        room -= len(scale)
        yield Text.assemble(
            self.prefix,
            (sparkline(self.values, room, self.lo, self.hi), self.style),
            (scale, "dim"),
            suffix,
            no_wrap=True,
            overflow="ellipsis",
        )


class Fit:
    """The first of several one-line alternatives (the most detailed first) that fits the width:
    a line drops its less important parts, never the digits of a figure (the last one is cut)."""

    def __init__(self, *choices: Text) -> None:
        self.choices = choices

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield next((c for c in self.choices if c.cell_len <= options.max_width), self.choices[-1])


def line(*parts: str | tuple[str, str] | Text) -> Text:
    """One non-wrapping line of styled parts (an ellipsis where it does not fit)."""
    return Text.assemble(*parts, no_wrap=True, overflow="ellipsis")


def lines(*rows: RenderableType) -> Table:
    """Stack one-line renderables (a grid, so each row keeps its own overflow)."""
    grid = Table.grid(expand=True)
    grid.add_column(no_wrap=True, overflow="ellipsis")
    for row in rows:
        grid.add_row(row)
    return grid


def titled(title: str | Text, body: RenderableType, border: str = "blue") -> Panel:
    """A panel with the project's look."""
    return Panel(
        body,
        title=Text(title, "bold") if isinstance(title, str) else title,
        title_align="left",
        border_style=border,
        box=box.ROUNDED,
        padding=(0, 1),
    )


# ---------------------------------------------------------------- panels of the live view

SEP = (" │ ", "dim")


def short_id(learner_id: Any) -> str:
    """`learner-3` -> `#3` for tight spaces; other names unchanged."""
    name = text_of(learner_id)
    return "#" + name[len("learner-") :] if name.startswith("learner-") else name


WARN_WINDOW_S = 60.0  # a counter's warning lasts this long after its last rise


def header_notes(snap: Snapshot, now: float, history: History | None = None) -> Text:
    """The header's second voice (its subtitle): warnings an operator should not miss. Rejected
    messages and dropped sends are warned about while they rise (over the last WARN_WINDOW_S of
    `history`); without a history (`--once`) they are not (`--json` has the lifetime counters)."""
    notes: list[tuple[str, str]] = []
    if snap.status == "down":
        notes.append(("the run is down (`dldctl down`); `dldctl report` summarises it", "bold"))
    elif snap.status == "crashed":
        notes.append((f"the run crashed: `dldctl up --resume {text_of(snap.run)}` continues it", "bold red"))
    elif not snap.syncer.alive:
        notes.append(("learners keep training; merges resume when the syncer is back", "red"))
    sup_note = supervisor_note(snap, now) if snap.status not in ("down", "crashed") else None
    notes += [sup_note] if sup_note else []
    if snap.now is not None and now - snap.now > 5:
        notes.append((f"snapshot {fmt_duration(now - snap.now)} old", "yellow"))
    if snap.insecure:
        notes.append(("INSECURE: no CURVE", "bold yellow"))
    for name, words in (("rejected", "rejected"), ("dropped_sends", "dropped sends")):
        rise = history.recent_rise(name, WARN_WINDOW_S) if history is not None else None
        if rise:  # lifetime counters: said while they grow, gone a minute after they stop
            notes.append((f"{words} {int(rise)} in {WARN_WINDOW_S:.0f}s", "yellow"))
    notes += [(w, "bold red") for w in snap.syncer.warnings]
    notes += [(guard, "bold red")] if (guard := guard_note(snap)) else []
    notes += [(held, "bold red")] if (held := quarantine_note(snap)) else []
    notes += [(unscored_note, "yellow")] if (unscored_note := global_off_note(snap)) else []
    risks = snap.syncer.risks
    notes += [(f"{len(risks)} risky setting(s): {risks[0].split(':')[0]}", "yellow")] if risks else []
    out = Text()
    for i, note in enumerate(notes):
        out.append_text(Text(" · " if i else " ", "dim"))
        out.append(*note)
    return out.append(" ") if notes else out


def _syncer_parts(snap: Snapshot, alive: bool, compact: bool, address: bool = True) -> list[Any]:
    s = snap.syncer
    where = [" ", text_of(s.address)] if address else []
    if snap.status == "down":
        parts: list[Any] = [(" RUN DOWN ", "bold"), " syncer stopped"]
    elif snap.status == "crashed":
        parts = [(" RUN CRASHED ", "bold white on red"), " its supervisor is gone"]
    elif alive:
        parts = [("● ", "green"), "syncer", *where]
        if not compact:
            parts += [(" pid ", "dim"), fmt_int(s.pid), (" epoch ", "dim"), fmt_int(s.epoch)]
    else:
        parts = [(" SYNCER DOWN ", "bold white on red"), *where]
    if s.restarts:
        parts += [(" restarts ", "dim"), (str(s.restarts), "yellow")]
    return parts


def _progress_parts(s: SyncerPart, fragments: bool) -> list[Any]:
    parts: list[Any] = [SEP, ("outer ", "dim"), (fmt_int(s.outer_steps), "bold")]
    parts += [SEP, ("ckpt ", "dim"), fmt_int(s.checkpoint_outer_step)]
    return parts + ([SEP, fmt_int(s.fragments), (" fragments", "dim")] if fragments else [])


def header_panel(snap: Snapshot, now: float, compact: bool = False, history: History | None = None) -> Panel:
    """Run, uptime, syncer health, outer steps, checkpoint (`compact`: leave out pid and epoch;
    where the line still does not fit, the fragments, then the syncer's address go first)."""
    alive, down = snap.syncer.alive, snap.status == "down"
    head: list[Any] = [("ran " if down else "up ", "dim"), (fmt_duration(run_uptime(snap, now)), "bold"), SEP]
    choices = [
        line(*head, *_syncer_parts(snap, alive, compact), *_progress_parts(snap.syncer, True)),
        line(*head, *_syncer_parts(snap, alive, compact), *_progress_parts(snap.syncer, False)),
        line(*head, *_syncer_parts(snap, alive, True, address=False), *_progress_parts(snap.syncer, False)),
    ]
    border = "green" if alive else ("white" if down else "red")
    if not down and snap.supervisor is not None and snap.supervisor.state in ("missing", "hung"):
        border = "red"
    return Panel(
        Fit(*choices),
        title=Text.assemble(" dldctl ", (text_of(snap.run), "bold"), " "),
        title_align="left",
        subtitle=header_notes(snap, now, history) or None,
        subtitle_align="right",
        border_style=border,
        box=box.HEAVY if border == "red" else box.ROUNDED,
    )


def quorum_panel(snap: Snapshot, recent: Sequence[Any] | None = None) -> Panel:
    """Live/total/minimum, contributors of recent rounds, grace used, coloured by health."""
    q = snap.quorum
    colour, label = quorum_colour(snap), quorum_label(snap)
    live, total, minimum = q.live, q.total, q.min
    recent = q.recent_contributors if recent is None else recent
    top = total if total else max([v for v in map(num, recent) if v is not None], default=None)
    first = line(("live ", "dim"), (f"{live}/{total}", f"bold {colour}"), ("  min ", "dim"), str(minimum))
    rounds = Spark(
        Text("rounds ", "dim"),
        recent,
        Text.assemble((" last ", "dim"), fmt_int(q.last_round_contributors)),
        lo=0.0,
        hi=top,
        style=colour,
        fmt=fmt_int,
    )
    if colour == "red" and snap.syncer.alive:
        missing = str(minimum - live)
        opened = fmt_int(q.open_rounds)
        third = Fit(line((f"{opened} rounds open, need {missing} more", "red")), line((f"need {missing} more", "red")))
    else:
        grace = f"{fmt_float(q.grace_used_s, 2)}/{fmt_float(q.grace_window_s, 2)}s"
        still = (("  open ", "dim"), fmt_int(q.open_rounds))
        third = Fit(line(("grace ", "dim"), grace, *still), line(("grace ", "dim"), grace), line(grace))
    title = Text.assemble(("quorum ", "bold"), (f"● {label}", f"bold {colour}"))
    return titled(title, lines(first, rounds, third), border=colour)


def _pct0(value: float) -> str:
    return f"{100 * value:.0f}%"


def goodput_panel(snap: Snapshot, history: History) -> Panel:
    """Goodput of the whole run and of the last minute, with their history."""
    whole, window = snap.goodput, snap.goodput_window
    run_pct, window_pct = (fmt_pct(whole), f"bold {goodput_style(whole)}"), (fmt_pct(window), goodput_style(window))
    first = Fit(
        line(run_pct, (" run  ", "dim"), window_pct, (" last 60s", "dim")),
        line(run_pct, (" run  ", "dim"), window_pct, (" 60s", "dim")),
        line(run_pct, "  ", window_pct),
    )
    return titled(
        "goodput",
        lines(
            first,
            Spark(Text("run ", "dim"), history.get("goodput"), lo=0.0, hi=1.0, style=goodput_style(whole), fmt=_pct0),
            Spark(
                Text("60s ", "dim"),
                history.get("goodput_window"),
                lo=0.0,
                hi=1.0,
                style=goodput_style(window),
                fmt=_pct0,
            ),
        ),
        border=goodput_style(whole) if whole is not None else "blue",
    )


def loss_panel(snap: Snapshot, history: History) -> Panel:
    """The learners' train and eval loss and the global model's, with their history and best values
    (a quality guard trip is in the header's notes, `guard_note`)."""
    train, evals, glob = history.get("loss_train"), history.get("loss_eval"), history.get("loss_global")
    now = snap.loss

    def best(values: Sequence[Any]) -> str:
        return fmt_float(min((v for v in map(num, values) if v is not None), default=None))

    return titled(
        "loss",
        lines(
            Spark(
                Text.assemble(("train ", "dim"), (fmt_float(now.train), "bold"), " "),
                train,
                fmt=fmt_float,
            ),
            Spark(
                Text.assemble(("eval  ", "dim"), (fmt_float(now.eval), "bold"), " "),
                evals,
                style="magenta",
                fmt=fmt_float,
            ),
            global_off_line(off)
            if (off := snap.loss.global_off)
            else Spark(
                Text.assemble(("global ", "dim"), (fmt_float(now.global_), "bold"), " "),
                glob,
                style="green",
                fmt=fmt_float,
            ),
            line(("best ", "dim"), best(train), (" / ", "dim"), best(evals), (" / ", "dim"), best(glob)),
        ),
    )


def global_off_line(reason: str) -> Fit:
    """`global off: <reason in as few words as the width needs>` (the reason in full is a header note)."""
    return Fit(*(line(("global ", "dim"), (f"off: {w}", "bold yellow")) for w in unscored.words(reason)))


def global_off_note(snap: Snapshot) -> str:
    """The header's note while the global model is not scored ("" otherwise, or when the settings
    turned scoring off: the risky-settings note says that)."""
    off = snap.loss.global_off
    return "" if not off or unscored.on_purpose(off) else f"global model not scored, quality guard off: {off}"


def guard_note(snap: Snapshot) -> str:
    """The quality guard's trips, if it ever tripped ("" otherwise); the live and plain views' words."""
    guard = snap.guard
    if guard is None or not guard.trips:
        return ""
    return (
        f"QUALITY GUARD: {guard.trips} trip(s), {guard.rollbacks} rollback(s); "
        f"last score {fmt_float(guard.last.loss)} ({'good' if guard.last.good else 'FLAGGED'})"
    )


def quarantine_note(snap: Snapshot) -> str:
    """The learners the syncer's screen shuts out now, with why ("" when none)."""
    rows = [r for r in snap.screen.learners if r.state == "quarantined"] if snap.screen is not None else []
    if not rows:
        return ""
    first = rows[0]
    more = f" (+{len(rows) - 1} more)" if len(rows) > 1 else ""
    return (
        f"QUARANTINED: {text_of(first.learner)} for {fmt_duration(first.remaining_s or 0)}{more}: "
        f"{text_of(first.reason)}"
    )


def throughput_panel(snap: Snapshot, history: History) -> Panel:
    """Tokens/s of the fleet with its history, tokens trained and merged, tokens/s per learner."""
    trained, merged = snap.tokens.trained, snap.tokens.merged
    share = f" ({fmt_pct(merged / trained)})" if trained else ""
    rate = (fmt_rate(snap.tokens.per_s, "tok"), "bold")
    first = Fit(
        line(rate, ("  trained ", "dim"), fmt_count(trained), ("  merged ", "dim"), fmt_count(merged), share),
        line(rate, ("  trained ", "dim"), fmt_count(trained), ("  merged ", "dim"), fmt_count(merged)),
        line(rate, ("  merged ", "dim"), fmt_count(merged)),
        line(rate),
    )
    spark = Spark("", history.get("tokens_per_s"), lo=0.0, fmt=fmt_count)
    return titled("throughput", lines(first, spark, per_learner_rates(snap.learners)))


def per_learner_rates(learners: Sequence[Learner]) -> Fit:
    """`#0 6.3k  #1 6.4k ...`, coloured by state; where not all fit, the first ones and `+N`."""
    cells = [
        Text.assemble((short_id(r.id) + " ", state_style(r.state) or "dim"), fmt_count(r.tokens_per_s))
        for r in learners
    ]
    choices = [
        Text("  ").join(cells[:n]) + Text(("  " if n else "") + f"+{len(cells) - n}" if n < len(cells) else "", "dim")
        for n in range(len(cells), -1, -1)
    ]
    for choice in choices:
        choice.no_wrap, choice.overflow = True, "ellipsis"
    return Fit(*choices)


def bandwidth_panel(snap: Snapshot, history: History) -> Panel:
    """Bytes up and down per second, compression ratio, and data-parallel's traffic for the same work."""
    b = snap.bytes
    ratio = b.compression_ratio or None  # 0 means nothing pushed yet
    up_s = b.up_per_s if b.up_per_s is not None else history.latest("up_per_s")
    down_s = b.down_per_s if b.down_per_s is not None else history.latest("down_per_s")
    rates = ("↑ ", "dim"), (fmt_rate(up_s), "bold"), ("  ↓ ", "dim"), (fmt_rate(down_s), "bold")
    first = Fit(line(*rates, ("  compression ", "dim"), f"{ratio:.1f}x" if ratio is not None else DASH), line(*rates))
    moved, ddp = b.up + b.down, b.ddp_equivalent
    times = f" ({ddp / moved:,.0f}x)" if moved else ""
    versus = (fmt_bytes(ddp), "yellow"), (" vs ", "dim"), (fmt_bytes(moved), "green")
    third = Fit(line(("data-parallel ", "dim"), *versus, times), line(("DP ", "dim"), *versus, times), line(*versus))
    spark = Spark("", history.get("bytes_per_s"), lo=0.0, style="green", fmt=fmt_bytes)
    return titled("bandwidth", lines(first, spark, third))


class EventTail:
    """The newest events that fit the height it is given (newest last, ages from `now`)."""

    def __init__(self, events: Sequence[Event], now: float, default_rows: int = 10) -> None:
        self.events, self.now, self.default_rows = events, now, default_rows

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        rows = options.height or self.default_rows
        if not self.events:
            yield Text("no events yet", "dim")
            return
        yield event_table(self.events[-rows:], self.now)


def event_table(events: Sequence[Event], now: float, expand: bool = True) -> Table:
    """Events as aligned rows: age, kind, target, detail. A kind is shown whole (its column as wide
    as the widest shown): `supervisor_start` cut to `supervisor_sta…` says nothing. `expand`
    fills the width (a panel); plain output (`status --once`, a pipe) leaves it off."""
    kinds = [text_of(e.kind) for e in events]
    grid = Table.grid(padding=(0, 1), expand=expand)
    grid.add_column(justify="right", no_wrap=True, width=10)
    grid.add_column(no_wrap=True, width=max(map(len, kinds), default=4))
    grid.add_column(no_wrap=True, max_width=12, overflow="ellipsis")
    grid.add_column(no_wrap=True, ratio=1 if expand else None, overflow="ellipsis")
    for event in events:
        kind = text_of(event.kind)
        age = f"{fmt_duration(now - event.t)} ago" if event.t is not None else DASH
        grid.add_row(
            Text(age, "dim"),
            Text(kind, EVENT_STYLES.get(kind, "")),
            text_of(event.target),
            Text(text_of(event.detail), "dim"),
        )
    return grid


def events_panel(snap: Snapshot, now: float) -> Panel:
    """The event log: joins, deaths, restarts, chaos faults, quorum changes."""
    return titled("events", EventTail(snap.events, now))
