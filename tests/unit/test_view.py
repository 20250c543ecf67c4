"""The status view renders recorded snapshots (healthy, below quorum, syncer dead) to a capture
console; the tests assert on the text, on the size it takes, and that no clock is read."""

from __future__ import annotations

import copy
import io
import json
import math
import time
from pathlib import Path

import pytest
from rich.console import Console

from dldctl.observe.snapshot_model import Snapshot
from dldctl.observe.view import (
    STATE_STYLES,
    History,
    fmt_bytes,
    fmt_count,
    fmt_duration,
    fmt_pct,
    fmt_rate,
    quorum_colour,
    quorum_label,
    render_live,
    render_plain,
    sparkline,
    state_style,
)

SNAPSHOTS = Path(__file__).resolve().parents[1] / "data" / "snapshots"
typed = Snapshot.from_json  # the view's panels read the typed snapshot


def load(name: str) -> dict:
    return json.loads((SNAPSHOTS / f"{name}.json").read_text())


def history_of(snapshot: dict, points: int = 30) -> History:
    """A history leading up to `snapshot`, its numbers wobbling a little."""
    history = History()
    for i in range(points):
        earlier = copy.deepcopy(snapshot)
        earlier["now"] = snapshot["now"] - 2.0 * (points - i)
        if earlier.get("goodput") is not None:
            earlier["goodput"] = snapshot["goodput"] * (0.9 + 0.01 * (i % 10))
        for learner in earlier["learners"]:
            learner["tokens_per_s"] = (learner["tokens_per_s"] or 0.0) * (0.8 + 0.04 * (i % 6))
        history.add(earlier)
    history.add(snapshot)
    return history


def live_text(
    snapshot: dict, now: float | None = None, width: int = 100, height: int = 30, history: History | None = None
) -> str:
    console = Console(record=True, width=width, height=height, file=io.StringIO())
    now = snapshot.get("now", 0.0) if now is None else now
    console.print(render_live(snapshot, history if history is not None else history_of(snapshot), now))
    return console.export_text()


def plain_text(snapshot: dict, now: float | None = None, width: int = 100) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(render_plain(snapshot, snapshot.get("now", 0.0) if now is None else now))
    return console.export_text()


# ---------------------------------------------------------------- recorded snapshots, live view


def test_healthy_run_shows_every_panel() -> None:
    snap = load("healthy")
    text = live_text(snap)
    for title in ("quorum", "goodput", "loss", "throughput", "bandwidth", "learners", "events"):
        assert f"─ {title}" in text, title
    assert "demo-20251129-0941" in text
    assert "up 12m14s" in text
    assert "syncer tcp://127.0.0.1:5555" in text and "outer 412" in text and "ckpt 400" in text
    assert "quorum ● OK" in text and "live 4/4  min 3" in text and "last 4" in text
    assert "grace 0.41/0.90s" in text
    assert "87.3% run" in text and "91.2% last 60s" in text
    assert "7.0k tok/s" in text and "merged 5.4M" in text
    assert "305.1 kB/s" in text and "compression 8.1x" in text and "data-parallel 175.1 GB" in text
    assert "train 2.314" in text and "eval  2.451" in text
    for i in range(4):
        assert f"learner-{i}" in text
    assert "learner-3*" in text and "* straggler" in text  # the slow learner stands out
    assert "gpu-box" in text and "cuda:0" in text and "slow" in text
    assert "chaos kill --signal KILL" in text and "fault_inject" in text
    assert "syncer down" not in text.lower()


def test_healthy_run_fits_100x30() -> None:
    lines = live_text(load("healthy")).splitlines()
    assert len(lines) == 30
    assert all(len(line) <= 100 for line in lines)
    assert lines[0].startswith("╭") and lines[-1].startswith("╰")  # nothing cut off at the bottom
    assert "…" not in "\n".join(lines[:2])  # the header fits


