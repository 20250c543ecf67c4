"""The live view driven by keys in a real terminal: the real `dldctl status` in a pseudo-terminal
of 80x24 on a small real run (two gpt-tiny learners on one local host); keys in, screen out.

`?` shows the keys, the down arrow and Enter open the first learner's detail with its log lines,
`k` asks before it kills and `y` kills (the supervisor restarts the learner), `q` leaves the view
with exit code 0 and the run still up. Teardown stops everything by pid (`DldctlHome.close`).
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import time
from collections.abc import Iterator

import pytest

from dldctl.testing import DLDCTL, DldctlHome
from tests.e2e.fleetutil import run_table

pytestmark = [pytest.mark.timeout(300)]

INVENTORY = (
    run_table("keys", quorum=1)
    + """
[[hosts]]
name = "box"
address = "local"
learners = 2
"""
)


def read_until(fd: int, pattern: bytes, timeout: float) -> tuple[bool, bytes]:
    """Read the terminal until `pattern` (a regular expression) shows in its text; whether it did,
    and the text that came."""
    seen, deadline = bytearray(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen.extend(chunk)
        if re.search(pattern, plain(seen)):
            return True, plain(seen)
    return bool(re.search(pattern, plain(seen))), plain(seen)


def plain(screen: bytes | bytearray) -> bytes:
    """The terminal's output without its control sequences (colours, cursor moves)."""
    return re.sub(rb"\x1b(\[[0-9;?]*[ -/]*[@-~]|[()][0-9A-Za-z]|[=>78])", b"", bytes(screen))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DldctlHome]:
    home = tmp_path_factory.mktemp("home")
    inv = home / "inventory.toml"
    inv.write_text(INVENTORY)
    with DldctlHome(home) as dl:
        dl("up", str(inv), "-d")
        dl.wait(
            lambda s: s["syncer"]["outer_steps"] >= 2 and all(r["state"] == "running" for r in s["learners"]),
            120,
            "the fleet training",
        )
        yield dl


def test_keys_drive_the_live_view_in_a_terminal(fleet: DldctlHome) -> None:
    dl = fleet
    pid, fd = pty.fork()
    if pid == 0:  # the child: `dldctl status` in a real 80x24 terminal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execve(
            DLDCTL,
            [DLDCTL, "status", "--interval", "500ms"],
            dict(dl.env, TERM="xterm-256color", LINES="24", COLUMNS="80"),
        )
    try:
        steps = [
            (b"", rb"goodput", "the view"),
            (b"?", rb"show or hide this help", "the help after ?"),
            (b"?", "─ events ─".encode(), "the events back once ? closed the help"),
            (b"\x1b[B\r", rb"recent log lines", "the detail after down and Enter"),
            (b"", rb"learner-0: step \d+", "learner-0's log lines in its detail"),
            (b"k", rb"kill learner-0 \(SIGKILL", "the question after k"),
            (b"y", rb"kill learner-0: kill -KILL pid \d+ on box", "the kill done after y"),
        ]
        for keys, pattern, what in steps:
            os.write(fd, keys)
            shown, screen = read_until(fd, pattern, 60)
            assert shown, (what, screen[-4000:].decode(errors="replace"))
        dl.wait(lambda s: s["learners"][0]["restarts"] >= 1, 60, "learner-0 restarted by the supervisor")
        os.write(fd, b"q")
        shown, screen = read_until(fd, rb"keeps running", 30)
        assert shown, screen[-3000:].decode(errors="replace")
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 0
        snap = dl.status()
        assert snap["syncer"]["alive"], "q must leave the view, not the run"
        joins = [e["detail"] for e in snap["events"] if e["kind"] in ("join", "rejoin")]
        assert joins and all(" on box " in d for d in joins), joins  # one name per host everywhere
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


def test_status_keys_home_is_clean_after_down(fleet: DldctlHome) -> None:
    fleet("down")
    assert fleet.leftovers() == []
