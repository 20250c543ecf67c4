"""`dldctl events`: the filter and the line (pure), `past` + `follow` across a half-written line and
a rotation (nothing lost, nothing twice), and the real command on a run directory written here:
filtered past events as text and JSON lines, and `-f` printing an event appended while it runs
until SIGTERM stops it (exit 0)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dldctl import eventlog, rundir
from dldctl.runstate import RunState
from dldctl.testing import DLDCTL

T0 = 1_796_190_000.0


def test_filter_by_kind_target_glob_and_age() -> None:
    death = {"t": T0, "kind": "death", "target": "learner-2", "detail": "gone"}
    ckpt = {"t": T0 - 600, "kind": "checkpoint", "target": "syncer", "detail": "ckpt"}
    assert eventlog.Filter()(death) and eventlog.Filter()(ckpt)
    assert eventlog.Filter(frozenset({"death", "restart"}))(death) and not eventlog.Filter(frozenset({"death"}))(ckpt)
    assert eventlog.Filter(target="learner-*")(death) and not eventlog.Filter(target="learner-*")(ckpt)
    assert eventlog.Filter(since=T0 - 60)(death) and not eventlog.Filter(since=T0 - 60)(ckpt)
    assert not eventlog.Filter(since=T0)({"kind": "x"})  # no time: not known to be recent


def test_line_names_the_date_only_when_it_is_not_today() -> None:
    record = {"t": T0, "kind": "death", "target": "learner-2", "detail": "process gone"}
    today = time.strftime("%Y-%m-%d", time.localtime(T0))
    assert eventlog.line(record, today).split()[1:] == ["death", "learner-2", "process", "gone"]
    assert eventlog.line(record, "1999-01-01").startswith(today + " ")


def _append(path: Path, *records: dict[str, object], raw: bytes = b"") -> None:
    with open(path, "ab") as fh:
        fh.write(b"".join(json.dumps(r).encode() + b"\n" for r in records) + raw)


def test_follow_goes_on_from_past_across_a_partial_line_and_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    _append(path, {"kind": "a"}, raw=b'{"kind": "b"')  # b is being written
    so_far, where = eventlog.past(path)
    assert [r["kind"] for r in so_far] == ["a"]
    got: list[str] = []
    stream = eventlog.follow(path, lambda: len(got) >= 3, where, poll_s=0.01)
    _append(path, raw=b"}\n")
    got.append(next(stream)["kind"])
    path.rename(path.with_name("events.jsonl.1"))  # rotated past max_log_mb
    _append(path, {"kind": "c"}, {"kind": "d"})
    got += [next(stream)["kind"], next(stream)["kind"]]
    assert got == ["b", "c", "d"]


def _run_with_events(home: Path, monkeypatch: pytest.MonkeyPatch) -> rundir.RunDir:
    monkeypatch.setenv("DLDCTL_HOME", str(home))
    run = rundir.create("ev")
    with run.locked():
        run.write_state(RunState(status="up", run="ev", created=time.time()))
    now = time.time()
    _append(
        run.events,
        {"t": now - 3600, "kind": "checkpoint", "target": "syncer", "detail": "old"},
        {"t": now - 5, "kind": "death", "target": "learner-1", "detail": "process gone after 2.0 s"},
        {"t": now - 4, "kind": "restart", "target": "learner-1", "detail": "pid 7"},
        {"t": now - 3, "kind": "death", "target": "syncer", "detail": "syncer gone"},
    )
    return run


def test_the_command_filters_past_events_and_follows_new_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run_with_events(tmp_path, monkeypatch)
    env = dict(os.environ, DLDCTL_HOME=str(tmp_path))
    text = subprocess.run([DLDCTL, "events", "--since", "1m"], env=env, capture_output=True, text=True, check=True)
    assert [ln.split()[1] for ln in text.stdout.splitlines()] == ["death", "restart", "death"]
    picked = subprocess.run(
        [DLDCTL, "events", "--kind", "death,checkpoint", "--target", "learner-*", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    records = [json.loads(ln) for ln in picked.stdout.splitlines()]
    assert [(r["schema"], r["kind"], r["target"]) for r in records] == [(eventlog.SCHEMA, "death", "learner-1")]
    follower = subprocess.Popen(
        [DLDCTL, "events", "-f", "--tail", "0", "--kind", "quorum_lost", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert follower.stdout is not None
    try:
        # --tail 0: whatever it prints, it followed; keep appending until it has started following
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            _append(run.events, {"t": time.time(), "kind": "checkpoint", "target": "syncer", "detail": "not shown"})
            _append(run.events, {"t": time.time(), "kind": "quorum_lost", "target": "syncer", "detail": "1 live"})
            if select.select([follower.stdout], [], [], 0.5)[0]:
                break
        shown = json.loads(follower.stdout.readline())
        assert (shown["kind"], shown["detail"]) == ("quorum_lost", "1 live")
    finally:
        follower.send_signal(signal.SIGTERM)  # as a script stops it
        follower.communicate(timeout=30)
    assert follower.returncode == 0
