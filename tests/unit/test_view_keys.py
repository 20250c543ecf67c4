"""The live view's pure parts beyond the panels: the keys (decoding and the state machine), one
consistent frame from a snapshot with a dead learner, sorting, the 80x24 layout keeping every
key figure whole, the sparklines' scale, and warnings that clear when their cause is gone."""

from __future__ import annotations

import copy
import io
import json
import os
import re
import termios
from pathlib import Path

import pytest
from rich.console import Console

from dldctl.observe.view import History, render_live, render_plain
from dldctl.observe.view_data import spark_scale, sparkline
from dldctl.observe.view_frame import consistent, learner_order, sort_learners
from dldctl.observe.view_keys import PAUSE_S, Command, ViewState, decode, press
from dldctl.observe.view_panels import Spark
from dldctl.observe.view_tty import KeyReader, Sources, drive

SNAPSHOTS = Path(__file__).resolve().parents[1] / "data" / "snapshots"
ORDER = ["learner-0", "learner-1", "learner-2"]


def load(name: str) -> dict:
    return json.loads((SNAPSHOTS / f"{name}.json").read_text())


def screen(snapshot: dict, history: History, width: int = 80, height: int = 24, **kw: object) -> str:
    console = Console(record=True, width=width, height=height, file=io.StringIO())
    console.print(render_live(snapshot, history, snapshot["now"], **kw))  # type: ignore[arg-type]
    return console.export_text()


def run_keys(keys: list[str], order: list[str] = ORDER, state: ViewState | None = None) -> tuple[ViewState, list]:
    state, done = state or ViewState(), []
    for key in keys:
        state, command = press(state, key, order)
        done += [command] if command else []
    return state, done


# ---------------------------------------------------------------- keys


def test_decode_names_escape_sequences_and_drops_unknown_ones() -> None:
    assert decode("q") == ["q"]
    assert decode("\x1b[A\x1b[B\x1bOA\r\n") == ["up", "down", "up", "enter", "enter"]
    assert decode("?\x1b[6~\x1b[H\x1b") == ["?", "pgdn", "home", "esc"]
    assert decode("\x1b[1;5Ck") == ["k"]  # ctrl-right is unknown: dropped whole, its letters never keys


def test_q_quits_and_question_mark_toggles_the_help() -> None:
    assert run_keys(["q"])[0].quit
    assert run_keys(["?"])[0].panel == "help"
    assert run_keys(["?", "?"])[0].panel == ""
    assert run_keys(["?", "esc"])[0].panel == ""
    assert run_keys(["?", "q"])[0].quit  # q quits from a panel too


def test_arrows_select_within_the_order_shown() -> None:
    assert run_keys(["down"])[0].selected == "learner-0"  # the first press selects the top row
    assert run_keys(["up"])[0].selected == "learner-2"
    assert run_keys(["down", "down", "down", "down", "down"])[0].selected == "learner-2"  # stops at the end
    assert run_keys(["down", "down", "up", "up", "up"])[0].selected == "learner-0"
    assert run_keys(["end"])[0].selected == "learner-2" and run_keys(["down", "end", "home"])[0].selected == "learner-0"
    # the selection is an id: it follows its learner when the order changes
    state, _ = run_keys(["down", "down"])
    assert run_keys(["down"], ["learner-2", "learner-1", "learner-0"], state)[0].selected == "learner-0"
    assert run_keys(["down"], [])[0].selected is None


def test_enter_opens_and_closes_the_detail_of_the_selection() -> None:
    state, _ = run_keys(["down", "down", "enter"])
    assert state.panel == "detail" and state.selected == "learner-1"
    assert run_keys(["enter"], state=state)[0].panel == ""
    assert run_keys(["enter"])[0] == ViewState(selected="learner-0", panel="detail")  # nothing selected: the top
    assert run_keys(["enter"], [])[0].panel == ""


def test_kill_and_pause_ask_first_and_only_y_runs_them() -> None:
    state, done = run_keys(["down", "k"])
    assert state.confirm == Command("kill", "learner-0") and done == []
    assert run_keys(["y"], state=state)[1] == [Command("kill", "learner-0")]
    for other in ("n", "N", "\r", "esc", "k", "q"):  # anything else cancels (q too: it does not quit here)
        after, done = run_keys([other], state=state)
        assert done == [] and after.confirm is None and not after.quit and "cancelled" in after.message
    state, done = run_keys(["down", "down", "p", "Y"])
    assert done == [Command("pause", "learner-1", PAUSE_S)] and state.confirm is None


