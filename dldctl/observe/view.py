"""What `dldctl status` shows: the live full-screen view and the plain `--once` snapshot.

Both are pure functions of one snapshot (typed, observe/snapshot_model.py, or its JSON: the
`dldctl status --json` schema, typed once on the way in) and an injected `now`; the live view
also takes a `History` of earlier snapshots for its sparklines. Nothing here reads a clock, a
socket or a file, so the view is tested by rendering recorded snapshots to a capture console. A
snapshot from a partial source may lack any field: it renders as "-" (or 0 for a count) instead
of raising; a dead syncer is said loudly, not failed on.

    history = History()
    history.add(snapshot)                                 # once per new snapshot
    live.update(render_live(snapshot, history, now))      # rich.live.Live(screen=True)
    Console().print(render_plain(snapshot, now))          # --once: no screen control

The panels live in `dldctl.observe.view_panels`, `History` and the field access and formatting helpers
in `dldctl.observe.view_data`; the ones callers need are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.layout import Layout
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dldctl.observe.snapshot_model import Bytes, Learner, Snapshot
from dldctl.observe.snapshot_parts import Job
from dldctl.observe.view_data import (
    STATE_STYLES,
    History,
    fmt_bytes,
    fmt_count,
    fmt_duration,
    fmt_float,
    fmt_int,
    fmt_pct,
    fmt_rate,
    goodput_style,
    live_age,
    pick_learners,
    quorum_colour,
    quorum_label,
    run_uptime,
    sparkline,
    state_style,
    supervisor_note,
    text_of,
)
from dldctl.observe.view_frame import consistent, sort_learners
from dldctl.observe.view_keys import ViewState
from dldctl.observe.view_ledger import data_panel, data_text, has_learner_tokens, learner_tokens
from dldctl.observe.view_overlay import detail_panel, footer, help_panel
from dldctl.observe.view_panels import (
    bandwidth_panel,
    event_table,
    events_panel,
    goodput_panel,
    header_notes,
    header_panel,
    loss_panel,
    quorum_panel,
    throughput_panel,
)
from dldctl.observe.view_shards import shard_text, sharded, shards_panel
from syncer.common.unscored import words

__all__ = [
    "STATE_STYLES",
    "History",
    "fmt_bytes",
    "fmt_count",
    "fmt_duration",
    "fmt_pct",
    "fmt_rate",
    "goodput_style",
    "learners_table",
    "quorum_colour",
    "quorum_label",
    "render_live",
    "render_plain",
    "sparkline",
    "state_style",
]

# ---------------------------------------------------------------- learners table


# (header, column options, the least compact level that still shows it: 0 full, 1 medium, 2 narrow)
LEARNER_COLUMNS: tuple[tuple[str, dict, int], ...] = (
    ("learner", {"no_wrap": True}, 2),
    ("host", {"no_wrap": True, "overflow": "ellipsis", "max_width": 16}, 1),
    ("device", {"no_wrap": True, "overflow": "ellipsis", "max_width": 8}, 0),
    ("state", {"no_wrap": True}, 2),
    ("step", {"justify": "right", "no_wrap": True}, 2),
    ("tok/s", {"justify": "right", "no_wrap": True}, 2),
    ("trend", {"no_wrap": True, "width": 10}, 0),
    ("weight", {"justify": "right", "no_wrap": True}, 1),
    ("merged", {"justify": "right", "no_wrap": True}, 0),  # only with the data ledger: its tokens merged
    ("rst", {"justify": "right", "no_wrap": True}, 2),
    ("hb", {"justify": "right", "no_wrap": True}, 2),
    ("job", {"no_wrap": True, "overflow": "ellipsis", "max_width": 36}, 1),  # only where a learner is a job
)


def _learner_cells(learner: Learner, snap: Snapshot, now: float, history: History | None) -> dict[str, Any]:
    state = text_of(learner.state)
    id_style = "bold yellow" if learner.straggler else ""
    if state in ("partitioned", "dead"):
        id_style = "bold " + state_style(state)
    age = live_age(snap, learner.heartbeat_age_s, now)
    age_style = "dim" if age is None else "red" if age >= 10 else "yellow" if age >= 3 else ""
    weight, restarts = learner.weight, learner.restarts
    trend = sparkline(history.learner(learner.id), 10, lo=0.0) if history is not None else ""
    return {
        "learner": Text(text_of(learner.id) + ("*" if learner.straggler else ""), id_style),
        "host": text_of(learner.host),
        "device": text_of(learner.device),
        "state": Text(state, state_style(state)),
        "step": fmt_int(learner.step),
        "tok/s": fmt_count(learner.tokens_per_s),
        "trend": Text(trend, "cyan"),
        "weight": f"{100 * weight:.0f}%" if weight is not None else "-",
        "merged": learner_tokens(snap, learner.id),
        "rst": Text(fmt_int(restarts), "yellow" if restarts else ""),
        "hb": Text(fmt_duration(age), age_style),
        "job": _job_cell(learner.job),
    }


def _job_cell(job: Job | None) -> Text:
    """A scheduler job's id and what the scheduler says (`12 PENDING (Resources)`)."""
    if job is None:
        return Text("-", "dim")
    says = text_of(job.says or job.state)
    return Text(f"{text_of(job.id)} {says}", "cyan" if says.startswith("PENDING") else "")


