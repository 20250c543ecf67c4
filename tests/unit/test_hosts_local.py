"""LocalHost: commands, files and detached processes on this machine (real processes, /proc)."""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dldctl.errors import HostError, RemoteCommandError
from dldctl.hosts import LocalHost, ProcRef
from dldctl.hosts.base import parse_stat
from dldctl.hosts.local import read_stat

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def host() -> LocalHost:
    return LocalHost("local")


@pytest.fixture
def started(host: LocalHost) -> Iterator[list[ProcRef]]:
    """Processes a test started; their groups are SIGKILLed afterwards, whatever happened."""
    refs: list[ProcRef] = []
    try:
        yield refs
    finally:
        for ref in refs:
            host.signal(ref, signal.SIGKILL)


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def gone(pid: int) -> bool:
    """No such process, or only its zombie (this machine's pid 1 may not reap orphans)."""
    st = read_stat(pid)
    return st is None or st.state in "ZX"


def test_run_drains_large_stdout_and_stderr(host: LocalHost) -> None:
    big = "head -c 6000000 /dev/zero | tr '\\0' o; head -c 5000000 /dev/zero | tr '\\0' e >&2"
    r = host.run(big, timeout=20)
    assert (r.status, len(r.stdout), len(r.stderr)) == (0, 6_000_000, 5_000_000)
    assert set(r.stdout) == {"o"} and set(r.stderr) == {"e"}


def test_run_input_env_and_check(host: LocalHost) -> None:
    r = host.run('cat; printf "|%s" "$DLD_X"', input=b"in", env={"DLD_X": "a b'c"})
    assert r.stdout == "in|a b'c"
    assert host.run("exit 4", check=False).status == 4
    with pytest.raises(RemoteCommandError) as info:
        host.run("echo out; echo boom-detail >&2; exit 3")
    assert info.value.status == 3 and "boom-detail" in info.value.output_tail
    assert "host local" in str(info.value) and "exit 3" in str(info.value)


