"""Alerts, the sending shell: the supervisor's alert sink (dldctl/supervise/feeds.py feeds it)
hands what dldctl/supervise/alerts.py decides to one worker thread, which runs the [alerts] command
(the alert as JSON on stdin, DLDCTL_ALERT_* in its environment) and POSTs it to the webhook
(urllib, application/json), each with [alerts] timeout_s.

The supervisor loop never waits: the queue is bounded (an alert that finds it full is dropped and
counted), and the loop records the outcomes (`alert` with where it went, `alert_failed` with why,
at most one per ALERT_FAILED_EVERY_S plus a count) as events in its own thread on its next tick.
Nothing here raises into the supervisor.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dldctl.alertspec import AlertsSpec
from dldctl.supervise import alerts
from dldctl.supervise.alerts import Alert

QUEUE_MAX = 64
ALERT_FAILED_EVERY_S = 60.0
CLOSE_WAIT_S = 3.0  # at the supervisor's stop (down): how long the alerts still queued get to go out
Event = Callable[[str, str, str], object]  # (kind, target, detail): RunDir.event


def run_command(argv: list[str], body: bytes, env: dict[str, str], timeout_s: float) -> str | None:
    """Run the alert command; None if it exited 0, else why not (one line). One that runs past
    `timeout_s` is killed with all it started (its own session, so a ^C at the operator's
    terminal is not for it either)."""
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **env},
            start_new_session=True,
        )
    except OSError as exc:
        return f"command {argv[0]}: {exc.strerror or exc}"
    try:
        _, err = proc.communicate(body, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return f"command {argv[0]} ran past timeout_s = {timeout_s:g} s (killed)"
    except OSError as exc:  # it closed its stdin early (EPIPE) and went on
        _kill_group(proc)
        return f"command {argv[0]}: {exc.strerror or exc}"
    if proc.returncode != 0:
        said = err.decode(errors="replace").strip().splitlines()
        return f"command {argv[0]} exited {proc.returncode}" + (f": {said[-1][:200]}" if said else "")
    return None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # our own child's session: pid == its group id
    except OSError:
        pass
    try:
        proc.communicate(timeout=5.0)
    except (subprocess.TimeoutExpired, OSError):
        pass


def post(url: str, body: bytes, timeout_s: float) -> str | None:
    """POST the alert to the webhook; None on a 2xx answer, else why not (one line)."""
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json", "User-Agent": "dldctl-alerts"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            answer.read(65536)
            return None
    except urllib.error.HTTPError as exc:
        return f"webhook answered HTTP {exc.code} {exc.reason}"
    except urllib.error.URLError as exc:
        return f"webhook unreachable: {exc.reason}"
    except (OSError, ValueError) as exc:  # a timeout, a reset connection, a bad answer
        return f"webhook: {type(exc).__name__}: {exc}"


@dataclass
class Outcome:
    """What became of one alert: where it went, and what failed."""

    alert: Alert
    sent: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class Sender:
    """One worker thread that delivers alerts from a bounded queue, in order."""

    def __init__(self, spec: AlertsSpec, run: str, run_dir: str) -> None:
        self.spec, self.run, self.run_dir = spec, run, run_dir
        self.jobs: queue.Queue[Alert | None] = queue.Queue(QUEUE_MAX)
        self.done: queue.Queue[Outcome] = queue.Queue()
        self.dropped = 0  # alerts that found the queue full
        self.thread = threading.Thread(target=self._work, name="alerts", daemon=True)
        self.thread.start()

    def submit(self, alert: Alert) -> bool:
        try:
            self.jobs.put_nowait(alert)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def _work(self) -> None:
        while (alert := self.jobs.get()) is not None:
            try:
                self.done.put(self.deliver(alert))
            except Exception as exc:  # a bug here must not end the worker
                self.done.put(Outcome(alert, failed=[f"{type(exc).__name__}: {exc}"]))

    def deliver(self, alert: Alert) -> Outcome:
        out = Outcome(alert)
        body = json.dumps(alerts.payload(alert, self.run, self.run_dir)).encode()
        steps: list[tuple[str, Callable[[], str | None]]] = []
        if self.spec.command.strip():
            env = alerts.env_vars(alert, self.run, self.run_dir)
            steps.append(("command", lambda: run_command(self.spec.argv(), body, env, self.spec.timeout_s)))
        if self.spec.webhook.strip():
            steps.append(("webhook", lambda: post(self.spec.webhook, body, self.spec.timeout_s)))
        for where, step in steps:
            problem = step()
            (out.failed if problem else out.sent).append(problem or where)
        return out

    def outcomes(self) -> list[Outcome]:
        out: list[Outcome] = []
        while True:
            try:
                out.append(self.done.get_nowait())
            except queue.Empty:
                return out

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Let what is queued go out, for at most `wait_s` in all (then the daemon thread is left behind)."""
        deadline = time.monotonic() + wait_s
        try:
            self.jobs.put(None, timeout=wait_s)
        except queue.Full:
            return
        self.thread.join(max(0.0, deadline - time.monotonic()))


class AlertSink:
    """The supervisor's alert sink: records in, rules applied, alerts handed to the Sender."""

    def __init__(self, spec: AlertsSpec, run_path: Path, clock: Callable[[], float] = time.time) -> None:
        from dldctl.rundir import RunDir

        run = RunDir(run_path)
        self.event: Event = run.event
        self.clock = clock
        self.rules = alerts.Rules(spec)
        self.sender = Sender(spec, run.name, str(run.path))
        self.where = ", ".join(w for w, on in (("command", spec.command), ("webhook", spec.webhook)) if on.strip())
        self._failed_at = float("-inf")
        self._failed_held = 0
        self._dropped_told = 0

    def on_events(self, records: list[dict[str, Any]]) -> None:
        self._send(self.rules.events(records, self.clock()))

    def on_metrics(self, records: list[dict[str, Any]]) -> None:
        self._send(self.rules.metrics(records, self.clock()))

    def tick(self, now: float) -> None:
        self._send(self.rules.tick(now))
        self._record(now)

    def close(self) -> None:
        self.sender.close()
        self._record(self.clock())

    def _send(self, found: list[Alert]) -> None:
        for alert in found:
            self.sender.submit(alert)

    def _record(self, now: float) -> None:
        """Events for what the worker did since the last tick (in the supervisor's thread)."""
        for done in self.sender.outcomes():
            a = done.alert
            held = f"; {a.suppressed} like it held back before" if a.suppressed else ""
            if done.sent:
                self.event("alert", a.target, f"{a.kind}: sent to {', '.join(done.sent)}{held}")
            for line in done.failed:
                self._failed(now, a, line)
        if self.sender.dropped > self._dropped_told:
            count = self.sender.dropped - self._dropped_told
            self._dropped_told = self.sender.dropped
            self._failed(now, None, f"{count} alerts dropped: {QUEUE_MAX} were waiting to be sent")

    def _failed(self, now: float, alert: Alert | None, line: str) -> None:
        if now - self._failed_at < ALERT_FAILED_EVERY_S:
            self._failed_held += 1
            return
        more = f" (+{self._failed_held} more failures since the last report)" if self._failed_held else ""
        self._failed_at, self._failed_held = now, 0
        head = f"{alert.kind} {alert.target}: " if alert is not None else ""
        self.event("alert_failed", "supervisor", f"{head}{line}{more}")
