"""`dldctl logs` over several targets, the pure part: glob matching, line times, merging, prefixes."""

from __future__ import annotations

import time

from dldctl.observe import logmerge

KNOWN = ["learner-10", "supervisor", "learner-2", "syncer", "learner-0", "learner-1", "watchdog"]


def at(text: str) -> float:
    return time.mktime(time.strptime(text, "%Y-%m-%d %H:%M:%S"))


def test_known_order_puts_syncer_first_and_learners_by_number() -> None:
    assert logmerge.known_order(KNOWN) == [
        "syncer", "learner-0", "learner-1", "learner-2", "learner-10", "supervisor", "watchdog"
    ]  # fmt: skip


def test_globs_and_names_pick_targets_once_in_known_order() -> None:
    chosen, unmatched = logmerge.match_targets(["syncer", "learner-*", "learner-1"], KNOWN)
    assert chosen == ["syncer", "learner-0", "learner-1", "learner-2", "learner-10"]
    assert unmatched == []
    assert logmerge.match_targets(["learner-[12]"], KNOWN) == (["learner-1", "learner-2"], [])


def test_a_pattern_that_names_nothing_is_reported() -> None:
    chosen, unmatched = logmerge.match_targets(["learner-9*", "syncer", "worker-*"], KNOWN)
    assert chosen == ["syncer"]
    assert unmatched == ["learner-9*", "worker-*"]


def test_line_time_reads_dated_and_clock_only_stamps() -> None:
    now = at("2026-12-02 12:30:00")
    assert logmerge.line_time("2026-12-02 12:01:02 restart learner-2: ...", now) == at("2026-12-02 12:01:02")
    assert logmerge.line_time("12:01:02 [learner-1 #2] step 40", now) == at("2026-12-02 12:01:02")
    assert logmerge.line_time("23:59:58 before midnight", now) == at("2026-12-01 23:59:58")  # yesterday's
    assert logmerge.line_time("Traceback (most recent call last):", now) is None
    assert logmerge.line_time("12:01:023 not a stamp", now) is None


def test_unstamped_lines_belong_to_the_line_above() -> None:
    now = at("2026-12-02 12:30:00")
    rows = logmerge.stamped(["preamble", "2026-12-02 12:00:00 error", "Traceback", "  File x", "12:00:05 ok"], now)
    assert [t for t, _ in rows] == [None, at("2026-12-02 12:00:00"), at("2026-12-02 12:00:00"),
                                    at("2026-12-02 12:00:00"), at("2026-12-02 12:00:05")]  # fmt: skip
    assert logmerge.since(rows, at("2026-12-02 12:00:01")) == [(at("2026-12-02 12:00:05"), "12:00:05 ok")]


def test_merge_orders_by_time_and_keeps_each_log_whole() -> None:
    now = at("2026-12-02 12:30:00")
    streams = {
        "learner-0": logmerge.stamped(["12:00:01 a0", "12:00:04 b0", "  continued b0", "12:00:05 c0"], now),
        "learner-1": logmerge.stamped(["12:00:02 a1", "12:00:04 b1"], now),
        "syncer": logmerge.stamped(["no stamp yet", "2026-12-02 12:00:03 s"], now),
    }
    merged = logmerge.merge(streams)
    assert [line for _, line in merged] == [
        "no stamp yet", "12:00:01 a0", "12:00:02 a1", "2026-12-02 12:00:03 s",
        "12:00:04 b0", "  continued b0", "12:00:04 b1", "12:00:05 c0",
    ]  # fmt: skip
    assert merged[0][0] == "syncer" and merged[5][0] == "learner-0"


def test_merge_of_unordered_lines_keeps_every_line_and_each_log_s_order() -> None:
    now = at("2026-12-02 12:30:00")
    streams = {
        "a": logmerge.stamped(["12:00:09 late", "12:00:01 early"], now),
        "b": logmerge.stamped(["12:00:05 b"], now),
    }
    merged = logmerge.merge(streams)
    assert sorted(line for _, line in merged) == ["12:00:01 early", "12:00:05 b", "12:00:09 late"]
    a_lines = [line for target, line in merged if target == "a"]
    assert a_lines == ["12:00:09 late", "12:00:01 early"]


def test_prefixes_line_up() -> None:
    width = logmerge.prefix_width(["syncer", "learner-10", "learner-2"])
    assert width == 10
    assert logmerge.prefixed("syncer", "x", width) == "syncer     | x"
    assert logmerge.prefixed("learner-10", "y", width) == "learner-10 | y"
    assert logmerge.prefix_width([]) == 0
