"""The thin shell of the live view: the terminal's keys in, frames out.

`KeyReader` puts the terminal in cbreak mode (keys arrive one by one, unechoed; Ctrl-C still
interrupts) and always restores it: on leaving the `with`, on an exception, and on SIGTERM, which
the caller turns into KeyboardInterrupt (`dldctl.interrupts.interruptible`). `drive` is the
loop: a snapshot every `interval` s, keys handled as they come (`dldctl.observe.view_keys.press`),
a redraw after each. What it reads and does goes through callables, so the run directory, the
hosts and chaos stay in the command (`dldctl.commands.status.live_view`).
"""

from __future__ import annotations

import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live

from dldctl.observe.snapshot_model import Snapshot
from dldctl.observe.view import History, render_live
from dldctl.observe.view_frame import consistent, learner_order
from dldctl.observe.view_keys import Command, ViewState, decode, press

LOG_EVERY_S = 2.0  # how often an open detail panel reads the learner's log again


class KeyReader:
    """Keys from a terminal in cbreak mode, restored on exit; no keys when stdin is no terminal."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdin
        self.fd: int | None = None
        self._saved: list[Any] | None = None

    def __enter__(self) -> KeyReader:
        if self.stream.isatty():
            self.fd = self.stream.fileno()
            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.fd is not None and self._saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
        self.fd = self._saved = None

    def read(self, timeout: float) -> str:
        """What was typed within `timeout` s ("" if nothing; sleeps the timeout without a terminal)."""
        if self.fd is None:
            time.sleep(max(0.0, timeout))
            return ""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        return os.read(self.fd, 1024).decode("utf-8", "replace") if ready else ""


@dataclass
class Sources:
    """What the view reads and does: a snapshot, a learner's newest log lines, a confirmed command
    (answering the message to show)."""

    collect: Callable[[], Snapshot | Mapping[str, Any]]
    log: Callable[[str], list[str]]
    act: Callable[[Command], str]


def drive(sources: Sources, interval: float, console: Console, keys: KeyReader) -> ViewState:
    """Run the live view until `q` (or KeyboardInterrupt); the state it ended in."""
    history, ui = History(), ViewState()
    snap = Snapshot()
    log: list[str] = []
    next_snap = next_log = 0.0
    with Live(console=console, screen=True, auto_refresh=False, transient=True) as live:
        while not ui.quit:
            now = time.monotonic()
            if now >= next_snap:
                snap, next_snap = consistent(sources.collect()), now + interval
                history.add(snap)
            if ui.panel == "detail" and ui.selected and now >= next_log:
                log, next_log = sources.log(ui.selected), now + LOG_EVERY_S
            live.update(render_live(snap, history, time.time(), ui, log), refresh=True)
            wake = min(next_snap, next_log) if ui.panel == "detail" else next_snap
            for key in decode(keys.read(max(0.0, wake - time.monotonic()))):
                before = ui
                ui, command = press(ui, key, learner_order(snap, ui.sort))
                if ui.panel == "detail" and (before.panel != "detail" or before.selected != ui.selected):
                    next_log = 0.0  # a new learner's detail: read its log now
                if command is not None:
                    live.update(render_live(snap, history, time.time(), ui, log), refresh=True)
                    ui, next_snap = replace(ui, message=sources.act(command)), 0.0
    return ui