def learners_table(
    snap: Snapshot,
    now: float,
    history: History | None = None,
    rows: int | None = None,
    compact: int = 0,
    expand: bool = True,
    ui: ViewState | None = None,
    rule: bool = True,
) -> Table:
    """One row per learner (at most `rows`, troubled learners and the selected one kept first);
    stragglers marked `*`. `compact` 1 leaves out device, trend and merged, 2 also host and weight;
    without a history no trend, without the data ledger no merged (its tokens per learner). `ui`
    orders the rows by its sort column and marks its selection."""
    learners = sort_learners(snap.learners, ui.sort if ui else "learner")
    selected = ui.selected if ui else None
    shown = learners
    if rows is not None and len(learners) > rows:
        shown = pick_learners(learners, max(0, rows - 1), keep=selected)
    jobs = any(learner.job is not None for learner in learners)
    shown_only = {"job": jobs, "merged": has_learner_tokens(snap), "trend": history is not None}
    columns = [
        (name, options) for name, options, level in LEARNER_COLUMNS if compact <= level and shown_only.get(name, True)
    ]
    table = Table(box=box.SIMPLE_HEAD if rule else None, show_edge=False, pad_edge=False, expand=expand, padding=(0, 1))
    for name, options in columns:
        table.add_column(name + ("▾" if ui and ui.sort == name and name != "learner" else ""), **options)
    for learner in shown:
        cells = _learner_cells(learner, snap, now, history)
        loud = learner.straggler or learner.state == "partitioned"
        style = "reverse" if selected is not None and learner.id == selected else None
        if style:  # seen without colours too
            cells["learner"] = Text("▸", "bold") + cells["learner"]
        elif selected is not None:
            cells["learner"] = Text(" ") + cells["learner"]
        table.add_row(*(cells[name] for name, _ in columns), style=style or ("bold" if loud else None))
    if len(shown) < len(learners):
        table.add_row(Text(f"… +{len(learners) - len(shown)} more", "dim"))
    return table


def learners_panel(
    snap: Snapshot, history: History, now: float, height: int | None, compact: int, ui: ViewState | None = None
) -> Panel:
    """The learners table in a panel `height` rows high, titled with how many run; one row short of
    room for them all, the table leaves out the rule under its header rather than a learner."""
    learners = snap.learners
    rule = height is None or height - 4 >= len(learners)
    rows = None if height is None else height - (4 if rule else 3)
    running = sum(1 for learner in learners if learner.state == "running")
    body: RenderableType = (
        learners_table(snap, now, history, rows, compact, ui=ui, rule=rule)
        if learners
        else Text("no learners reported", "dim")
    )
    stragglers = any(learner.straggler for learner in learners)
    return Panel(
        body,
        title=f"[bold]learners[/] {running}/{len(learners)} running",
        title_align="left",
        subtitle="[yellow]* straggler[/]" if stragglers else None,
        subtitle_align="right",
        border_style="blue",
        box=box.ROUNDED,
        padding=(0, 1),
    )


# ---------------------------------------------------------------- the live layout


def plan_sections(height: int, learner_count: int, shard_count: int = 0, data: bool = False) -> dict[str, int]:
    """Rows per section for a screen `height` rows high, in order of importance: header, quorum
    row, syncer shards (a line each, when sharded), the data ledger's line (`data`), learners,
    throughput row, events. What does not fit is left out."""
    budget, plan = height, {}
    shards = ("shards", shard_count + 2 if shard_count > 1 else 0)
    wanted = [("header", 3), ("row1", 5), shards, ("data", 3 if data else 0)]
    for name, want in (*wanted, ("learners", learner_count + 4), ("row2", 5), ("events", 3)):
        if name == "learners":  # leave room for row2 and a few events unless the learners need it
            want = learner_count + 4 if learner_count else 3
            spare = budget - 8
            if want > spare and learner_count and want - 1 <= spare:
                want -= 1  # without the rule under the table's header (see learners_panel)
            else:
                want = min(want, spare - 1 if spare - 1 >= min(want, 8) else budget)
        if want > budget or want < 3:
            continue
        plan[name] = want
        budget -= want
    if plan and budget > 0:
        last = "events" if "events" in plan else "learners" if "learners" in plan else next(iter(plan))
        plan[last] += budget
    return plan