def test_kill_without_a_selection_says_how_to_select() -> None:
    state, done = run_keys(["k"])
    assert done == [] and state.confirm is None and "select a learner" in state.message
    assert run_keys(["k", "down"])[0].message == ""  # the next key clears it


def test_s_cycles_the_sort_column() -> None:
    assert [run_keys(["s"] * n)[0].sort for n in range(6)] == ["learner", "state", "tok/s", "step", "hb", "learner"]


# ---------------------------------------------------------------- one consistent frame


def just_killed() -> dict:
    """The frame of the reported defect: the state says dead, the syncer still counts it live."""
    snap = load("recorded_healthy")
    snap["learners"][1]["state"] = "dead"  # tokens_per_s still its last rate, as the syncer reported
    return snap


def test_a_dead_learner_shows_no_rate_and_the_quorum_agrees() -> None:
    snap = just_killed()
    frame = consistent(snap)
    assert snap["quorum"]["live"] == 4 and snap["learners"][1]["tokens_per_s"] > 0  # the input is untouched
    assert frame.quorum.live == 3 and frame.learners[1].tokens_per_s is None
    assert frame.tokens.per_s == pytest.approx(sum(r.tokens_per_s or 0 for r in frame.learners))
    text = screen(snap, History(), 100, 30)
    assert "live 3/4" in text and "live 4/4" not in text and "learners 3/4 running" in text
    assert "DEGRADED" in text and "OK" not in text.split("quorum")[1][:8]
    row = next(line for line in text.splitlines() if "learner-1" in line and "dead" in line)
    assert re.search(r"dead\s+\d+\s+-\s", row), row  # no tok/s beside `dead`
    assert consistent(frame) == frame  # idempotent
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(render_plain(snap, snap["now"]))  # `--once` shows the same consistent frame
    plain = console.export_text()
    assert "live 3/4" in plain and re.search(r"learner-1 .* dead\s+\d+\s+-\s", plain), plain


def test_a_frame_below_quorum_after_the_kill_says_so() -> None:
    snap = just_killed()
    snap["learners"][2]["state"] = "paused"
    frame = consistent(snap)
    assert frame.quorum.live == 2 and frame.quorum.below_quorum is True


def test_sorting_orders_rows_and_arrow_keys_alike() -> None:
    snap = load("recorded_healthy")
    assert learner_order(snap, "learner") == ["learner-0", "learner-1", "learner-2", "learner-3"]
    assert learner_order(snap, "tok/s") == ["learner-1", "learner-0", "learner-2", "learner-3"]
    dead = consistent(just_killed())
    assert learner_order(dead, "state")[0] == "learner-1"
    assert learner_order(dead, "tok/s")[-1] == "learner-1"  # no rate sorts last
    assert sort_learners(dead.learners, "step")[0].id == "learner-0"
    text = screen(snap, History(), 100, 30, ui=ViewState(sort="tok/s"))
    rows = [line for line in text.splitlines() if re.match(r"│ learner-\d", line)]
    assert [r.split()[1] for r in rows] == ["learner-1", "learner-0", "learner-2", "learner-3"]
    assert "tok/s▾" in text and "sorted by tok/s" in text


# ---------------------------------------------------------------- 80 x 24


def history_of(snapshot: dict, points: int = 20) -> History:
    history = History()
    for i in range(points):
        earlier = copy.deepcopy(snapshot)
        earlier["now"] = snapshot["now"] - (points - i)
        history.add(earlier)
    history.add(snapshot)
    return history


KEY_FIGURES = {
    "healthy": [
        "up 12m14s", "outer 412", "ckpt 400", "live 4/4", "min 3", "87.3%", "91.2%", "train 2.314", "eval  2.451",
        "7.0k tok/s", "merged 5.4M", "305.1 kB/s", "331.9 kB/s", "175.1 GB", "469.7 MB", "(373x)",
    ],
    "recorded_healthy": ["live 4/4", "47.4k tok/s", "merged 1.4M", "63.1%", "61.9%", "train 1.818", "eval  1.971"],
    "below_quorum": ["live 2/4", "min 3", "need 1 more", "41.2%"],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(KEY_FIGURES))
