"""`dldctl chaos link` across two emulated sites (bench/sites.py): real network namespaces joined
by htb-shaped veths, a real sshd in each, the real `dldctl up` over SSH into them.

One learner's link is capped at 1 Mbit/s: status says `degraded`, tc holds the cap on both ends
(the site's veth and the syncer's), the other learner keeps merging, the capped one keeps
training; `heal` takes the cap off both ends and its contributions reach the model again; `down`
leaves no cap, and the harness no namespace, veth or process."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from bench.sites import Sites, SitesUnavailable
from dldctl.testing import DldctlHome
from syncer.common import jsonlread
from tests.e2e.fleetutil import learner, run_table

pytestmark = [pytest.mark.timeout(240)]


def tc_classes(dev: str, ns: str | None = None) -> str:
    return subprocess.run(
        ["tc", *(["-n", ns] if ns else []), "class", "show", "dev", dev], capture_output=True, text=True, check=True
    ).stdout


def contributions(run_dir: Path, lid: str, after: float) -> int:
    return sum(
        1
        for r in jsonlread.read(run_dir / "metrics.jsonl")
        if r.get("kind") == "round" and r["t"] > after and lid in r["contributors"]
    )


def test_a_capped_link_degrades_one_learner_and_heals(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    try:
        sites = Sites(tmp_path / "sites", 2, rate="50mbit", prefix="dle").start()
    except SitesUnavailable as exc:
        pytest.fail(str(exc))
    try:
        inv = tmp_path / "inventory.toml"
        syncer = f'\n[syncer]\nbind = "0.0.0.0"\nadvertise = "{sites.advertise}"\n'
        inv.write_text(run_table("sites", quorum=1) + syncer + "\n" + sites.inventory_hosts(tmp_path / "remote"))
        with DldctlHome(tmp_path / "home") as dl:
            dl("up", str(inv), "-d", timeout=300)
            dl.wait(
                lambda s: s["syncer"]["outer_steps"] >= 5 and all(r["state"] == "running" for r in s["learners"]),
                150,
                "two learners in two sites training",
            )
            site2 = sites.hosts[1]
            out = dl("chaos", "link", "learner-1", "--rate", "1mbit", "--duration", "60s", "--force", timeout=60)
            assert "link capped at 1mbit for 60 s" in out.stdout
            capped_at = time.time()
            assert "rate 1Mbit ceil 1Mbit" in tc_classes("eth0", site2.namespace)  # its pushes, on its host
            assert "rate 1Mbit ceil 1Mbit" in tc_classes(site2.veth_operator)  # the syncer's replies
            assert "rate 1Mbit" not in tc_classes(sites.hosts[0].veth_operator)  # the other link: untouched
            snap = dl.wait(lambda s: learner(s, "learner-1")["state"] == "degraded", 30, "learner-1 degraded")
            step = learner(snap, "learner-1")["step"]
            time.sleep(15)
            during = dl.status()
            assert learner(during, "learner-1")["step"] > step, "the capped learner keeps training"
            assert contributions(dl.run_dir, "learner-0", capped_at) >= 3, "the other learner keeps merging"
            dl("chaos", "heal", "learner-1", timeout=60)
            healed_at = time.time()
            assert "rate 1Mbit" not in tc_classes("eth0", site2.namespace) + tc_classes(site2.veth_operator)
            dl.wait_for(lambda: contributions(dl.run_dir, "learner-1", healed_at) >= 1, 90, "learner-1 merging again")
            dl("chaos", "link", "learner-0", "--rate", "2mbit", "--duration", "5m", "--force", timeout=60)
            dl.down()  # takes the cap off before it stops the learners
            assert "rate 2Mbit" not in tc_classes("eth0", sites.hosts[0].namespace)
            assert "rate 2Mbit" not in tc_classes(sites.hosts[0].veth_operator)
            assert [e for e in dl.events("fault_undo") if "link undone at down" in e["detail"]]
    finally:
        names = [h.namespace for h in sites.hosts]
        sites.close()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [n for n in names if n in left]
    veths = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout
    assert "dle" not in veths
