"""The inventory's [alerts] table: which event kinds alerts know, what to alert on, where to send
it, and its rules (a ConfigError names the key and the fix). Evaluating records into alerts is
dldctl/supervise/alerts.py; sending them, dldctl/supervise/alertsend.py (docs/alerts.md).

    [alerts]
    on = ["quorum_lost", "syncer_death", "crash_loop", "host_unreachable", "below_quorum"]
    command = "/usr/local/bin/page-me"       # the alert as JSON on stdin, DLDCTL_ALERT_* in its env
    webhook = "https://hooks.example.org/x"  # POSTed as application/json
    below_quorum_s = 60                       # below quorum this long: one `below_quorum` per episode
    min_interval_s = 300                      # at most one alert per (kind, target) this often
"""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass
from urllib.parse import urlsplit

from dldctl.errors import ConfigError
from syncer.common.settings import suggest

# The event kinds an alert can be set on, and what each means (docs/alerts.md lists them).
KINDS: dict[str, str] = {
    "quorum_lost": "the syncer has fewer live learners than the quorum (merges wait)",
    "quorum_regained": "the quorum is back",
    "below_quorum": "below the quorum for longer than below_quorum_s (derived, once per episode)",
    "syncer_death": "the syncer process died (the supervisor restarts it)",
    "death": "a learner process died (the supervisor restarts it)",
    "crash_loop": "a process died crash_loop_deaths times within crash_loop_window_s (derived)",
    "restart": "the supervisor restarted a process",
    "start_failed": "a process could not be started (next try after a backoff)",
    "refused": "a process refused to run and is not restarted",
    "finished": "a learner spent its step/duration budget",
    "host_unreachable": "a host does not answer the supervisor",
    "host_back": "an unreachable host answers again",
    "learner_lost": "the syncer has not heard from a learner for liveness_s",
    "learner_back": "a lost learner is heard from again",
    "syncer_start": "the syncer started (or resumed from a checkpoint)",
    "syncer_refused": "the syncer refused to start (no valid checkpoint)",
    "history_lost": "the syncer found no valid checkpoint of a run that had merged",
    "checkpoint_failed": "the syncer could not write a checkpoint",
    "checkpoint_corrupt": "the syncer skipped a corrupt checkpoint",
    "quality_guard": "the quality guard flagged the global model (and rolled it back where it could)",
    "contribution_rejected": "the syncer rejected a learner's contribution (docs/algorithm.md, Judging contributions)",
    "quarantined": "the syncer quarantined a learner whose contributions keep being rejected",
    "supervisor_lost": "the watchdog found the supervisor dead or hung",
    "supervisor_restart_failed": "the watchdog could not restart the supervisor",
    "watchdog_restart_failed": "the supervisor could not restart the watchdog",
    "spare_failed": "a warm spare could not be started or handed over",
    "fault_inject": "dldctl chaos injected a fault",
    "fault_undo_failed": "a chaos fault could not be undone",
    "metrics_export_failed": "a metrics sink could not start or failed",
    "export_failed": "the final model could not be exported",
}
DERIVED = ("below_quorum", "crash_loop")
DEFAULT_ON = ("quorum_lost", "syncer_death", "crash_loop", "host_unreachable", "below_quorum", "quarantined")


@dataclass(frozen=True)
class AlertsSpec:
    """[alerts]: what to alert on and where to send it (off unless command or webhook is set)."""

    on: tuple[str, ...] = DEFAULT_ON
    command: str = ""  # run with the alert as JSON on stdin and DLDCTL_ALERT_* env vars
    webhook: str = ""  # http(s) URL the alert is POSTed to as JSON
    timeout_s: float = 10.0  # per command / POST
    below_quorum_s: float = 60.0
    min_interval_s: float = 300.0  # per (kind, target); 0 = no rate limit
    crash_loop_deaths: int = 3
    crash_loop_window_s: float = 600.0

    @property
    def active(self) -> bool:
        return bool(self.command.strip() or self.webhook.strip())

    def argv(self) -> list[str]:
        return shlex.split(self.command)


def validate(spec: AlertsSpec, path: str) -> None:
    """Cross-field rules of [alerts]; a ConfigError names the key and the fix."""
    if not spec.active:
        if spec != AlertsSpec():
            raise ConfigError(
                path, "alerts", "nothing to send alerts to", 'set command = "..." and/or webhook = "https://..."'
            )
        return
    _validate_on(spec.on, path)
    _validate_command(spec.command, path)
    _validate_webhook(spec.webhook, path)
    for key, low, strict in (
        ("timeout_s", 0.0, True),
        ("below_quorum_s", 0.0, True),
        ("min_interval_s", 0.0, False),
        ("crash_loop_window_s", 0.0, True),
        ("crash_loop_deaths", 2, False),
    ):
        value = getattr(spec, key)
        if value < low or (strict and value == low):
            raise ConfigError(path, f"alerts.{key}", f"must be {'>' if strict else '>='} {low:g}, got {value:g}")


def _validate_on(on: tuple[str, ...], path: str) -> None:
    if not on:
        raise ConfigError(path, "alerts.on", "is empty", f"list event kinds, e.g. on = {list(DEFAULT_ON)!r}")
    for kind in on:
        if kind not in KINDS:
            close = suggest(kind, list(KINDS))
            raise ConfigError(
                path,
                "alerts.on",
                f"{kind!r} is not an event kind alerts know",
                f"did you mean {close!r}?" if close else "see docs/alerts.md for the kinds",
            )


def _validate_command(command: str, path: str) -> None:
    if not command.strip():
        return
    try:
        shlex.split(command)
    except ValueError as exc:
        raise ConfigError(path, "alerts.command", f"cannot be split into words ({exc})", "balance its quotes") from None


def _validate_webhook(url: str, path: str) -> None:
    if not url.strip():
        return
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            path, "alerts.webhook", f"{url!r} is not an http(s) URL", 'write it as webhook = "https://host/path"'
        )


def check_command(spec: AlertsSpec, path: str) -> None:
    """At `up`: the command's program exists (else a ConfigError naming alerts.command)."""
    if not spec.command.strip():
        return
    program = spec.argv()[0]
    if shutil.which(program) is None:
        raise ConfigError(
            path,
            "alerts.command",
            f"{program!r} is not an executable file{'' if os.sep in program else ' on PATH'}",
            "give the program's absolute path, and make it executable (chmod +x)",
        )
