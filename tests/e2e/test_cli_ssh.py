"""The real `dldctl` commands against three real sshd hosts on 127.0.0.2-4.

check, up (wheel copied, Python set up on each host, keys 0600), status, a learner's process
killed on its host and healed by the supervisor without any command, chaos over SSH, learner
add, logs of a remote learner, down with nothing left running. Also: a host with a changed host
key and an unreachable host are refused with one clear line while the rest of the fleet comes up.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dldctl.testing import DldctlHome
from syncer.common import jsonlread
from tests.e2e.fleetutil import host_entry, learner, run_table
from tests.sshfleet import SSHFleet, free_port

pytestmark = [pytest.mark.timeout(400)]


def inventory(fleet: SSHFleet, workdir: Path, *, extra_hosts: str = "", quorum: int = 2, name: str = "ssh") -> str:
    first = fleet.hosts[0]
    text = (
        run_table(name, quorum=quorum)
        + f"""
[ssh]
user = "{first.user}"
identity_file = "{first.identity_file}"
known_hosts = "{first.known_hosts}"
use_ssh_config = false
"""
    )
    for i, host in enumerate(fleet.hosts):
        text += host_entry(f"h{i}", host, workdir)
    return text + extra_hosts


@pytest.fixture(scope="module")
def ssh_run(ssh_fleet: SSHFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DldctlHome, Path, Path]]:
    home = tmp_path_factory.mktemp("sshhome")
    work = tmp_path_factory.mktemp("remote")
    inv = home / "inventory.toml"
    inv.write_text(inventory(ssh_fleet, work))
    with DldctlHome(home) as dl:
        yield dl, inv, work


def test_check_reports_every_host_ok(ssh_run: tuple[DldctlHome, Path, Path]) -> None:
    dl, inv, _ = ssh_run
    out = dl("check", str(inv)).stdout
    for name in ("h0", "h1", "h2"):
        assert name in out
    assert "FAIL" not in out and out.count("ok") >= 12
    assert "native merge kernel ready" in out  # the syncer's kernel, built here as a declared step
    # each host's CPU learners against that host's own answer, asked over SSH with its Python
    learners = json.loads(dl("check", str(inv), "--json").stdout)["learner_memory"]
    assert sorted(m["host"] for m in learners) == ["h0", "h1", "h2"], learners
    assert all(m["ok"] and m["free_B"] > 0 and "free memory unknown" not in m["detail"] for m in learners), learners


def test_up_provisions_the_hosts_and_trains(ssh_run: tuple[DldctlHome, Path, Path]) -> None:
    dl, inv, work = ssh_run
    out = dl("up", str(inv), "-d", timeout=300)
    assert "up: ssh-" in out.stdout
    snap = dl.wait(
        lambda s: s["syncer"]["outer_steps"] >= 5 and all(r["state"] == "running" for r in s["learners"]),
        180,
        "three remote learners training",
    )
    assert [r["host"] for r in snap["learners"]] == ["h0", "h1", "h2"]
    config = next((work / "h0" / "runs").iterdir()) / "config.json"
    secret = next((work / "h0" / "runs").iterdir()) / "keys" / "learner-0.key_secret"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600 and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert not (next((work / "h0" / "runs").iterdir()) / "keys" / "learner-1.key_secret").exists()
    assert list((work / "h0" / "site").glob("*/dldctl/__init__.py")), "the wheel was not installed on h0"


def test_a_learner_killed_on_its_host_is_healed_without_any_command(ssh_run: tuple[DldctlHome, Path, Path]) -> None:
    dl, _, _ = ssh_run
    row = learner(dl.status(), "learner-1")
    os.killpg(row["pid"], signal.SIGKILL)  # a crash on host h1 (same machine, so we can reach it)
    killed_at = time.time()
    dl.wait(
        lambda s: learner(s, "learner-1")["restarts"] == 1 and learner(s, "learner-1")["state"] == "running",
        120,
        "learner-1 restarted over SSH",
    )
    rounds = dl.run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if any(
            r.get("kind") == "round" and r["t"] > killed_at and "learner-1" in r["contributors"]
            for r in jsonlread.read(rounds)
        ):
            break
        time.sleep(1)
    else:
        raise AssertionError("learner-1 did not contribute again after its restart")


def test_chaos_and_logs_over_ssh(ssh_run: tuple[DldctlHome, Path, Path]) -> None:
    dl, _, _ = ssh_run
    dl("chaos", "kill", "learner-2", "--signal", "TERM")
    dl.wait(
        lambda s: learner(s, "learner-2")["restarts"] == 1 and learner(s, "learner-2")["state"] == "running",
        120,
        "learner-2 back",
    )
    # long enough to be seen on a loaded machine; `heal` undoes it early (SIGCONT over SSH)
    dl("chaos", "pause", "learner-0", "--duration", "60", "--force")
    assert learner(dl.status(), "learner-0")["state"] == "paused"
    dl("chaos", "heal", "learner-0")
    dl.wait(lambda s: learner(s, "learner-0")["state"] == "running", 60, "pause undone over SSH")
    assert "learner-2" in dl("logs", "learner-2", "--tail", "30").stdout
    # several targets at once, each line prefixed, over SSH (the learners' logs live on their hosts)
    both = dl("logs", "learner-0", "learner-2", "--tail", "5").stdout.splitlines()
    assert {ln.split(" | ", 1)[0].strip() for ln in both} == {"learner-0", "learner-2"}, both


def test_learner_add_joins_on_a_remote_host(ssh_run: tuple[DldctlHome, Path, Path]) -> None:
    dl, _, _ = ssh_run
    dl("learner", "add", "--host", "h2", "--count", "1", timeout=300)
    dl.wait(
        lambda s: any(r["id"] == "learner-3" and r["state"] == "running" and r["weight"] > 0 for r in s["learners"]),
        120,
        "learner-3 joined and merged",
    )


def test_learner_add_brings_in_a_host_the_run_did_not_have(
    ssh_run: tuple[DldctlHome, Path, Path], ssh_fleet: SSHFleet
) -> None:
    """Scavenged capacity: a new [[hosts]] entry (another machine at h0's address) from a file."""
    dl, inv, work = ssh_run
    more = inv.with_name("more.toml")
    more.write_text(inv.read_text() + host_entry("h3", ssh_fleet.hosts[0], work))
    out = dl("learner", "add", "--host", "h3", "--count", "1", "--inventory", str(more), timeout=300).stdout
    assert "h3:" in out and "learner-4" in out
    snap = dl.wait(
        lambda s: any(r["id"] == "learner-4" and r["state"] == "running" and r["weight"] > 0 for r in s["learners"]),
        120,
        "learner-4 joined from the new host and merged",
    )
    assert learner(snap, "learner-4")["host"] == "h3"
    assert list((work / "h3" / "site").glob("*/dldctl/__init__.py")), "the new host was not provisioned"
    assert "host_add" in [e["kind"] for e in jsonlread.read(dl.run_dir / "events.jsonl")]


def test_down_leaves_nothing_running_on_any_host(ssh_run: tuple[DldctlHome, Path, Path]) -> None:
    dl, _, _ = ssh_run
    summary = json.loads(dl("down", "--json", timeout=180).stdout)
    assert summary["outer_steps"] > 0 and summary["killed"] == []
    assert dl.leftovers() == []


def test_bad_host_key_and_unreachable_host_are_refused_and_the_rest_comes_up_around_a_remote_syncer(
    ssh_fleet: SSHFleet, tmp_path: Path
) -> None:
    """h1's host key changed and "gone" does not answer: both are left out, h0 and h2 train. The
    syncer runs on h0 ([syncer] host = an inventory host): keys go there, its records come home,
    so does the final model. (One fleet for both: each costs half a minute to provision.)"""
    wrong = tmp_path / "known_hosts"
    good = ssh_fleet.hosts[0].known_hosts.read_text().splitlines()
    other_key = ssh_fleet.hosts[2].host_pub.split()[-2:]
    # h1's entry carries h2's key: a changed host key
    lines = [" ".join([ln.split()[0], *other_key]) if f"[{ssh_fleet.hosts[1].address}]" in ln else ln for ln in good]
    wrong.write_text("\n".join(lines) + "\n")
    dead_port = free_port("127.0.0.5")
    extra = (
        f'\n[[hosts]]\nname = "gone"\naddress = "127.0.0.5"\nport = {dead_port}\nlearners = 1\n'
        f'python = "{sys.executable}"\n'
    )
    text = inventory(ssh_fleet, tmp_path / "w", extra_hosts=extra, quorum=1, name="partial")
    text = text.replace(str(ssh_fleet.hosts[0].known_hosts), str(wrong))
    text = text.replace("[ssh]", '[syncer]\nhost = "h0"\n\n[ssh]')
    inv = tmp_path / "inv.toml"
    inv.write_text(text)
    with DldctlHome(tmp_path / "home") as dl:
        checked = dl("check", str(inv), check=False)
        assert checked.returncode == 1 and "2 of 4 hosts failed" in checked.stderr
        assert "host key" in checked.stdout.lower() and "gone" in checked.stdout
        as_json = dl("check", str(inv), "--json", check=False)  # the same verdicts, for a script
        report = json.loads(as_json.stdout)
        hosts = {h["name"]: h for h in report["hosts"]}
        assert as_json.returncode == 1 and report["schema"] == "dldctl.check/1" and report["ok"] is False
        assert hosts["h0"]["ok"] and not hosts["h1"]["ok"] and not hosts["gone"]["ok"]
        assert "host key" in hosts["h1"]["checks"]["ssh"]["detail"].lower() and hosts["h0"]["checks"]["port"]["ok"]
        out = dl("up", str(inv), "-d", timeout=300)
        assert "left out host h1" in out.stdout and "left out host gone" in out.stdout
        assert "changed" in out.stdout.lower() or "does not match" in out.stdout.lower()
        snap = dl.wait(lambda s: sum(r["state"] == "running" for r in s["learners"]) == 2, 180, "h0 and h2 training")
        assert learner(snap, "learner-1")["state"] == "stopped"
        _remote_syncer_records_and_model_come_home(dl, ssh_fleet)
    assert dl.leftovers() == []


def _remote_syncer_records_and_model_come_home(dl: DldctlHome, ssh_fleet: SSHFleet) -> None:
    snap = dl.wait(lambda s: s["syncer"]["alive"] and s["syncer"]["outer_steps"] >= 5, 180, "merges on h0")
    assert snap["syncer"]["address"].startswith(f"tcp://{ssh_fleet.hosts[0].address}:")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kinds = [e["kind"] for e in jsonlread.read(dl.run_dir / "events.jsonl")]
        samples = [r for r in jsonlread.read(dl.run_dir / "metrics.jsonl") if r.get("kind") == "sample"]
        if "syncer_start" in kinds and samples:
            break
        time.sleep(1)
    else:
        raise AssertionError("the remote syncer's records did not come home")
    summary = json.loads(dl("down", "--json", timeout=180).stdout)
    assert summary["final_model"] and Path(summary["final_model"]).is_file()
    assert str(dl.run_dir) in summary["final_model"]
    # the safetensors export the remote syncer wrote is brought home beside it
    assert summary["model_safetensors"] and Path(summary["model_safetensors"]).is_file(), summary
    assert str(dl.run_dir) in summary["model_safetensors"] and Path(summary["model_config"]).is_file()
