"""The syncer shards in the status view: one line per shard of a sharded syncer (`[syncer] shards`).

Pure functions of the snapshot's `shards` list (dldctl/observe/shardrows.py); a run of one shard
shows none of this (its one row says what the header already does). Each line: up or not, the
name, the fragments it owns, pid, epoch, outer steps and merges per second, checkpoint age, CPU
time and memory; the less important parts go first where the line does not fit.
"""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.panel import Panel
from rich.text import Text

from dldctl.observe.snapshot_model import Snapshot
from dldctl.observe.snapshot_parts import Shard
from dldctl.observe.view_data import DASH, fmt_bytes, fmt_duration, fmt_float, fmt_int, text_of
from dldctl.observe.view_panels import Fit, line, lines, titled


def sharded(snap: Snapshot) -> list[Shard]:
    """The shard rows of a sharded syncer; [] for one syncer process (or an older snapshot)."""
    rows = list(snap.shards or ())
    return rows if len(rows) > 1 else []


def _fragments(row: Shard) -> str:
    return ",".join(str(p) for p in row.fragments) if row.fragments is not None else DASH


def _health(row: Shard) -> tuple[str, str]:
    """The mark and its colour: a green dot when it answers, else what its process is doing."""
    if row.up:
        return "● ", "green"
    state = text_of(row.state)
    return f"✖ {state.upper()} ", "yellow" if state in ("restarting", "starting") else "bold red"


def shard_parts(row: Shard, detail: int) -> list[Any]:
    """One shard's line as parts; `detail` 2 everything, 1 without CPU and memory, 0 the essentials."""
    mark, colour = _health(row)
    parts: list[Any] = [(mark, colour), (f"{text_of(row.name):<9}", "bold")]
    parts += [(" fragments ", "dim"), _fragments(row)]
    if detail >= 1:
        parts += [(" pid ", "dim"), fmt_int(row.pid), (" epoch ", "dim"), fmt_int(row.epoch)]
    parts += [(" outer ", "dim"), (fmt_int(row.outer_steps), "bold")]
    rate = row.merges_per_s
    parts += [(" ", ""), (f"{fmt_float(rate, 1)}/s" if rate is not None else DASH, "cyan")]
    parts += [(" ckpt ", "dim"), f"{fmt_duration(row.checkpoint_age_s)} ago"]
    if detail >= 2:
        parts += [(" cpu ", "dim"), fmt_duration(row.cpu_s), (" rss ", "dim"), fmt_bytes(row.rss_bytes)]
    if row.restarts:
        parts += [(" restarts ", "dim"), (fmt_int(row.restarts), "yellow")]
    return parts


def shard_line(row: Shard) -> RenderableType:
    """One shard's line, as much of it as fits."""
    return Fit(*(line(*shard_parts(row, detail)) for detail in (2, 1, 0)))


def shard_text(row: Shard) -> str:
    """One shard's line as plain text (`dldctl status --once`)."""
    return line(*shard_parts(row, 2)).plain


def shards_panel(snap: Snapshot) -> Panel:
    """A line per shard, titled with how many answer (red when one does not)."""
    rows = sharded(snap)
    up = sum(1 for r in rows if r.up)
    title = Text.assemble(("syncer shards ", "bold"), f"{up}/{len(rows)} up")
    body = lines(*(shard_line(r) for r in rows)) if rows else Text("not sharded", "dim")
    return titled(title, body, border="blue" if up == len(rows) else "red")
