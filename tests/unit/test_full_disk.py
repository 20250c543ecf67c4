"""No write can kill a process: syncer.common.jsonl's guarded writers, rotation, and the run's state.

Real ENOSPC from a 64 KiB tmpfs (tests/tinyfs.py; skipped where it cannot be mounted), and EIO
injected at the real os.write call. A guarded write drops and counts, says so once when dropping
starts and once when it resumes, never raises, and never leaves a cut line that swallows the next
record; a file over its cap is rotated to NAME.1 and read back in order.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dldctl.rundir import RunDir
from dldctl.runstate import Proc, RunState
from syncer.common import jsonl, jsonlread
from syncer.common.settings import RunSettings, SettingsError, settings_from_dict
from tests import tinyfs

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def fs(tmp_path: Path) -> Iterator[Path]:
    with tinyfs.mounted(tmp_path / "fs", "64k") as path:
        yield path


def events(path: Path) -> list[dict]:
    return list(jsonlread.read(path))


def test_append_to_a_full_disk_drops_counts_and_resumes(fs: Path, tmp_path: Path, capsys) -> None:
    log, notes = fs / "metrics.jsonl", tmp_path / "events.jsonl"
    assert jsonl.append(log, {"t": 1.0, "n": 0}, notices=notes)
    filler = tinyfs.fill(fs)
    before = jsonl.dropped().get("metrics.jsonl", 0)
    results = [jsonl.append(log, {"t": 2.0, "n": i, "pad": "x" * 500}, notices=notes) for i in range(1, 40)]
    assert results[-1] is False and results.count(False) >= 30  # the last page's tail may take a few
    assert jsonl.dropped()["metrics.jsonl"] - before == results.count(False)
    dropped = [e for e in events(notes) if e["kind"] == "write_dropped"]
    assert len(dropped) == 1, dropped  # said once, not once per record
    assert "disk full writing metrics.jsonl: dropping records until space is back" in dropped[0]["detail"]
    filler.unlink()
    assert jsonl.append(log, {"t": 3.0, "n": 99}, notices=notes)
    resumed = [e for e in events(notes) if e["kind"] == "write_resumed"]
    assert len(resumed) == 1 and f"{results.count(False)} records were dropped (disk full)" in resumed[0]["detail"]
    assert [r["n"] for r in jsonlread.read(log)][-1] == 99  # every readable line is a whole record
    assert "disk full writing metrics.jsonl" in capsys.readouterr().err  # and the process's log says so too
    assert jsonl.append(log, {"t": 4.0, "n": 100}, notices=notes)
    assert len([e for e in events(notes) if e["kind"] == "write_resumed"]) == 1


def test_a_line_cut_by_the_full_disk_costs_itself_only(fs: Path) -> None:
    writer = jsonl.Writer(fs / "metrics.jsonl", max_bytes=0)
    assert writer.write({"t": 1.0, "n": 1})
    filler = tinyfs.fill(fs)
    os.truncate(filler, os.path.getsize(filler) - 4096)  # room for part of the next record only
    assert writer.write({"t": 2.0, "n": 2, "pad": "y" * 20000}) is False
    assert (fs / "metrics.jsonl").stat().st_size > 4000  # a cut line is on disk
    filler.unlink()
    assert writer.write({"t": 3.0, "n": 3})
    writer.close()
    assert [r["n"] for r in jsonlread.read(fs / "metrics.jsonl")] == [1, 3]


def test_eio_at_the_real_write_is_dropped_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log, notes = tmp_path / "events.jsonl", tmp_path / "notes.jsonl"
    real = os.write

    def failing(fd: int, data: bytes) -> int:  # a failing disk under events.jsonl only
        if os.readlink(f"/proc/self/fd/{fd}") == str(log):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, data)

    writer = jsonl.Writer(log, max_bytes=0)
    writer.sink.notices = notes
    monkeypatch.setattr(os, "write", failing)
    assert [writer.write({"t": float(i)}) for i in range(5)] == [False] * 5
    monkeypatch.setattr(os, "write", real)
    assert writer.write({"t": 9.0})
    writer.close()
    kinds = [(e["kind"], e["detail"]) for e in events(notes)]
    assert kinds[0][0] == "write_dropped" and "Input/output error writing events.jsonl" in kinds[0][1]
    assert "until it can write again" in kinds[0][1]
    assert kinds[1][0] == "write_resumed" and "5 records were dropped (Input/output error)" in kinds[1][1]
    assert [r["t"] for r in jsonlread.read(log)] == [9.0]


def test_rotation_keeps_one_old_segment_and_reads_in_order(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    writer = jsonl.Writer(log, max_bytes=2000)
    for i in range(200):
        assert writer.write({"t": float(i), "kind": "sample", "pad": "z" * 40})
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "metrics.jsonl.1"]
    assert log.stat().st_size <= 2000 and (tmp_path / "metrics.jsonl.1").stat().st_size <= 2000
    seen = [r["t"] for r in jsonlread.read(log)]
    assert seen == sorted(seen) and seen[-1] == 199.0 and len(seen) > 20  # the old segment, then the new
    assert [r["t"] for r in jsonlread.tail(log, len(seen))] == seen  # tail spans both segments too
    assert [r["t"] for r in jsonlread.read(log, since=190.0)] == [float(i) for i in range(190, 200)]


def test_two_writers_rotate_once_not_twice(tmp_path: Path) -> None:
    """Two appenders on one file (two processes' worth of open file descriptions): one rotates,
    the other notices the file is not its own any more and follows, so no segment is lost."""
    log = tmp_path / "events.jsonl"
    a, b = jsonl.Writer(log, max_bytes=3000), jsonl.Writer(log, max_bytes=3000)
    for i in range(60):
        (a if i % 2 else b).write({"t": float(i), "pad": "p" * 60})
    a.close(), b.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "events.jsonl.1"]
    assert log.stat().st_size <= 3000
    seen = [r["t"] for r in jsonlread.read(log)]
    assert seen == [float(i) for i in range(60 - len(seen), 60)]  # a contiguous, ordered suffix


def test_guarded_stream_never_raises_and_rotates_its_log(fs: Path, capsys) -> None:
    path = fs / "learner-0.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        stream = jsonl.GuardedStream(fd, max_bytes=0)
        print("before", file=stream, flush=True)
        filler = tinyfs.fill(fs)
        for i in range(200):
            print(f"step {i} " + "l" * 200, file=stream, flush=True)  # print() on a full disk raises without the guard
        assert stream.sink.dropped > 100
        filler.unlink()
        print("after", file=stream, flush=True)
        text = path.read_text()
        assert text.startswith("before\n") and text.endswith("\nafter\n")
        assert "writing learner-0.log again:" in capsys.readouterr().err
        stream.sink.max_bytes = len(text) + 50
        for i in range(5):
            print(f"line {i} " + "r" * 40, file=stream, flush=True)
        assert (fs / "learner-0.log.1").read_text().startswith("before\n")  # the old log, renamed
        assert path.read_text().startswith("line ")  # the descriptor now writes a new file
        assert os.fstat(fd).st_ino == path.stat().st_ino
    finally:
        os.close(fd)


def test_state_that_cannot_be_written_is_kept_until_it_can(fs: Path) -> None:
    run = RunDir(fs / "run")
    run.path.mkdir()
    with run.locked():
        run.write_state(RunState(status="up", procs={"learner-0": Proc("learner", "a", restarts=1)}))
    filler = tinyfs.fill(fs)
    with run.update() as edit:  # no OSError out of here
        edit.state = edit.state.with_proc("learner-0", Proc("learner", "a", restarts=2))
    assert json.loads(run.state_file.read_text())["procs"]["learner-0"]["restarts"] == 1  # the file is intact
    assert run.read_state().procs["learner-0"].restarts == 2  # this process remembers
    assert not [p for p in run.path.iterdir() if p.name.endswith(".tmp")]
    run.event("death", "learner-0", "dropped, not raised")
    filler.unlink()
    with run.update() as edit:
        edit.state = edit.state.with_proc("learner-0", Proc("learner", "a", restarts=3))
    assert json.loads(run.state_file.read_text())["procs"]["learner-0"]["restarts"] == 3
    kinds = [(e["kind"], e["detail"]) for e in jsonlread.read(run.events)]
    assert any(k == "write_resumed" and "state.json again: 1 changes" in d for k, d in kinds), kinds


def test_another_writer_of_the_state_wins_over_a_kept_one(fs: Path) -> None:
    run, other = RunDir(fs / "run"), RunDir(fs / "run")
    run.path.mkdir()
    with run.locked():
        run.write_state(RunState(status="up"))
    filler = tinyfs.fill(fs)
    with run.update() as edit:
        edit.state = edit.state.with_status("mine")
    filler.unlink()
    with other.update() as edit:  # e.g. `dldctl down` in another process
        edit.state = edit.state.with_status("stopping")
    assert run.read_state().status == "stopping"


def test_max_log_mb_is_validated() -> None:
    assert RunSettings().max_log_bytes == 1024 << 20
    assert settings_from_dict({"max_log_mb": 0}).max_log_bytes == 0
    with pytest.raises(SettingsError) as err:
        settings_from_dict({"max_log_mb": -1})
    assert err.value.key == "max_log_mb"


def test_learner_markers_survive_a_full_disk(fs: Path) -> None:
    import torch

    from learner.files import save_replica as _save_replica
    from learner.files import write_marker as _write_marker

    filler = tinyfs.fill(fs)
    _write_marker(fs / "finished", json.dumps({"steps": 10}) + "\n")
    assert (fs / "finished").exists()  # empty, but it still stops restarts
    _save_replica({"fragments": [torch.zeros(50000)]}, fs / "replica.pt")
    assert not (fs / "replica.pt").exists() and not (fs / ".replica.pt.tmp").exists()
    filler.unlink()
    _save_replica({"fragments": [torch.ones(3)]}, fs / "replica.pt")
    assert torch.load(fs / "replica.pt", weights_only=True)["fragments"][0].sum() == 3
