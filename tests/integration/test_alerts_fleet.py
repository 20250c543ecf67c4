"""Alerts on a real local fleet: an inventory whose [alerts] table points at a real local HTTP
server and a command that writes a file; `dldctl chaos kill syncer` must reach both as
`syncer_death`, a paused learner (the fleet below its quorum) as `quorum_lost` and, past
below_quorum_s, `below_quorum`; each is an `alert` event that `dldctl events` shows, and `down`
(whose learners leave the quorum) alerts no one. The restarted syncer is below its quorum until
its learners are back: on a loaded machine that outlasts the test's 2 s below_quorum_s, and that
episode's `below_quorum` is then a true alert too (rate limiting is off here so it cannot hide the
paused learner's)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dldctl.testing import DldctlHome, inventory_text, local_host, wait_until
from tests.e2e.fleetutil import run_table
from tests.integration.alerthook import Hook

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_syncer_death_and_quorum_lost_reach_the_webhook_and_the_command(tmp_path: Path) -> None:
    hook = Hook()
    paged = tmp_path / "paged.jsonl"
    cmd = tmp_path / "page-me"
    cmd.write_text(f'#!/bin/sh\n{{ cat; echo; }} >> "{paged}"\n')
    cmd.chmod(0o755)
    inv = tmp_path / "inv.toml"
    inv.write_text(
        run_table("alerts", quorum=2)
        + inventory_text({}, [local_host("here", 2)]).split("\n", 1)[1]
        + "\n[alerts]\n"
        + 'on = ["quorum_lost", "syncer_death", "below_quorum", "crash_loop"]\n'
        + f'command = "{cmd}"\nwebhook = "{hook.url}"\nbelow_quorum_s = 2\nmin_interval_s = 0\n'
    )
    try:
        with DldctlHome(tmp_path / "home") as dl:
            said = dl("up", str(inv), "-d", "--wait")
            assert f"to `{cmd}` and http://127.0.0.1:" in said.stdout + said.stderr, "up says where alerts go"
            assert "/hooks/dldctl" not in said.stdout + said.stderr, "a webhook's path may be its secret"
            began = time.monotonic()
            dl("chaos", "kill", "syncer", "--force")
            wait_until(lambda: "syncer_death" in hook.kinds(), 30, "the syncer_death webhook", every=0.2)
            # the restarted syncer starts below its quorum (no learner yet) and says when it is back
            wait_until(lambda: len(dl.events("quorum_reached")) >= 2, 90, "the restarted syncer's quorum")
            dl("chaos", "pause", "learner-0", "--duration", "8", "--force")
            wait_until(lambda: _paused_episode(hook.kinds()), 30, "the below_quorum webhook", every=0.2)
            took = time.monotonic() - began
            # the sink records its `alert` event once the send returned: the hook may hear it first
            heard = len(hook.kinds())
            wait_until(lambda: len(dl.events("alert")) >= heard, 10, "the below_quorum alert event", every=0.2)
            shown = dl("events", "--kind", "alert", "--json").stdout
            dl.down()
            time.sleep(1.0)
        sent = list(hook.bodies)
    finally:
        hook.close()

    kinds = [b["kind"] for b in sent]
    restart = sent[1:-2]  # the restarted syncer's own below-quorum episode, if it lasted past 2 s
    assert kinds[0] == "syncer_death" and kinds[-2:] == ["quorum_lost", "below_quorum"], kinds
    assert [b["kind"] for b in restart] in ([], ["below_quorum"]), kinds
    assert all("minimum quorum 2" in b["detail"] for b in restart)
    death, lost, below = sent[0], sent[-2], sent[-1]
    assert death["target"] == "syncer" and death["event"]["kind"] == "syncer_death"
    assert lost["detail"] == "1 live learners, minimum quorum 2" and lost["run"].startswith("alerts")
    assert "1 live learners, minimum quorum 2" in below["detail"]
    assert [json.loads(line) for line in paged.read_text().splitlines() if line] == sent, "the command got each"
    alerts = [json.loads(line) for line in shown.splitlines()]
    assert [a["detail"].split(":")[0] for a in alerts] == kinds
    assert all("sent to command, webhook" in a["detail"] for a in alerts)
    print(f"kill syncer -> below_quorum alert: {took:.1f} s")


def _paused_episode(kinds: list[str]) -> bool:
    """The paused learner's quorum_lost and, after it, its below_quorum have been heard."""
    return "quorum_lost" in kinds and "below_quorum" in kinds[kinds.index("quorum_lost") :]