def test_80x24_keeps_every_key_figure_whole(name: str) -> None:
    snap = load(name)
    for ui in (None, ViewState()):
        text = screen(snap, history_of(snap), ui=ui)
        lines = text.splitlines()
        assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
        for figure in KEY_FIGURES[name]:
            assert figure in text, (figure, text)
        for learner in snap["learners"]:
            assert learner["id"] in text
        # a cut figure would end in an ellipsis right after a digit: columns go, digits stay
        assert not re.search(r"\d…", text), text


def test_80x24_detail_and_help_panels() -> None:
    snap = load("recorded_healthy")
    ui = ViewState(selected="learner-1", panel="detail")
    text = screen(snap, history_of(snap), ui=ui, log=["12:00:00 learner-1: step 20 loss 2.5", "last line"])
    assert len(text.splitlines()) == 24
    assert "learner-1  on fast  running" in text and "recent log lines" in text and "last line" in text
    assert "rejoin" in text and "pid 10894" in text  # its own events
    help_text = screen(snap, history_of(snap), ui=ViewState(panel="help"))
    for words in ("q ", "quit", "select a learner", "kill the selected learner", "pause"):
        assert words in help_text
    asking = screen(snap, history_of(snap), ui=ViewState(selected="learner-0", confirm=Command("kill", "learner-0")))
    assert "kill learner-0 (SIGKILL; the supervisor restarts it)? y/N" in asking.splitlines()[-1]


# ---------------------------------------------------------------- sparkline scale


def test_noise_draws_flat_and_real_moves_still_show() -> None:
    assert sparkline([2.700, 2.700, 2.701, 2.703, 2.703], 10) in ("▄▄▄▅▅", "▄▄▄▄▄", "▄▄▅▅▅")
    assert sparkline([2.7, 2.5, 2.3, 2.1], 10) == "█▆▃▁"
    low, high = spark_scale([2.700, 2.703]) or (0.0, 0.0)
    assert high - low == pytest.approx(0.05 * 2.703)
    assert spark_scale([0.0, 0.0]) == (0.0, 0.0) and sparkline([0.0, 0.0], 3) == "▄▄"
    assert spark_scale([]) is None and spark_scale([1.0, 5.0], lo=0.0) == (0.0, 5.0)


def test_a_sparkline_shows_its_scale_where_it_fits() -> None:
    def render(spark: Spark, width: int) -> str:
        console = Console(record=True, width=width, file=io.StringIO())
        console.print(spark)
        return console.export_text().rstrip("\n")

    values = [2.700, 2.703, 2.701]
    assert render(Spark("eval ", values, fmt=lambda v: f"{v:.3f}"), 40).endswith(" 2.700–2.703")
    assert render(Spark("", [10.0, 20.0], lo=0.0, fmt=lambda v: f"{v:.0f}"), 30).endswith(" 0–20")
    narrow = render(Spark("eval ", values, fmt=lambda v: f"{v:.3f}"), 12)
    assert "2.700–" not in narrow and len(narrow) <= 12  # no room: the scale goes, not the sparkline


# ---------------------------------------------------------------- warnings clear


def test_dropped_sends_warn_while_they_rise_and_clear_a_minute_later() -> None:
    snap = load("healthy")
    history, t0 = History(), snap["now"]
    for i, dropped in enumerate([0, 0, 5, 9, 9]):
        each = copy.deepcopy(snap)
        each["now"], each["syncer"]["dropped_sends"] = t0 + 10 * i, dropped
        history.add(each)
    assert history.recent_rise("dropped_sends") == 9
    assert "dropped sends 9 in 60s" in screen(each, history, 100, 30)
    for i in range(5, 14):  # no more drops: the lifetime counter stays at 9
        each = copy.deepcopy(each)
        each["now"] = t0 + 10 * i
        history.add(each)
    assert history.recent_rise("dropped_sends") == 0
    assert "dropped sends" not in screen(each, history, 100, 30)
    restarted = copy.deepcopy(each)  # a restarted syncer counts from 0 again
    restarted["now"], restarted["syncer"]["dropped_sends"] = each["now"] + 1, 2
    history.add(restarted)
    assert history.recent_rise("dropped_sends") == 2


