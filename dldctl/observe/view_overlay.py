"""What the keys of the live view open: the help panel, a learner's detail panel and the footer.

Pure functions of a snapshot, the `ViewState` of `dldctl.observe.view_keys`, the log lines the
shell fetched and an injected `now`, like the other panels (`dldctl.observe.view_panels`).
"""

from __future__ import annotations

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dldctl.observe.snapshot_model import Event, Learner, Snapshot
from dldctl.observe.view_data import fmt_count, fmt_int, state_style, text_of
from dldctl.observe.view_frame import learner_events
from dldctl.observe.view_keys import KEYS, ViewState, question
from dldctl.observe.view_ledger import has_learner_tokens, learner_tokens
from dldctl.observe.view_panels import event_table, titled

HINT = "q quit  ? keys  ↑↓ select  ⏎ detail  s sort  k kill  p pause"


def help_panel() -> Panel:
    """Every key and what it does."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column(overflow="fold")
    for key, meaning in KEYS:
        grid.add_row(key, meaning)
    return titled("keys (? closes)", grid, border="cyan")


class DetailBody:
    """The selected learner's newest events, then as many of its newest log lines as fit."""

    def __init__(self, events: list[Event], log: list[str], now: float) -> None:
        self.events, self.log, self.now = events, log, now

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        height = options.height or 12
        shown = self.events[-max(1, min(len(self.events), height // 3)) :] if self.events else []
        yield Text("recent events", "bold")
        yield event_table(shown, self.now) if shown else Text("no events about it", "dim")
        room = max(0, height - 2 - max(1, len(shown)) - 1)
        yield Text("recent log lines", "bold")
        if not self.log:
            yield Text("no log lines (yet)", "dim")
        for entry in self.log[-room:] if room else []:
            yield Text(entry, no_wrap=True, overflow="ellipsis")


def detail_panel(snap: Snapshot, learner_id: str, log: list[str], now: float) -> Panel:
    """One learner: host, state, pid, step, rate (and with the data ledger its merged tokens) in the
    title; its events and log lines."""
    row = next((r for r in snap.learners if r.id == learner_id), Learner())
    state = text_of(row.state)
    title = Text.assemble(
        (learner_id, "bold"),
        ("  on ", "dim"),
        text_of(row.host),
        "  ",
        (state, state_style(state)),
        ("  pid ", "dim"),
        fmt_int(row.pid),
        ("  step ", "dim"),
        fmt_int(row.step),
        ("  tok/s ", "dim"),
        fmt_count(row.tokens_per_s),
        *((("  merged ", "dim"), learner_tokens(snap, learner_id)) if has_learner_tokens(snap) else ()),
        ("  (⏎ closes)", "dim"),
    )
    body = DetailBody(learner_events(snap, learner_id, 20), log, now)
    return Panel(body, title=title, title_align="left", border_style="cyan", box=box.ROUNDED, padding=(0, 1))


def footer(state: ViewState) -> Text:
    """The bottom line: a question waiting for y/N, else the last message, else the keys."""
    if state.confirm is not None:
        return Text.assemble((" " + question(state.confirm) + " ", "bold black on yellow"), no_wrap=True)
    if state.message:
        return Text(" " + state.message, "bold", no_wrap=True, overflow="ellipsis")
    sort = f"  sorted by {state.sort}" if state.sort != "learner" else ""
    return Text(" " + HINT + sort, "dim", no_wrap=True, overflow="ellipsis")
