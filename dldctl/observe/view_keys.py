"""The keys of the live view: raw terminal input decoded to key names, and what each key does.

Pure: `decode` turns the characters a terminal sends into key names ("up", "enter", "q", ...);
`press` is the view's state machine, `(ViewState, key, learner order) -> (ViewState, Command)`.
Nothing here touches a terminal, so every key is tested without one; the shell that reads stdin
and runs a command is `dldctl.observe.view_tty`.

    state = ViewState()
    for key in decode(chars):
        state, command = press(state, key, learner_order(snapshot, state.sort))
        if command: ...            # a confirmed kill or pause: the shell runs it
"""

from __future__ import annotations

from dataclasses import dataclass, replace

PAUSE_S = 30.0  # how long `p` pauses a learner

# escape sequences of the keys we use (xterm's normal and application cursor modes)
ESCAPES = {
    "\x1b[A": "up",
    "\x1b[B": "down",
    "\x1b[C": "right",
    "\x1b[D": "left",
    "\x1bOA": "up",
    "\x1bOB": "down",
    "\x1bOC": "right",
    "\x1bOD": "left",
    "\x1b[H": "home",
    "\x1b[F": "end",
    "\x1bOH": "home",
    "\x1bOF": "end",
    "\x1b[5~": "pgup",
    "\x1b[6~": "pgdn",
}
SINGLE = {"\r": "enter", "\n": "enter", "\x1b": "esc", "\x7f": "backspace", "\t": "tab"}

# (key, what it does) as the help panel lists them
KEYS = (
    ("q", "quit the view (the run keeps going)"),
    ("?", "show or hide this help"),
    ("↑ ↓", "select a learner"),
    ("Enter", "show or hide the selected learner's recent log lines and events"),
    ("s", "sort the learners by the next column: learner, state, tok/s, step, hb"),
    ("k", "kill the selected learner (asks y/N; the supervisor restarts it)"),
    ("p", f"pause the selected learner for {PAUSE_S:g}s (asks y/N)"),
    ("Esc", "close the panel, or cancel a question"),
)
SORTS = ("learner", "state", "tok/s", "step", "hb")


def decode(chars: str) -> list[str]:
    """Key names of what a terminal sent: escape sequences by name, other characters as they are;
    an escape sequence we do not know is dropped whole (never read as `q`, `k` or `p`)."""
    keys, i = [], 0
    while i < len(chars):
        if chars[i] == "\x1b" and i + 1 < len(chars) and chars[i + 1] in "[O":
            end = i + 2
            while end < len(chars) and not ("@" <= chars[end] <= "~"):
                end += 1
            seq = chars[i : end + 1]
            if seq in ESCAPES:
                keys.append(ESCAPES[seq])
            i = end + 1
            continue
        keys.append(SINGLE.get(chars[i], chars[i]))
        i += 1
    return keys


@dataclass(frozen=True)
class Command:
    """A confirmed action on a learner: `kill` or `pause` (for `seconds`)."""

    action: str
    target: str
    seconds: float = 0.0


@dataclass(frozen=True)
class ViewState:
    """What the operator chose: the selected learner (by id, so it survives a reorder), the open
    panel ("", "help" or "detail"), the sort column, a question waiting for y/N, the last message."""

    selected: str | None = None
    panel: str = ""
    sort: str = "learner"
    confirm: Command | None = None
    message: str = ""
    quit: bool = False


def question(command: Command) -> str:
    """What the view asks before it runs `command`."""
    if command.action == "pause":
        return f"pause {command.target} for {command.seconds:g}s? y/N"
    return f"kill {command.target} (SIGKILL; the supervisor restarts it)? y/N"


def press(state: ViewState, key: str, order: list[str]) -> tuple[ViewState, Command | None]:
    """The view after `key`, and the command to run if the key confirmed one. `order` is the
    learners' ids as the table shows them (top to bottom)."""
    if state.confirm is not None:  # a question is open: y runs it, anything else cancels
        if key in ("y", "Y"):
            return replace(
                state, confirm=None, message=f"{state.confirm.action} {state.confirm.target}…"
            ), state.confirm
        return replace(state, confirm=None, message=f"{state.confirm.action} cancelled"), None
    state = replace(state, message="")
    if key == "q":
        return replace(state, quit=True), None
    if key == "?":
        return replace(state, panel="" if state.panel == "help" else "help"), None
    if key == "esc":
        return replace(state, panel=""), None
    if key in ("up", "down", "home", "end", "pgup", "pgdn"):
        return replace(state, selected=_moved(state.selected, key, order)), None
    if key == "enter":
        chosen = state.selected if state.selected in order else (order[0] if order else None)
        panel = "" if state.panel == "detail" or chosen is None else "detail"
        return replace(state, selected=chosen, panel=panel), None
    if key == "s":
        return replace(state, sort=SORTS[(SORTS.index(state.sort) + 1) % len(SORTS)]), None
    if key in ("k", "p"):
        if state.selected not in order:
            return replace(state, message="select a learner first (↑/↓)"), None
        assert state.selected is not None
        command = Command("kill", state.selected) if key == "k" else Command("pause", state.selected, PAUSE_S)
        return replace(state, confirm=command), None
    return state, None


def _moved(selected: str | None, key: str, order: list[str]) -> str | None:
    if not order:
        return None
    if selected not in order:  # nothing selected yet (or it left): start at the top or bottom
        return order[-1] if key in ("up", "end") else order[0]
    i = order.index(selected)
    step = {"up": -1, "down": 1, "pgup": -10, "pgdn": 10, "home": -len(order), "end": len(order)}[key]
    return order[max(0, min(len(order) - 1, i + step))]
