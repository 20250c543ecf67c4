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

from rich.panel import Panel
from rich.text import Text

from dldctl.observe.snapshot_model import Snapshot
from dldctl.observe.snapshot_parts import Ledger
from dldctl.observe.view_data import DASH, fmt_count, fmt_int, fmt_pct, text_of
from dldctl.observe.view_panels import Fit, line, titled

DOT = (" · ", "dim")


def learner_tokens(snap: Snapshot, learner_id: str) -> str:
    """A learner's merged tokens (`data.tokens_by_learner`), "-" without a ledger; a learner the
    ledger has merged nothing of yet has 0."""
    by_learner = snap.data.tokens_by_learner if snap.data is not None else None
    return DASH if by_learner is None else fmt_count(by_learner.get(learner_id, 0))


def has_learner_tokens(snap: Snapshot) -> bool:
    """Whether the learners table gets a `merged` column (the ledger counts tokens per learner)."""
    return snap.data is not None and snap.data.tokens_by_learner is not None


def _core(data: Ledger) -> list[tuple[str, str]]:
    """The parts every width keeps: epoch and share merged."""
    return [("epoch ", "dim"), (fmt_int(data.epoch), "bold"), DOT, (fmt_pct(data.merged_share), "bold")]


def _counts(data: Ledger, short: bool = False) -> list[tuple[str, str]]:
    """In flight, lost and reissued (`short`: lost alone)."""
    parts = [DOT, (fmt_int(data.in_flight), ""), (" in flight", "dim"), DOT]
    parts += [(fmt_int(data.lost), "yellow" if data.lost else ""), (" lost", "dim")]
    return parts if short else [*parts, (" → ", "dim"), (fmt_int(data.reissued), ""), (" reissued", "dim")]


def _extras(data: Ledger) -> list[list[tuple[str, str]]]:
    """What wider lines add, a group each, the most telling first: units closed of the epoch,
    tokens trained off the ledger (when any: the ledger did not feed some learner), units queued
    again, tokens merged, partly merged units (when any). A figure the snapshot lacks (the syncer
    is down: its last sample has only the headline's) is left out, not shown as "-"."""
    merged, partial, units = data.merged, data.partial, data.units
    groups = []
    if units is not None and merged is not None:
        groups.append([DOT, (f"{fmt_int(merged + (partial or 0))}/{fmt_int(units)}", ""), (" units", "dim")])
    if data.off_ledger_tokens:
        groups.append([DOT, (fmt_count(data.off_ledger_tokens), "yellow"), (" tokens off the ledger", "dim")])
    again = data.queued_again
    if again is not None:
        groups.append([DOT, (fmt_int(again), "yellow" if again else ""), (" queued again", "dim")])
    if data.merged_tokens is not None:
        groups.append([DOT, (fmt_count(data.merged_tokens), ""), (" tokens", "dim")])
    if partial:
        groups.append([DOT, (fmt_int(partial), "yellow"), (" partly merged", "dim")])
    return groups


def _headline(data: Ledger, detail: int) -> list[tuple[str, str]]:
    """`detail` 2: epoch · share merged · in flight · lost → reissued; 1 without the reissued;
    0 epoch and share only."""
    parts = _core(data)
    return parts if detail == 0 else [*parts, (" merged", "dim"), *_counts(data, short=detail == 1)]


def choices(data: Ledger) -> list[Text]:
    """The line from the most detailed to the least: the headline with every extra group, then
    one group fewer at a time, then the shorter headlines."""
    extras = _extras(data)
    full = [line(*_headline(data, 2), *(p for group in extras[:k] for p in group)) for k in range(len(extras), -1, -1)]
    return [*full, line(*_headline(data, 1)), line(*_headline(data, 0))]


def data_text(snap: Snapshot) -> str:
    """The whole line as plain text (`dldctl status --once`); "" without a ledger."""
    return choices(snap.data)[0].plain if snap.data is not None else ""


def data_panel(data: Ledger) -> Panel:
    """The ledger's line, as much of it as fits the width, in a panel titled `data ledger`."""
    title = Text.assemble(("data ", "bold"), (text_of(data.order), "dim"))
    return titled(title, Fit(*choices(data)))
