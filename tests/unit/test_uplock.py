"""One `dldctl up` of a run at a time (dldctl/uplock.py): a second holder is refused at once with
the run's name and the first one's pid; the lock goes with its holder; other runs are not held."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dldctl import uplock
from dldctl.errors import UsageError


def test_a_second_up_of_one_run_is_refused_while_the_first_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLDCTL_HOME", str(tmp_path))
    with uplock.holding("exp"):
        held = f"another `dldctl up` of run exp is under way \\(pid {os.getpid()}\\)"
        with pytest.raises(UsageError, match=held), uplock.holding("exp"):
            pass
        with uplock.holding("other"):  # another run's up goes on
            pass
    with uplock.holding("exp"):  # released with its holder
        pass
