"""The alert sink with real senders: a real HTTP server on 127.0.0.1:0 (http.server in a thread)
and a real command (a shell script that writes what it got to a file), fed through the
supervisor's real Feeds from a real run directory's events.jsonl. Failures (HTTP 500, nothing
listening, a command that fails or hangs, a webhook slower than the supervisor loop) are events,
never exceptions, and never hold up the caller."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dldctl import alertspec
from dldctl.alertspec import AlertsSpec
from dldctl.rundir import RunDir
from dldctl.supervise import alertsend
from dldctl.supervise.alertsend import AlertSink
from dldctl.supervise.feeds import Feeds
from dldctl.testing import read_jsonl, wait_until
from tests.integration.alerthook import Hook

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def hook() -> Iterator[Hook]:
    h = Hook()
    try:
        yield h
    finally:
        h.close()


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "page-me"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def writer(tmp_path: Path) -> tuple[Path, Path]:
    """A command that appends its environment's alert variables and its stdin to a file."""
    out = tmp_path / "paged.txt"
    cmd = script(
        tmp_path,
        f'{{ echo "$DLDCTL_ALERT_KIND|$DLDCTL_ALERT_TARGET|$DLDCTL_ALERT_RUN|$DLDCTL_ALERT_DETAIL"; cat; echo; }}'
        f' >> "{out}"\n',
    )
    return cmd, out


def run_dir(tmp_path: Path) -> RunDir:
    path = tmp_path / "runs" / "demo-20250101-000000"
    path.mkdir(parents=True)
    return RunDir(path)


def feed(run: RunDir, spec: AlertsSpec) -> tuple[Feeds, AlertSink]:
    sink = AlertSink(spec, run.path)
    return Feeds(run.path, [sink]), sink


def events(run: RunDir, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run.events) if e["kind"] == kind]


def settle(feeds: Feeds, run: RunDir, kind: str, count: int = 1) -> list[dict[str, Any]]:
    """Poll as the supervisor loop does until `count` events of `kind` are recorded."""

    def check() -> list[dict[str, Any]] | None:
        feeds.poll(time.time())
        found = events(run, kind)
        return found if len(found) >= count else None

    return wait_until(check, 20, f"{count} {kind} events", every=0.05)


def test_quorum_lost_reaches_the_webhook_and_the_command(tmp_path: Path, hook: Hook) -> None:
    cmd, out = writer(tmp_path)
    run = run_dir(tmp_path)
    feeds, _ = feed(run, AlertsSpec(command=str(cmd), webhook=hook.url))
    try:
        run.event("quorum_lost", "syncer", "1 live learners, minimum quorum 2")
        run.event("learner_lost", "learner-1", "silent for 3.0 s")  # not chosen
        said = settle(feeds, run, "alert")
    finally:
        feeds.close()
    assert said[0]["target"] == "syncer" and said[0]["detail"] == "quorum_lost: sent to command, webhook"
    assert [b["kind"] for b in hook.bodies] == ["quorum_lost"]
    body = hook.bodies[0]
    assert body["run"] == run.name and body["detail"] == "1 live learners, minimum quorum 2"
    assert body["event"]["kind"] == "quorum_lost" and body["run_dir"] == str(run.path)
    assert hook.headers[0]["Content-Type"] == "application/json"
    first, stdin = out.read_text().splitlines()[:2]
    assert first == f"quorum_lost|syncer|{run.name}|1 live learners, minimum quorum 2"
    assert json.loads(stdin) == body


def test_repeats_are_held_back_and_the_next_alert_counts_them(tmp_path: Path, hook: Hook) -> None:
    run = run_dir(tmp_path)
    feeds, _ = feed(run, AlertsSpec(on=("death",), webhook=hook.url, min_interval_s=0.5))
    try:
        for _ in range(4):
            run.event("death", "learner-0", "process gone after 1.0 s")
        settle(feeds, run, "alert")
        time.sleep(0.6)
        run.event("death", "learner-0", "process gone after 1.0 s")
        said = settle(feeds, run, "alert", 2)
    finally:
        feeds.close()
    assert [b["suppressed"] for b in hook.bodies] == [0, 3]
    assert said[1]["detail"] == "death: sent to webhook; 3 like it held back before"


def test_failures_are_events_never_exceptions(tmp_path: Path, hook: Hook) -> None:
    hook.status = 500
    fails = script(tmp_path, "echo 'pager quota exhausted' >&2\nexit 3\n")
    run = run_dir(tmp_path)
    feeds, _ = feed(run, AlertsSpec(command=str(fails), webhook=hook.url))
    try:
        run.event("syncer_death", "syncer", "process gone after 9.0 s")
        failed = settle(feeds, run, "alert_failed")
    finally:
        feeds.close()
    assert failed[0]["target"] == "supervisor"
    assert failed[0]["detail"] == f"syncer_death syncer: command {fails} exited 3: pager quota exhausted"
    assert not events(run, "alert"), "nothing was delivered"
    time.sleep(0.2)
    assert len(events(run, "alert_failed")) == 1, "the webhook's HTTP 500 is within the rate limit: counted"


def test_nothing_listening_and_a_hanging_command(tmp_path: Path) -> None:
    hangs = script(tmp_path, "sleep 30\necho never\n")  # the shell cannot exec sleep: a grandchild
    run = run_dir(tmp_path)
    spec = AlertsSpec(command=str(hangs), timeout_s=0.5)
    assert alertsend.run_command(spec.argv(), b"{}", {}, 0.5) == f"command {hangs} ran past timeout_s = 0.5 s (killed)"
    assert alertsend.post("http://127.0.0.1:9/x", b"{}", 2.0).startswith("webhook unreachable: ")
    feeds, _ = feed(run, spec)
    try:
        run.event("host_unreachable", "learner-2", "host gpu-2 does not answer; will retry")
        failed = settle(feeds, run, "alert_failed")
    finally:
        feeds.close()
    assert "ran past timeout_s" in failed[0]["detail"]


def test_a_slow_webhook_never_holds_up_the_supervisor_loop(tmp_path: Path, hook: Hook) -> None:
    hook.delay_s = 0.3
    run = run_dir(tmp_path)
    feeds, sink = feed(run, AlertsSpec(on=("death",), webhook=hook.url, min_interval_s=0))
    try:
        for i in range(alertsend.QUEUE_MAX + 20):
            run.event("death", f"learner-{i}", "gone")
        began = time.monotonic()
        feeds.poll(time.time())
        took = time.monotonic() - began
        dropped = settle(feeds, run, "alert_failed")
    finally:
        hook.delay_s = 0.0  # the rest goes out quickly at close
        feeds.close()
    assert took < 0.5, f"one poll took {took:.2f} s"
    assert sink.sender.dropped >= 19 and "alerts dropped" in dropped[0]["detail"]
    assert 1 <= len(hook.bodies) <= alertsend.QUEUE_MAX + 1


def test_an_inventory_command_that_is_not_there_is_refused_at_up(tmp_path: Path) -> None:
    from dldctl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\[alerts.command\] .* is not an executable file"):
        alertspec.check_command(AlertsSpec(command=str(tmp_path / "missing --now")), "inv.toml")
    cmd, _ = writer(tmp_path)
    alertspec.check_command(AlertsSpec(command=f"{cmd} --now"), "inv.toml")
    os.chmod(cmd, 0o644)
    with pytest.raises(ConfigError, match="chmod"):
        alertspec.check_command(AlertsSpec(command=str(cmd)), "inv.toml")
