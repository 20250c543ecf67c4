"""`dldctl up` with a syncer port the inventory fixed that something on this machine already
listens on: refused before a run exists, with one line naming the key (before, the syncer
crash-looped on "Address already in use" and `up --wait` said only that it was not answering)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from dldctl.ports import free_port
from dldctl.testing import DLDCTL

HOST = '[[hosts]]\nname = "a"\naddress = "local"\n'


@pytest.mark.parametrize("key", ["port", "control_port"])
def test_up_refuses_a_syncer_port_in_use_before_it_creates_a_run(tmp_path: Path, key: str) -> None:
    env = dict(os.environ, DLDCTL_HOME=str(tmp_path / "home"), COLUMNS="200")
    inv = tmp_path / "inventory.toml"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        inv.write_text(f'[run]\nmodel = "gpt-tiny"\n\n[syncer]\n{key} = {port}\n\n' + HOST)
        up = subprocess.run([DLDCTL, "up", str(inv), "-d"], env=env, capture_output=True, text=True, timeout=120)
    [line] = [x for x in up.stderr.splitlines() if x.strip()]
    assert up.returncode == 2, up.stderr  # a configuration error, as for any bad inventory value
    assert str(inv) in line and f"syncer.{key}" in line and f"127.0.0.1:{port}" in line, line
    assert "Address already in use" in line and "pick another port" in line
    runs = subprocess.run([DLDCTL, "runs", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert json.loads(runs.stdout)["runs"] == [], "a refused up must not leave a run behind"


def test_check_dials_the_fixed_port_and_refuses_it_when_taken(tmp_path: Path) -> None:
    """`check` tests the path to the port the run will use (the one a firewall was opened for),
    not a throwaway one; taken, it says what `up` would."""
    env = dict(os.environ, DLDCTL_HOME=str(tmp_path / "home"), COLUMNS="200")
    inv = tmp_path / "inventory.toml"
    port = free_port()
    inv.write_text(f'[run]\nmodel = "gpt-tiny"\n\n[syncer]\nport = {port}\n\n' + HOST)
    check = [DLDCTL, "check", str(inv), "--json"]
    ok = subprocess.run(check, env=env, capture_output=True, text=True, timeout=180)
    [host] = json.loads(ok.stdout)["hosts"]
    assert host["checks"]["port"] == {"ok": True, "detail": f"reaches 127.0.0.1:{port}"}, host
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        refused = subprocess.run(check, env=env, capture_output=True, text=True, timeout=180)
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert f"[syncer.port] the syncer cannot listen on 127.0.0.1:{port}" in refused.stderr
