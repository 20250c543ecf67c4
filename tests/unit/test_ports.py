"""dldctl/ports.py: the syncer's ports come from below the kernel's ephemeral range."""

from __future__ import annotations

import socket

import pytest

from dldctl import ports
from dldctl.inventory import HostSpec, Inventory, SSHSpec, SyncerSpec
from dldctl.lifecycle import plan
from dldctl.ports import ephemeral_low, free_port
from syncer.common.settings import RunSettings


def test_the_port_is_free_and_below_the_ephemeral_range() -> None:
    got = {free_port() for _ in range(20)}
    assert all(ports.LOWEST <= p < ephemeral_low() for p in got) and len(got) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", got.pop()))  # still free


def test_the_range_is_read_from_the_kernel_setting_and_defaults_to_linux_s() -> None:
    assert ephemeral_low(lambda: "40000\t60999\n") == 40000
    assert ephemeral_low(lambda: "") == 32768
    assert ephemeral_low(lambda: (_ for _ in ()).throw(OSError("no /proc"))) == 32768


def test_a_port_someone_holds_is_never_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "LOWEST", taken)
        monkeypatch.setattr(ports, "ephemeral_low", lambda: taken + 2)
        assert {free_port() for _ in range(10)} == {taken + 1}


def test_no_room_below_the_range_falls_back_to_a_kernel_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.LOWEST)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_run_s_syncer_and_shard_ports_are_all_below_the_range() -> None:
    run = RunSettings(name="t", model="gpt-tiny", fragments=4)
    inv = Inventory(run, SSHSpec(), SyncerSpec(shards=3), (HostSpec("here", "local", learners=2),))
    section = plan.syncer_section(inv, "127.0.0.1")
    every = [section.port, section.control_port, *section.shard_ports]
    assert len(set(every)) == 6 and all(ports.LOWEST <= p < ephemeral_low() for p in every)
