"""End-to-end fixtures: a session-wide fleet of real sshd hosts on loopback (tests/sshfleet.py).

Every test collected under tests/e2e is marked `e2e` here, so `pytest -m "not e2e"` skips the
ones that need sshd. The fleet is stopped in `finally`, whatever the tests did.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sshfleet import SSHFleet

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark everything in this directory `e2e`."""
    for item in items:
        if _HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def ssh_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHFleet]:
    """Three sshd hosts (127.0.0.2-4), started once for the session."""
    fleet = SSHFleet(tmp_path_factory.mktemp("sshfleet"))
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()
