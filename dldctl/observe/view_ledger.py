"""The data ledger in the status view: where the run is in its dataset (the snapshot's `data`).

With `[run] data_order = "ledger"` the syncer cuts the dataset into work units, hands them to the
learners and records each unit's fate (docs/data.md); its snapshot's `data` object says how far
the epoch has come. Here that becomes one line,

    epoch 1 · 44.2% merged · 9 in flight · 7 lost → 6 reissued

with the less important parts (units, queued again, tokens merged, partly merged units, tokens
trained off the ledger) added where the width allows, and each learner's merged tokens for the
learners table. A snapshot whose `data` is null (the ledger is off: `data_order = "shards"`, a
factory that takes no units) or missing (an older syncer) shows none of this. Pure functions of the
snapshot, as the rest of the view (`dldctl.observe.view_panels`).
"""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.panel import Panel
from rich.text import Text

from dldctl.observe.view_data import DASH, fmt_count, fmt_int, fmt_pct, num, text_of
from dldctl.observe.view_panels import Fit, line, titled

DOT = (" · ", "dim")


def ledger(snapshot: Any) -> dict:
    """The snapshot's `data` object; {} when the run does not use the ledger (null or missing)."""
    data = snapshot.get("data") if isinstance(snapshot, dict) else None
    return data if isinstance(data, dict) else {}


def learner_tokens(snapshot: dict, learner_id: Any) -> str:
    """A learner's merged tokens (`data.tokens_by_learner`), "-" without a ledger; a learner the
    ledger has merged nothing of yet has 0."""
    by_learner = ledger(snapshot).get("tokens_by_learner")
    if not isinstance(by_learner, dict):
        return DASH
    return fmt_count(by_learner.get(text_of(learner_id), 0))


def has_learner_tokens(snapshot: dict) -> bool:
    """Whether the learners table gets a `merged` column (the ledger counts tokens per learner)."""
    return isinstance(ledger(snapshot).get("tokens_by_learner"), dict)


def _core(data: dict) -> list[tuple[str, str]]:
    """The parts every width keeps: epoch and share merged."""
    return [("epoch ", "dim"), (fmt_int(data.get("epoch")), "bold"), DOT, (fmt_pct(data.get("merged_share")), "bold")]


def _counts(data: dict, short: bool = False) -> list[tuple[str, str]]:
    """In flight, lost and reissued (`short`: lost alone)."""
    lost = num(data.get("lost"))
    parts = [DOT, (fmt_int(data.get("in_flight")), ""), (" in flight", "dim"), DOT]
    parts += [(fmt_int(lost), "yellow" if lost else ""), (" lost", "dim")]
    return parts if short else [*parts, (" → ", "dim"), (fmt_int(data.get("reissued")), ""), (" reissued", "dim")]


def _extras(data: dict) -> list[list[tuple[str, str]]]:
    """What wider lines add, a group each, the most telling first: units closed of the epoch,
    tokens trained off the ledger (when any: the ledger did not feed some learner), units queued
    again, tokens merged, partly merged units (when any). A figure the snapshot lacks (the syncer
    is down: its last sample has only the headline's) is left out, not shown as "-"."""
    merged, partial, units = num(data.get("merged")), num(data.get("partial")), num(data.get("units"))
    groups = []
    if units is not None and merged is not None:
        groups.append([DOT, (f"{fmt_int(merged + (partial or 0))}/{fmt_int(units)}", ""), (" units", "dim")])
    off = num(data.get("off_ledger_tokens"))
    if off:
        groups.append([DOT, (fmt_count(off), "yellow"), (" tokens off the ledger", "dim")])
    again = num(data.get("queued_again"))
    if again is not None:
        groups.append([DOT, (fmt_int(again), "yellow" if again else ""), (" queued again", "dim")])
    if num(data.get("merged_tokens")) is not None:
        groups.append([DOT, (fmt_count(data.get("merged_tokens")), ""), (" tokens", "dim")])
    if partial:
        groups.append([DOT, (fmt_int(partial), "yellow"), (" partly merged", "dim")])
    return groups


def _headline(data: dict, detail: int) -> list[tuple[str, str]]:
    """`detail` 2: epoch · share merged · in flight · lost → reissued; 1 without the reissued;
    0 epoch and share only."""
    parts = _core(data)
    return parts if detail == 0 else [*parts, (" merged", "dim"), *_counts(data, short=detail == 1)]


def choices(data: dict) -> list[Text]:
    """The line from the most detailed to the least: the headline with every extra group, then
    one group fewer at a time, then the shorter headlines."""
    extras = _extras(data)
    full = [line(*_headline(data, 2), *(p for group in extras[:k] for p in group)) for k in range(len(extras), -1, -1)]
    return [*full, line(*_headline(data, 1)), line(*_headline(data, 0))]


def data_line(snapshot: dict) -> RenderableType:
    """The ledger's line, as much of it as fits the width."""
    return Fit(*choices(ledger(snapshot)))


def data_text(snapshot: dict) -> str:
    """The whole line as plain text (`dldctl status --once`); "" without a ledger."""
    data = ledger(snapshot)
    return choices(data)[0].plain if data else ""


def data_panel(snapshot: dict) -> Panel:
    """The ledger's line in a panel titled `data ledger`."""
    title = Text.assemble(("data ", "bold"), (text_of(ledger(snapshot).get("order")), "dim"))
    return titled(title, data_line(snapshot))