def build_layout(
    snap: Snapshot,
    history: History,
    now: float,
    width: int,
    height: int,
    ui: ViewState | None = None,
    log: list[str] | None = None,
) -> Layout:
    """The live view's layout for a screen of `width` x `height`; with `ui`, the footer line and
    the panel it opened (help, or the selected learner's detail: under the learners, in place of
    the throughput row and the events)."""
    learners = len(snap.learners)
    body = height - 1 if ui is not None else height
    overlay = ui is not None and (ui.panel == "help" or (ui.panel == "detail" and ui.selected is not None))
    count = len(sharded(snap))
    plan = _overlay_plan(body, learners) if overlay else plan_sections(body, learners, count, snap.data is not None)
    sections = []
    for name in ("header", "row1", "shards", "row2", "data", "learners", "events", "overlay"):
        if name in plan:
            region = Layout(name=name, size=plan[name])
            _fill(region, snap, history, now, width, ui, log)
            sections.append(region)
    if ui is not None:
        sections.append(Layout(footer(ui), name="footer", size=1))
    root = Layout(name="screen")
    root.split_column(*sections) if sections else root.update(Text(""))
    return root


def _fill(
    region: Layout,
    snap: Snapshot,
    history: History,
    now: float,
    width: int,
    ui: ViewState | None,
    log: list[str] | None,
) -> None:
    """Put the panels of one section of the plan (named as the region is) into it."""
    name, narrow = region.name, width < 72
    if name == "header":
        region.update(header_panel(snap, now, compact=width < 90, history=history))
    elif name == "row1":
        panels = [quorum_panel(snap), goodput_panel(snap, history)]
        region.split_row(*(Layout(p) for p in panels + ([] if narrow else [loss_panel(snap, history)])))
    elif name == "row2":
        panels = [throughput_panel(snap, history)] + ([] if narrow else [bandwidth_panel(snap, history)])
        region.split_row(*(Layout(p) for p in panels))
    elif name == "shards":
        region.update(shards_panel(snap))
    elif name == "data" and snap.data is not None:
        region.update(data_panel(snap.data))
    elif name == "learners":
        compact = 2 if narrow else 1 if width < 90 else 0
        region.update(learners_panel(snap, history, now, region.size, compact, ui))
    elif name == "events":
        region.update(events_panel(snap, now))
    elif ui is not None:
        chosen = ui.selected or ""
        region.update(help_panel() if ui.panel == "help" else detail_panel(snap, chosen, log or [], now))


def _overlay_plan(height: int, learner_count: int) -> dict[str, int]:
    """Rows for header, learners and an open panel (which takes the rest, at least 6 rows)."""
    plan = {"header": 3} if height >= 12 else {}
    left = height - sum(plan.values())
    want = min(learner_count + 4 if learner_count else 3, max(3, left - 6))
    if left - want >= 3:
        plan["learners"] = want
    plan["overlay"] = height - sum(plan.values())
    return plan


class LiveView:
    """Renders `build_layout` for whatever size it is given, so the view fits any terminal."""

    def __init__(
        self, snapshot: Snapshot, history: History, now: float, ui: ViewState | None, log: list[str] | None
    ) -> None:
        self.snapshot, self.history, self.now, self.ui, self.log = snapshot, history, now, ui, log

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        height = options.height or console.height
        yield build_layout(self.snapshot, self.history, self.now, options.max_width, height, self.ui, self.log)


def render_live(
    snapshot: Snapshot | Mapping[str, Any],
    history: History,
    now: float,
    ui: ViewState | None = None,
    log: list[str] | None = None,
) -> Layout:
    """The full-screen view: header, quorum, goodput, loss, throughput, bandwidth, learners, events;
    with `ui` (the keys' state) also the footer and the panel a key opened, `log` the selected
    learner's newest log lines. One frame is one consistent snapshot (`view_frame.consistent`)."""
    return Layout(LiveView(consistent(snapshot), history, now, ui, log), name="root")


# ---------------------------------------------------------------- the plain snapshot


def supervisor_line(snap: Snapshot, now: float) -> tuple[str, str]:
    """The `supervisor` line of `--once`: pids and restarts, or what is wrong, with its colour."""
    sup = snap.supervisor
    if sup is None or sup.state == "stopped":
        return "stopped (the run is not up)", ""
    dog = sup.watchdog
    said = (
        f"pid {fmt_int(sup.pid)}  restarts {fmt_int(sup.restarts)}  "
        f"watchdog {'pid ' + fmt_int(dog.pid) if dog is not None and dog.alive else 'MISSING'}"
    )
    note = supervisor_note(snap, now)
    if sup.state == "ok":
        return f"alive  {said}", note[1] if note else ""
    return (f"{note[0]}  (last {said})", note[1]) if note else (f"{text_of(sup.state)}  {said}", "")