def test_below_quorum_is_red_and_says_why() -> None:
    snap = load("below_quorum")
    text = live_text(snap)
    assert quorum_colour(typed(snap)) == "red"
    assert "quorum ● BELOW QUORUM" in text and "live 2/4  min 3" in text
    assert "4 rounds open, need 1 more" in text
    assert "partitioned" in text and "restarting" in text
    assert "quorum_lost" in text and "live 2 < min 3; rounds stay open" in text
    assert "learners 1/4 running" in text
    assert "41.2% last 60s" in text


def test_dead_syncer_is_said_not_failed_on() -> None:
    snap = load("syncer_dead")
    text = live_text(snap)
    assert "SYNCER DOWN" in text
    assert "quorum ● syncer down" in text
    assert "learners keep training" in text
    assert "ckpt 424" in text and "outer -" in text
    for i in range(4):
        assert f"learner-{i}" in text
    assert "syncer_death" in text and "chaos kill syncer --down-for 20" in text


# Snapshots `dldctl status --json` printed for a real fleet (2 fast + 2 throttled gpt-tiny
# learners, quorum 3): after a learner was killed and came back, with two learners paused, with
# the syncer killed and held down, and after `dldctl down`.
RECORDED = {
    "recorded_healthy": ["quorum ● OK", "live 4/4  min 3", "learners 4/4 running", "rejoin", "learner-1"],
    "recorded_below_quorum": ["quorum ● BELOW QUORUM", "live 2/4  min 3", "paused", "quorum_lost", "need 1 more"],
    "recorded_syncer_dead": [
        "SYNCER DOWN",
        "quorum ● syncer down",
        "learners keep training",
        "ckpt 600",
        "syncer_death",
        "4475",
    ],
    "recorded_down": ["RUN DOWN", "ran 1m06s", "the run is down", "stopped", "ckpt 600"],
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_snapshots_recorded_from_a_live_fleet(name: str) -> None:
    snap = load(name)
    assert snap["run"].startswith("recorded-") and len(snap["learners"]) == 4
    text = live_text(snap)
    for expected in RECORDED[name]:
        assert expected in text, (expected, text)
    lines = text.splitlines()
    assert len(lines) == 30 and all(len(line) <= 100 for line in lines)
    plain = plain_text(snap)
    assert "\x1b" not in plain and all(f"learner-{i}" in plain for i in range(4))


def test_states_are_coloured() -> None:
    assert state_style("running") == "green"
    for state in ("slow", "paused", "joining", "starting"):
        assert state_style(state) == "yellow"
    assert "red" in state_style("dead") and "magenta" in state_style("partitioned")
    assert state_style("restarting") == "cyan" and state_style("stopped") == "dim"
    assert state_style("weird") == "" and set(STATE_STYLES) >= {"running", "dead", "stopped"}
    console = Console(record=True, width=100, height=30, file=io.StringIO(), color_system="truecolor")
    snap = load("below_quorum")
    console.print(render_live(snap, history_of(snap), snap["now"]))
    html = console.export_html(inline_styles=True)
    assert "partitioned" in html and "#800080" in html  # magenta


def test_header_warns_about_what_an_operator_must_not_miss() -> None:
    snap = load("healthy")
    snap["insecure"] = True
    snap["syncer"].update(rejected={"stale_epoch": 2, "bad_auth": 1}, dropped_sends=4, restarts=1)
    before = copy.deepcopy(snap)
    before["now"] -= 5.0
    before["syncer"].update(rejected={}, dropped_sends=0)
    history = History()
    for each in (before, snap):
        history.add(each)
    text = live_text(snap, now=snap["now"] + 10.0, history=history)
    assert "INSECURE: no CURVE" in text and "rejected 3 in 60s" in text and "dropped sends 4 in 60s" in text
    assert "snapshot 10s old" in text and "restarts 1" in text
    plain = plain_text(snap)
    assert "notes" in plain and "INSECURE" in plain


# ---------------------------------------------------------------- quorum colour


def test_quorum_colour_rules() -> None:
    snap = load("healthy")
    assert quorum_colour(typed(snap)) == "green" and quorum_label(typed(snap)) == "OK"
    # partial rounds (fewer contributors than live learners, grace used up) are normal: still OK
    partial = copy.deepcopy(snap)
    partial["quorum"]["last_round_contributors"] = 1
    partial["quorum"]["grace_used_s"] = partial["quorum"]["grace_window_s"]
    assert quorum_colour(typed(partial)) == "green" and quorum_label(typed(partial)) == "OK"
    one_down = copy.deepcopy(snap)
    one_down["quorum"]["live"] = one_down["quorum"]["total"] - 1  # still >= min
    assert one_down["quorum"]["live"] >= one_down["quorum"]["min"]
    assert quorum_colour(typed(one_down)) == "yellow" and quorum_label(typed(one_down)) == "DEGRADED"
    fresh = copy.deepcopy(snap)
    fresh["quorum"].update(last_round_contributors=0, recent_contributors=[])
    assert quorum_label(typed(fresh)) == "NO ROUNDS YET"
    short = copy.deepcopy(snap)
    short["quorum"].update(live=2, below_quorum=False)
    assert quorum_colour(typed(short)) == "red"
    dead = typed(load("syncer_dead"))
    assert quorum_colour(dead) == "red" and quorum_label(dead) == "syncer down"
    assert quorum_colour(typed({})) == "red"


# ---------------------------------------------------------------- plain --once form


@pytest.mark.parametrize("name", ["healthy", "below_quorum", "syncer_dead"])
def test_plain_has_no_screen_control(name: str) -> None:
    snap = load(name)
    out = io.StringIO()
    Console(file=out, width=100).print(render_plain(snap, snap["now"]))  # not a terminal: no colour
    text = out.getvalue()
    assert "\x1b" not in text
    assert "demo-20251129-0941" in text and "learner-2" in text and "last " in text


def test_plain_snapshots_say_what_matters() -> None:
    healthy = plain_text(load("healthy"))
    assert "OK  live 4/4  min 3  last round 4" in healthy
    assert "87.3% run  91.2% last 60s" in healthy
    assert "373x ours" in healthy
    assert "restart 1 after 5.0s delay" in healthy
    below = plain_text(load("below_quorum"))
    assert "BELOW QUORUM  live 2/4" in below and "partitioned" in below and "quorum_lost" in below
    dead = plain_text(load("syncer_dead"))
    assert "SYNCER DOWN" in dead and "syncer down" in dead and "checkpoint 424" in dead


def test_the_global_loss_a_guard_trip_and_risky_settings_show_in_both_views() -> None:
    snap = load("healthy")
    snap["loss"] = {**snap["loss"], "global": 2.345}
    snap["guard"] = {
        "threshold": 0.1,
        "trips": 1,
        "rollbacks": 1,
        "last": {"loss": 3.1, "good": False, "outer_step": 40},
    }
    snap["syncer"] = {**snap["syncer"], "risks": ["max_backlog = 0: a backlog is merged as one outer step"]}
    plain = plain_text(snap)
    assert "global 2.345" in plain and "QUALITY GUARD: 1 trip(s), 1 rollback(s)" in plain and "FLAGGED" in plain
    assert "warning" in plain and "max_backlog = 0" in plain
    live = live_text(snap, width=160, height=60)
    assert "global" in live and "QUALITY GUARD: 1 trip(s)" in live
    assert "QUALITY GUARD" not in plain_text(load("healthy"))


# ---------------------------------------------------------------- the clock is injected


def test_ages_come_from_the_injected_now(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_clock(*_: object) -> float:
        raise AssertionError("the view read the clock")

    for name in ("time", "monotonic", "perf_counter"):
        monkeypatch.setattr(time, name, no_clock)
    snap = load("healthy")
    history = history_of(snap)
    first = live_text(snap, snap["now"], history=history)
    later = live_text(snap, snap["now"] + 60.0, history=history)
    assert "up 12m14s" in first and "up 13m14s" in later
    assert "13s ago" not in first and "12s ago" in first and "1m12s ago" in later
    assert "learner-0" in first and "0.3s" in first and "1m00s" in later  # heartbeat age grew
    assert "snapshot 1m00s old" in later and "old" not in first
    plain_now, plain_later = plain_text(snap, snap["now"]), plain_text(snap, snap["now"] + 60.0)
    assert "up 12m14s" in plain_now and "up 13m14s" in plain_later


def test_same_inputs_same_picture() -> None:
    snap = load("below_quorum")
    history = history_of(snap)
    assert live_text(snap, history=history) == live_text(snap, history=history)


# ---------------------------------------------------------------- degrade, never raise


@pytest.mark.parametrize("size", [(80, 24), (60, 15), (40, 10), (100, 12), (20, 4)])
@pytest.mark.parametrize("name", ["healthy", "below_quorum", "syncer_dead"])
def test_smaller_screens_degrade(size: tuple[int, int], name: str) -> None:
    width, height = size
    lines = live_text(load(name), width=width, height=height).splitlines()
    assert len(lines) <= height and all(len(line) <= width for line in lines)
    if height >= 10:
        assert "dldctl" in lines[0]
    if height >= 15:
        assert "quorum" in "\n".join(lines)


def test_many_learners_keep_the_troubled_ones_in_view() -> None:
    snap = load("healthy")
    base = snap["learners"]
    snap["learners"] = [dict(base[i % 4], id=f"learner-{i}") for i in range(24)]
    snap["learners"][21]["state"] = "dead"
    text = live_text(snap, history=History())
    assert "learner-21" in text and "dead" in text and "more" in text
    assert len(text.splitlines()) == 30


PARTIAL = [
    {},
    {"run": "r"},
    {"run": None, "syncer": None, "quorum": "?", "tokens": [], "bytes": 3, "loss": None},
    {"now": "x", "uptime_s": math.nan, "goodput": True, "learners": {}, "events": "?"},
    {
        "learners": [None, {}, {"id": None}, {"id": 7, "state": 3, "weight": "w", "heartbeat_age_s": "h"}],
        "events": [None, {}, {"t": "t", "kind": None}],
        "quorum": {"recent_contributors": [None, "x", 2]},
    },
]


@pytest.mark.parametrize("snapshot", PARTIAL)
def test_missing_fields_render_as_dashes(snapshot: dict) -> None:
    history = History()
    history.add(snapshot)
    text = live_text(snapshot, now=100.0, history=history)
    assert "-" in text and "SYNCER DOWN" in text  # no alive flag: the syncer is not known to be up
    assert "-" in plain_text(snapshot, now=100.0)


def test_not_a_dict_renders_too() -> None:
    assert "SYNCER DOWN" in live_text(None, now=0.0, history=History())  # type: ignore[arg-type]
    assert "syncer" in plain_text(None, now=0.0)  # type: ignore[arg-type]


# ---------------------------------------------------------------- sparkline, History, formatting


def test_sparkline_edges() -> None:
    assert sparkline([], 10) == ""
    assert sparkline([1, 2, 3], 0) == ""
    assert sparkline([5, 5, 5], 10) == "▄▄▄"
    assert sparkline([None, None], 5) == "  "
    assert sparkline([0, None, 1], 5) == "▁ █"
    assert sparkline([1.0, math.nan, math.inf, 2.0], 4) == "▁  █"
    assert sparkline(list(range(100)), 8) == "▁▂▃▄▅▆▇█"  # the newest 8, scaled among themselves
    assert sparkline([0, 10, 0, 10, 0, 10, 0, 10, 0, 10], 3) == "█▁█"
    assert sparkline([0.5, 0.5], 4, lo=0.0, hi=1.0) in ("▄▄", "▅▅")
    assert sparkline([0, 0], 4, lo=0.0) == "▁▁"
    assert sparkline([2.0, -1.0], 4, lo=0.0, hi=1.0) == "█▁"  # clamped into the fixed scale


def test_history_is_bounded_and_deduplicated() -> None:
    history = History(maxlen=5)
    snap = load("healthy")
    for i in range(12):
        step = copy.deepcopy(snap)
        step["now"] = snap["now"] + i
        step["goodput"] = i / 20
        history.add(step)
    assert len(history) == 5
    assert history.get("goodput") == [7 / 20, 8 / 20, 9 / 20, 10 / 20, 11 / 20]
    assert len(history.learner("learner-0")) == 5
    history.add(step)  # the same snapshot again: ignored
    assert len(history) == 5 and history.get("goodput")[-1] == 11 / 20
    assert history.get("bytes_per_s")[-1] == pytest.approx(305120.0 + 331870.5)
    assert history.get("no such series") == []
    fewer = copy.deepcopy(step)
    fewer["now"] += 1
    fewer["learners"] = fewer["learners"][:2]
    history.add(fewer)
    assert sorted(history.learner_ids()) == ["learner-0", "learner-1"]
    history.add(None)  # type: ignore[arg-type]
    history.add({})
    assert history.get("goodput")[-1] is None
    with pytest.raises(ValueError):
        History(maxlen=0)


def test_bytes_per_second_derived_when_the_snapshot_has_none() -> None:
    snap = load("healthy")
    for key in ("up_per_s", "down_per_s"):
        del snap["bytes"][key]
    later = copy.deepcopy(snap)
    later["now"] += 2.0
    later["bytes"]["up"] += 600_000
    later["bytes"]["down"] += 800_000
    history = History()
    history.add(snap)
    history.add(later)
    assert history.get("up_per_s") == [None, 300_000.0]
    assert history.latest("bytes_per_s") == 700_000.0
    text = live_text(later, history=history)
    assert "↑ 300.0 kB/s  ↓ 400.0 kB/s" in text


def test_fresh_run_waits_for_its_first_round() -> None:
    snap = load("healthy")
    snap["quorum"].update(last_round_contributors=0, recent_contributors=[], grace_window_s=0.0, grace_used_s=0.0)
    snap["bytes"]["compression_ratio"] = 0.0
    assert quorum_colour(typed(snap)) == "yellow" and quorum_label(typed(snap)) == "NO ROUNDS YET"
    text = live_text(snap, history=History())
    assert "quorum ● NO ROUNDS YET" in text and "compression -" in text


def test_formatters() -> None:
    assert fmt_bytes(None) == "-" and fmt_bytes(512) == "512 B" and fmt_bytes(1500) == "1.5 kB"
    assert fmt_bytes(175_077_000_000) == "175.1 GB"
    assert fmt_rate(305120.0) == "305.1 kB/s" and fmt_rate(12345, "tok") == "12.3k tok/s"
    assert fmt_rate(None) == "-"
    assert fmt_count(950) == "950" and fmt_count(6_224_896) == "6.2M"
    assert fmt_duration(None) == "-" and fmt_duration(-3) == "0.0s" and fmt_duration(0.42) == "0.4s"
    assert fmt_duration(45) == "45s" and fmt_duration(185) == "3m05s" and fmt_duration(3725) == "1h02m"
    assert fmt_duration(2 * 86400 + 3 * 3600) == "2d03h"
    assert fmt_pct(0.873) == "87.3%" and fmt_pct("x") == "-"


def test_piped_status_is_not_padded_and_shows_event_kinds_whole() -> None:
    """`dldctl status | cat`: no line padded with spaces to the console's width, and a kind such
    as `supervisor_start` whole (it was cut to `supervisor_sta…`)."""
    from dldctl.commands.status import print_plain

    snap = load("recorded_down")
    out = io.StringIO()
    console = Console(file=out, width=200, soft_wrap=True)  # what output_console() gives a pipe
    print_plain(console, render_plain(snap, snap["now"], max_events=40))
    lines = out.getvalue().splitlines()
    assert lines and all(line == line.rstrip() for line in lines)
    assert any(" supervisor_start " in line for line in lines)
    assert any(line.split()[2:3] == ["syncer_unreachable"] for line in lines if "ago" in line)
    assert "…" not in "".join(line for line in lines if "supervisor_st" in line)


def test_plain_bytes_line_says_the_bytes_down() -> None:
    """The `bytes` line read the run's status word into the bytes-down figure (it said `down -`)."""
    snap = load("recorded_healthy")
    out = io.StringIO()
    Console(file=out, width=200).print(render_plain(snap, snap["now"]))
    line = next(x for x in out.getvalue().splitlines() if x.startswith("bytes"))
    assert "up 25.6 MB" in line and "down 28.5 MB" in line
