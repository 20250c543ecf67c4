"""The harness's errors and its one poll loop (stdlib only).

The errors are AssertionErrors, so pytest reports a failure, and the builtin a script catches:

    HarnessError(AssertionError)
     +-- CommandFailed(RuntimeError)    dldctl exited non-zero (`.proc` holds its output)
     +-- WaitTimeout(TimeoutError)      a condition did not hold in time
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class HarnessError(AssertionError):
    """Something the harness was asked for did not happen (a test failure, to pytest)."""


class CommandFailed(HarnessError, RuntimeError):
    """`dldctl ARGS` exited non-zero; `proc` is the finished command, its output included."""

    def __init__(self, args: tuple[str, ...], proc: subprocess.CompletedProcess[str]) -> None:
        super().__init__(
            f"dldctl {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
        self.proc = proc


class WaitTimeout(HarnessError, TimeoutError):
    """A condition did not hold within its timeout."""


def wait_until(
    check: Callable[[], T | None],
    timeout: float,
    what: str,
    *,
    every: float = 0.5,
    describe: Callable[[], str] | None = None,
) -> T:
    """Call `check` every `every` s until it returns something true, and return that; checked once
    more after the deadline, then `WaitTimeout` saying what was awaited (and `describe()`)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            break
        time.sleep(every)
    detail = ""
    if describe is not None:
        try:
            detail = "\n" + describe()
        except Exception as exc:  # the message must not hide the timeout
            detail = f"\n(describing the last try failed: {exc!r})"
    raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}{detail}")