def _plain_rows(snap: Snapshot, now: float) -> list[tuple[str, str]]:
    """The key lines of `--once`."""
    s, q, b, loss = snap.syncer, snap.quorum, snap.bytes, snap.loss
    ended = snap.status == "down"
    off = loss.global_off
    return [
        ("run", f"{text_of(snap.run)}  {'ran' if ended else 'up'} {fmt_duration(run_uptime(snap, now))}"),
        ("syncer", _syncer_words(snap)),
        *([("supervisor", supervisor_line(snap, now)[0])] if snap.supervisor is not None else []),
        ("outer", f"steps {fmt_int(s.outer_steps)}  checkpoint {fmt_int(s.checkpoint_outer_step)}"),
        (
            "quorum",
            f"{quorum_label(snap)}  live {q.live}/{q.total}  min {q.min}"
            f"  last round {fmt_int(q.last_round_contributors)}"
            f"  recent [{' '.join(fmt_int(v) for v in q.recent_contributors[-10:])}]"
            f"  grace {fmt_float(q.grace_used_s, 2)}/{fmt_float(q.grace_window_s, 2)}s"
            f"  open rounds {fmt_int(q.open_rounds)}",
        ),
        ("goodput", f"{fmt_pct(snap.goodput)} run  {fmt_pct(snap.goodput_window)} last 60s"),
        (
            "tokens",
            f"{fmt_rate(snap.tokens.per_s, 'tok')}  trained {fmt_count(snap.tokens.trained)}"
            f"  merged {fmt_count(snap.tokens.merged)}",
        ),
        *([("data", data_text(snap))] if snap.data is not None else []),
        ("bytes", _bytes_words(b)),
        (
            "loss",
            f"train {fmt_float(loss.train)}  eval {fmt_float(loss.eval)}"
            f"  global {f'off: {words(off)[0]}' if off else fmt_float(loss.global_)}",
        ),
        *[("shard", shard_text(row)) for row in sharded(snap)],
        *[("warning", w) for w in s.warnings + s.risks],
    ]


def _syncer_words(snap: Snapshot) -> str:
    s = snap.syncer
    if snap.status == "down":
        return "stopped (the run is down)"
    if not s.alive:
        return f"SYNCER DOWN  {text_of(s.address)}  restarts {s.restarts}"
    return (
        f"alive  {text_of(s.address)}  pid {fmt_int(s.pid)}  epoch {fmt_int(s.epoch)}"
        f"  restarts {s.restarts}  fragments {fmt_int(s.fragments)}"
    )


def _bytes_words(b: Bytes) -> str:
    """Bytes up and down (with their rates, where the live view derived them) and what
    data-parallel training would have moved."""
    moved = b.up + b.down
    times = f" ({b.ddp_equivalent / moved:,.0f}x ours)" if b.ddp_equivalent and moved else ""
    ratio = b.compression_ratio or None
    return (
        f"up {fmt_bytes(b.up)} ({fmt_rate(b.up_per_s)})  down {fmt_bytes(b.down)}"
        f" ({fmt_rate(b.down_per_s)})  compression {f'{ratio:.1f}x' if ratio is not None else '-'}"
        f"  data-parallel equivalent {fmt_bytes(b.ddp_equivalent)}{times}"
    )


def render_plain(snapshot: Snapshot | Mapping[str, Any], now: float, max_events: int = 10) -> RenderableType:
    """`dldctl status --once`: key lines, the learners table and the last events, no screen control
    (print on any Console; it colours only when that console is a terminal)."""
    snap = consistent(snapshot)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for key, value in _plain_rows(snap, now):
        style = (
            "red"
            if (key == "syncer" and not snap.syncer.alive)
            or (key == "quorum" and quorum_colour(snap) == "red")
            or (key == "shard" and not value.startswith("●"))
            else ""
        )
        if key == "supervisor":
            style = supervisor_line(snap, now)[1]
        grid.add_row(key, Text(value, "yellow" if key == "warning" else style))
    notes = header_notes(snap, now)
    if notes.plain.strip():
        grid.add_row("notes", notes[1:])
    events = snap.events[-max_events:] if max_events > 0 else ()
    return Group(
        grid,
        Text(""),
        learners_table(snap, now, expand=False) if snap.learners else Text("no learners reported", "dim"),
        Text(""),
        Text(f"last {len(events)} events (newest last)", "bold"),
        event_table(events, now, expand=False) if events else Text("no events yet", "dim"),
    )