# ---------------------------------------------------------------- the terminal, restored


def test_the_key_reader_reads_keys_and_restores_the_terminal_on_an_exception() -> None:
    master, slave = os.openpty()
    try:
        with os.fdopen(os.dup(slave), "r") as stream:
            before = termios.tcgetattr(slave)
            with pytest.raises(KeyboardInterrupt), KeyReader(stream) as keys:  # as SIGTERM or Ctrl-C does
                assert not termios.tcgetattr(slave)[3] & termios.ICANON  # cbreak: keys one by one
                os.write(master, b"\x1b[Bq")
                assert decode(keys.read(2.0)) == ["down", "q"]
                assert keys.read(0.0) == ""
                raise KeyboardInterrupt
            assert termios.tcgetattr(slave) == before
    finally:
        os.close(master)
        os.close(slave)


def test_the_key_reader_without_a_terminal_reads_nothing() -> None:
    with KeyReader(io.StringIO()) as keys:
        assert keys.fd is None and keys.read(0.0) == ""


# ---------------------------------------------------------------- the loop, with scripted keys


class ScriptedKeys(KeyReader):
    """Keys from a script, one chunk per read, instead of a terminal."""

    def __init__(self, chunks: list[str]) -> None:
        super().__init__(io.StringIO())
        self.chunks = chunks

    def read(self, timeout: float) -> str:
        return self.chunks.pop(0) if self.chunks else "q"


def test_the_loop_runs_what_the_keys_say_and_stops_on_q() -> None:
    snap, asked, done = load("recorded_healthy"), [], []

    def act(command: Command) -> str:
        done.append(command)
        return "killed it"

    sources = Sources(collect=lambda: snap, log=lambda lid: asked.append(lid) or [f"{lid}: a line"], act=act)
    console = Console(file=io.StringIO(), width=80, height=24, force_terminal=True)
    keys = ScriptedKeys(["\x1b[B\x1b[B", "\r", "k", "y", "s"])
    state = drive(sources, 0.01, console, keys)
    assert state.quit and state.selected == "learner-1" and state.panel == "detail" and state.sort == "state"
    assert done == [Command("kill", "learner-1")] and asked and set(asked) == {"learner-1"}
    assert "killed it" in console.file.getvalue()  # type: ignore[attr-defined]


def test_a_refused_kill_is_said_in_the_view(monkeypatch: pytest.MonkeyPatch) -> None:
    from dldctl.commands import status
    from dldctl.errors import ChaosError

    class Refusing:
        def __init__(self, run: object) -> None:
            self.closed = False

        def guard(self, action: str, target: str, force: bool, confirm: object) -> None:
            assert not force and confirm is None  # the view asked already: the guard must not ask again
            raise ChaosError(f"refused: {action} {target} would leave 0 live learners", hint="pass --force")

        def close(self) -> None:
            pass

    monkeypatch.setattr(status, "Chaos", Refusing)
    said = status._act(object(), Command("kill", "learner-0"))  # type: ignore[arg-type]
    assert said.startswith("refused: kill learner-0 would leave 0 live learners")
    assert "dldctl chaos kill learner-0 --force" in said


def test_a_kill_confirmed_in_the_view_is_attributed_to_the_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """The view's kill goes through chaos with `by` naming the view, so the death event and the
    fault_inject event say the view asked, not `dldctl chaos`."""
    from dldctl.commands import status

    asked: list[tuple[str, str | None]] = []

    class Recording:
        def __init__(self, run: object) -> None:
            pass

        def guard(self, action: str, target: str, force: bool, confirm: object) -> None:
            pass

        def kill(self, target: str, by: str | None = None) -> object:
            asked.append((target, by))
            return type("Done", (), {"detail": "kill -KILL pid 7 on local"})()

        def close(self) -> None:
            pass

    monkeypatch.setattr(status, "Chaos", Recording)
    said = status._act(object(), Command("kill", "learner-0"))  # type: ignore[arg-type]
    assert said == "kill learner-0: kill -KILL pid 7 on local"
    assert asked == [("learner-0", status.VIEW)] and "live view" in status.VIEW