def test_run_timeout_kills_the_whole_group(host: LocalHost, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    t0 = time.monotonic()
    with pytest.raises(HostError, match=r"did not finish within 0.5s"):
        host.run(f"sleep 30 & echo $! > {pidfile}; wait", timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert wait_for(lambda: gone(int(pidfile.read_text())))


def test_files(host: LocalHost, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    dest = str(tmp_path / "a" / "b" / "copy.bin")
    host.put_file(src, dest, mode=0o640)
    assert Path(dest).read_bytes() == src.read_bytes()
    assert stat.S_IMODE(os.stat(dest).st_mode) == 0o640
    host.get_file(dest, tmp_path / "back" / "x.bin")
    assert (tmp_path / "back" / "x.bin").read_bytes() == src.read_bytes()
    assert host.read_bytes(dest, 100, 50) == src.read_bytes()[100:150]
    assert host.read_bytes(dest, 400_000) == b""
    assert host.size(dest) == 300_000 and host.size(str(tmp_path / "nope")) is None
    assert host.exists(dest) and not host.exists(str(tmp_path / "nope"))
    with pytest.raises(HostError, match="no such file"):
        host.read_bytes(str(tmp_path / "nope"))
    host.mkdir(str(tmp_path / "d1" / "d2"))
    host.mkdir(str(tmp_path / "d1" / "d2"))  # exists already: fine
    assert (tmp_path / "d1" / "d2").is_dir()
    assert not list(tmp_path.rglob("*.tmp"))  # no leftovers from atomic writes


def test_put_bytes_is_private_and_atomic(host: LocalHost, tmp_path: Path) -> None:
    dest = tmp_path / "keys" / "secret.key"
    host.put_bytes(b"s3cret", str(dest))
    assert dest.read_bytes() == b"s3cret"
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    host.put_bytes(b"second", str(dest))
    assert dest.read_bytes() == b"second" and os.listdir(dest.parent) == ["secret.key"]


def test_home(host: LocalHost) -> None:
    assert host.home() == os.path.expanduser("~") and os.path.isabs(host.home())


def test_start_detached(host: LocalHost, tmp_path: Path, started: list[ProcRef]) -> None:
    log = tmp_path / "logs" / "p.log"
    out = tmp_path / "secret.out"
    ref = host.start(
        ["sh", "-c", f'echo "got $DLD_SECRET" > {out}; echo to-log; echo to-err >&2; exec sleep 60'],
        cwd=str(tmp_path),
        log=str(log),
        env={"DLD_SECRET": "hunter2"},
    )
    started.append(ref)
    assert wait_for(lambda: out.exists() and "to-err" in log.read_text())
    assert out.read_text() == "got hunter2\n"
    assert "to-log" in log.read_text()
    assert (tmp_path / "logs" / "p.log.pid").read_text() == f"{ref.pid}\n"  # the pid file, on the host
    assert os.getpgid(ref.pid) == ref.pid and os.getsid(ref.pid) == ref.pid
    st = read_stat(ref.pid)
    assert st is not None and st.start_ticks == ref.start_ticks
    ppid = int(Path(f"/proc/{ref.pid}/stat").read_text().rpartition(")")[2].split()[1])
    assert ppid != os.getpid()  # not our child: detached
    assert b"hunter2" not in Path(f"/proc/{ref.pid}/cmdline").read_bytes()
    assert b"DLD_SECRET=hunter2" in Path(f"/proc/{ref.pid}/environ").read_bytes()
    assert os.readlink(f"/proc/{ref.pid}/fd/0") == "/dev/null"
    assert os.readlink(f"/proc/{ref.pid}/cwd") == str(tmp_path)
    assert host.alive([ref]) == {ref.pid: True}


def test_start_missing_program_fails_clearly(host: LocalHost, tmp_path: Path) -> None:
    with pytest.raises(HostError, match="command not found: no-such-prog-xyz"):
        host.start(["no-such-prog-xyz"], cwd=str(tmp_path), log=str(tmp_path / "l.log"))
    with pytest.raises(HostError, match="could not start"):
        host.start(["true"], cwd=str(tmp_path / "missing-dir"), log=str(tmp_path / "l.log"))


def test_signal_group_reaches_children(host: LocalHost, tmp_path: Path, started: list[ProcRef]) -> None:
    child = tmp_path / "child.pid"
    ref = host.start(
        ["sh", "-c", f"sleep 60 & echo $! > {child}; wait"], cwd=str(tmp_path), log=str(tmp_path / "g.log")
    )
    started.append(ref)
    assert wait_for(lambda: child.exists() and child.read_text().strip() != "")
    child_pid = int(child.read_text())
    assert os.getpgid(child_pid) == ref.pid
    assert host.signal(ref, signal.SIGTERM) is True
    assert wait_for(lambda: gone(ref.pid) and gone(child_pid))
    assert host.alive([ref]) == {ref.pid: False}
    assert host.signal(ref, signal.SIGTERM) is False  # gone now


def test_alive_zombie_free_and_reused_pid(host: LocalHost, tmp_path: Path, started: list[ProcRef]) -> None:
    short = host.start(["sh", "-c", "exit 0"], cwd=str(tmp_path), log=str(tmp_path / "s.log"))
    long = host.start(["sleep", "60"], cwd=str(tmp_path), log=str(tmp_path / "l.log"))
    started.extend([short, long])
    assert wait_for(lambda: host.alive([short])[short.pid] is False)
    with pytest.raises(ChildProcessError):  # not our child: nothing for us to reap
        os.waitpid(short.pid, os.WNOHANG)
    reused = ProcRef(long.pid, long.start_ticks + 1)  # same pid, another process
    assert host.alive([short, long]) == {short.pid: False, long.pid: True}
    assert host.alive([reused]) == {long.pid: False}
    assert host.proc_state(reused) is None
    assert host.signal(reused, signal.SIGKILL) is False
    assert host.signal(reused, signal.SIGKILL, group=False) is False
    assert host.alive([long])[long.pid] is True  # the guard spared the real process


def test_stop_and_continue(host: LocalHost, tmp_path: Path, started: list[ProcRef]) -> None:
    ref = host.start(["sleep", "60"], cwd=str(tmp_path), log=str(tmp_path / "p.log"))
    started.append(ref)
    assert host.signal(ref, signal.SIGSTOP)
    assert wait_for(lambda: host.proc_state(ref) == "T")
    assert host.alive([ref])[ref.pid] is True  # stopped is not dead
    assert host.signal(ref, signal.SIGCONT, group=False)
    assert wait_for(lambda: host.proc_state(ref) == "S")


def test_tail_and_follow(host: LocalHost, tmp_path: Path) -> None:
    log = tmp_path / "f.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert host.tail(str(log), 3) == "line 997\nline 998\nline 999"
    assert host.tail(str(log), 0) == ""
    with pytest.raises(HostError, match="no such file"):
        host.tail(str(tmp_path / "none.log"))

    done = threading.Event()
    lines = host.follow(str(log), from_end_lines=2, poll_s=0.02, stop=done.is_set)
    assert [next(lines), next(lines)] == ["line 998", "line 999"]

    def writer() -> None:
        with open(log, "a") as f:
            f.write("new 1\nnew ")
            f.flush()
            time.sleep(0.1)
            f.write("2\n")

    threading.Thread(target=writer).start()
    assert [next(lines), next(lines)] == ["new 1", "new 2"]
    log.write_text("after truncate\n")
    assert next(lines) == "after truncate"
    done.set()
    assert list(lines) == []


def test_parse_stat_handles_odd_command_names() -> None:
    line = "42 (a) b) (c) S 1 42 42 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 777 0 0"
    st = parse_stat(line)
    assert st is not None and (st.pid, st.state, st.start_ticks) == (42, "S", 777)
    assert parse_stat("") is None and parse_stat("garbage") is None


def test_pure_helpers_of_the_host_layer() -> None:
    from dldctl.errors import UsageError
    from dldctl.hosts.base import env_exports
    from dldctl.hosts.sshconfig import known_hosts_name, parse_jump

    assert parse_jump("bob@jump.example:2222") == ("bob", "jump.example", 2222)
    assert parse_jump("jump") == (None, "jump", None)
    assert parse_jump("[::1]:22") == (None, "::1", 22)
    assert known_hosts_name("10.0.0.1", 22) == "10.0.0.1"
    assert known_hosts_name("10.0.0.1", 2222) == "[10.0.0.1]:2222"
    assert env_exports({"A": "x y'z"}) == "export A='x y'\"'\"'z'\n"
    with pytest.raises(UsageError, match="invalid environment variable name"):
        env_exports({"A;rm -rf /": "x"})


def test_oom_kills_is_the_kernel_s_counter_and_none_where_unknown() -> None:
    from dldctl.hosts.base import parse_oom_kills

    assert parse_oom_kills(b"pgfault 10\noom_kill 7\nnr_foo 1\n") == 7
    assert parse_oom_kills(b"pgfault 10\n") is None and parse_oom_kills(b"oom_kill x\n") is None
    vmstat = Path("/proc/vmstat").read_bytes()
    assert LocalHost("here").oom_kills() == parse_oom_kills(vmstat)
    assert LocalHost("here").oom_kills() is not None  # Linux >= 4.13 counts them
