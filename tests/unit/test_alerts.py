"""The pure part of alerts (dldctl/supervise/alerts.py): the [alerts] table's rules, which records
become alerts, the rate limit, the below-quorum timer and crash-loop detection on a fake clock,
and the JSON and environment an alert carries."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from dldctl import alertspec, inventory
from dldctl.alertspec import AlertsSpec
from dldctl.errors import ConfigError
from dldctl.supervise import alerts
from dldctl.supervise.alerts import Alert, BelowQuorum, CrashLoop, RateLimit, Rules

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000.0
HOSTS = '[[hosts]]\nname = "here"\naddress = "local"\nlearners = 2\n'


def ev(t: float, kind: str, target: str = "syncer", detail: str = "") -> dict[str, Any]:
    return {"t": t, "kind": kind, "target": target, "detail": detail}


def sample(t: float, live: int, least: int = 2) -> dict[str, Any]:
    return {"t": t, "kind": "sample", "quorum_live": live, "quorum_min": least}


def load(tmp_path: Path, table: str) -> inventory.Inventory:
    path = tmp_path / "inv.toml"
    path.write_text(HOSTS + "[alerts]\n" + table)
    return inventory.load(path)


def error(tmp_path: Path, table: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, table)
    return info.value.line()


# -- the table ---------------------------------------------------------------------------------


def test_every_kind_alerts_know_is_one_the_code_records() -> None:
    source = "\n".join(
        p.read_text() for pkg in ("dldctl", "syncer") for p in (ROOT / pkg).rglob("*.py") if p.name != "alerts.py"
    )
    for kind in set(alertspec.KINDS) - set(alertspec.DERIVED):
        assert re.search(rf'"{kind}"', source), f"{kind} is recorded nowhere"
    assert set(alertspec.DEFAULT_ON) <= set(alertspec.KINDS)


def test_a_table_round_trips_through_the_run_directory_copy(tmp_path: Path) -> None:
    inv = load(tmp_path, 'on = ["quorum_lost", "death"]\nwebhook = "http://127.0.0.1:9/x"\nmin_interval_s = 5\n')
    assert inv.alerts.on == ("quorum_lost", "death") and inv.alerts.min_interval_s == 5.0 and inv.alerts.active
    again = inventory.parse(json.loads(json.dumps(inventory.to_dict(inv))), "copy")
    assert again.alerts == inv.alerts


def test_no_table_means_no_alerts() -> None:
    assert not inventory.default_inventory().alerts.active


@pytest.mark.parametrize(
    "table, says",
    [
        ('on = ["quorum_lots"]\nwebhook = "http://h/x"\n', "[alerts.on] 'quorum_lots' is not an event kind"),
        ('on = ["quorum_lots"]\nwebhook = "http://h/x"\n', "did you mean 'quorum_lost'?"),
        ('on = ["alert"]\nwebhook = "http://h/x"\n', "see docs/alerts.md"),
        ('on = []\nwebhook = "http://h/x"\n', "[alerts.on] is empty"),
        ('webhook = "ftp://h/x"\n', "[alerts.webhook] 'ftp://h/x' is not an http(s) URL"),
        ('webhook = "hooks.example.org/x"\n', "is not an http(s) URL"),
        ('webhok = "http://h/x"\n', "[alerts.webhok] unknown key (did you mean 'webhook'?)"),
        ("below_quorum_s = 30\n", "[alerts] nothing to send alerts to"),
        ('webhook = "http://h/x"\nbelow_quorum_s = 0\n', "[alerts.below_quorum_s] must be > 0"),
        ('webhook = "http://h/x"\nmin_interval_s = -1\n', "[alerts.min_interval_s] must be >= 0"),
        ('webhook = "http://h/x"\ncrash_loop_deaths = 1\n', "[alerts.crash_loop_deaths] must be >= 2"),
        ('webhook = "http://h/x"\nmin_interval_s = "5m"\n', "[alerts.min_interval_s] must be float"),
        ('command = "page \'me"\n', "[alerts.command] cannot be split into words"),
        ('command = "/nonexistent/page-me"\n', "[alerts.command] '/nonexistent/page-me' is not an executable file"),
        ('command = "no-such-pager-here --now"\n', "'no-such-pager-here' is not an executable file on PATH"),
    ],
)
def test_a_bad_table_is_one_line_naming_the_key(tmp_path: Path, table: str, says: str) -> None:
    line = error(tmp_path, table)
    assert says in line and "\n" not in line and str(tmp_path / "inv.toml") in line


def test_a_misspelled_table_is_suggested(tmp_path: Path) -> None:
    path = tmp_path / "inv.toml"
    path.write_text(HOSTS + '[alert]\nwebhook = "http://h/x"\n')
    with pytest.raises(ConfigError, match=r"did you mean \[alerts\]"):
        inventory.load(path)


def test_the_example_inventory_documents_the_table() -> None:
    text = (ROOT / "inventory.example.toml").read_text()
    commented = "\n".join(line[2:] for line in text.splitlines() if line.startswith("# ") or line == "#")
    block = commented[commented.index("[alerts]") :].split("\n\n")[0]
    spec = inventory.parse({"alerts": tomllib.loads(block)["alerts"]}, "example").alerts
    alertspec.validate(spec, "example")
    assert spec.active and set(spec.on) == set(alertspec.DEFAULT_ON)


# -- matching ----------------------------------------------------------------------------------


def test_only_the_chosen_kinds_alert_and_a_backlog_does_not() -> None:
    rules = Rules(AlertsSpec(on=("quorum_lost", "syncer_death"), webhook="http://h/x"))
    records = [ev(T0, "quorum_lost", detail="1 live"), ev(T0 + 1, "death", "learner-0"), ev(T0 + 2, "syncer_death")]
    found = rules.events(records, T0 + 3)
    assert [(a.kind, a.target, a.detail) for a in found] == [
        ("quorum_lost", "syncer", "1 live"),
        ("syncer_death", "syncer", ""),
    ]
    assert found[0].event == records[0]
    old = ev(T0 - alerts.STALE_S - 10, "quorum_lost", detail="long ago")
    assert Rules(AlertsSpec(webhook="http://h/x")).events([old], T0) == []


def test_the_rate_limit_holds_back_and_counts_per_kind_and_target() -> None:
    limit = RateLimit(300.0)
    a = Alert("death", "learner-0", "gone", T0)
    assert limit.admit(a, T0) == a
    assert limit.admit(a, T0 + 10) is None and limit.admit(a, T0 + 299) is None
    assert limit.admit(Alert("death", "learner-1", "gone", T0), T0 + 20) is not None, "another target"
    assert limit.admit(Alert("restart", "learner-0", "", T0), T0 + 20) is not None, "another kind"
    later = limit.admit(a, T0 + 300)
    assert later is not None and later.suppressed == 2
    assert limit.admit(a, T0 + 601) == a, "the count starts again"
    assert all(RateLimit(0.0).admit(a, T0) for _ in range(3)), "0 = no limit"


# -- below quorum ------------------------------------------------------------------------------


def test_below_quorum_fires_once_per_episode_after_T() -> None:
    timer = BelowQuorum(60.0)
    timer.on_event(ev(T0, "quorum_lost", detail="1 live learners, minimum quorum 2"))
    assert timer.due(T0 + 59) is None
    fired = timer.due(T0 + 61)
    assert fired is not None and fired.kind == "below_quorum" and "for 61 s" in fired.detail
    assert "1 live learners, minimum quorum 2" in fired.detail
    assert timer.due(T0 + 500) is None, "once per episode"
    timer.on_event(ev(T0 + 600, "quorum_regained"))
    timer.on_event(ev(T0 + 700, "quorum_lost"))
    assert timer.due(T0 + 720) is None and timer.due(T0 + 761) is not None, "a new episode fires again"


def test_back_above_quorum_before_T_is_no_alert() -> None:
    timer = BelowQuorum(60.0)
    timer.on_event(ev(T0, "quorum_lost"))
    timer.on_sample(sample(T0 - 5, 3))  # older than the loss: changes nothing
    timer.on_event(ev(T0 + 30, "quorum_regained"))
    assert timer.due(T0 + 120) is None


def test_the_first_quorum_reached_arms_the_timer_as_a_regained_one_does() -> None:
    """A syncer's start logs `quorum_reached`: from then on a quorum lost is an episode."""
    timer = BelowQuorum(60.0)
    timer.on_sample(sample(T0, 0))  # learners still joining: no episode
    timer.on_event(ev(T0 + 5, "quorum_reached"))
    assert timer.reached and timer.due(T0 + 100) is None
    timer.on_sample(sample(T0 + 110, 1))  # below it again without a quorum_lost event (a syncer restart)
    assert timer.due(T0 + 171) is not None


def test_samples_time_an_episode_but_a_slow_start_is_none() -> None:
    timer = BelowQuorum(60.0)
    for t in range(0, 200, 10):
        timer.on_sample(sample(T0 + t, 0))  # learners still joining
    assert timer.due(T0 + 200) is None
    timer.on_sample(sample(T0 + 210, 2))
    timer.on_sample(sample(T0 + 220, 1))  # e.g. after a syncer restart, no quorum_lost event
    timer.on_sample(sample(T0 + 230, 1))
    fired = timer.due(T0 + 281)
    assert fired is not None and "1 live learners, minimum quorum 2" in fired.detail


def test_rules_fire_below_quorum_on_tick_only_if_chosen() -> None:
    spec = AlertsSpec(webhook="http://h/x", below_quorum_s=10.0)
    rules = Rules(spec)
    rules.events([ev(T0, "quorum_lost")], T0)
    assert rules.tick(T0 + 5) == [] and [a.kind for a in rules.tick(T0 + 11)] == ["below_quorum"]
    quiet = Rules(AlertsSpec(on=("death",), webhook="http://h/x", below_quorum_s=10.0))
    quiet.events([ev(T0, "quorum_lost")], T0)
    assert quiet.tick(T0 + 11) == []


# -- crash loops -------------------------------------------------------------------------------


def test_a_crash_loop_is_n_deaths_within_the_window() -> None:
    loops = CrashLoop(deaths=3, window_s=100.0)
    assert loops.on_event(ev(T0, "death", "learner-1")) is None
    assert loops.on_event(ev(T0 + 200, "death", "learner-1")) is None  # the first fell out of the window
    assert loops.on_event(ev(T0 + 210, "death", "learner-2")) is None  # another process
    assert loops.on_event(ev(T0 + 220, "death", "learner-1")) is None
    fired = loops.on_event(ev(T0 + 230, "death", "learner-1", "process gone after 2.0 s; its log ends: OOM"))
    assert fired is not None and (fired.kind, fired.target) == ("crash_loop", "learner-1")
    assert fired.detail.startswith("3 deaths in 30 s") and "OOM" in fired.detail
    assert loops.on_event(ev(T0 + 240, "death", "learner-1")) is None, "a new loop needs N deaths again"


def test_chaos_kills_are_no_crash_loop() -> None:
    loops = CrashLoop(deaths=2, window_s=100.0)
    for t in (0, 10, 20):
        loops.on_event(ev(T0 + t, "fault_inject", "syncer", "kill -KILL pid 42 on local; back in >= 1 s"))
        assert loops.on_event(ev(T0 + t + 1, "syncer_death", "syncer")) is None
    loops.on_event(ev(T0 + 30, "fault_inject", "syncer", "pause for 5 s"))
    assert loops.on_event(ev(T0 + 31, "syncer_death")) is None
    assert loops.on_event(ev(T0 + 32, "syncer_death")) is not None


def test_rules_report_a_crash_loop_beside_the_death() -> None:
    rules = Rules(AlertsSpec(on=("crash_loop", "death"), webhook="http://h/x", crash_loop_deaths=2, min_interval_s=0))
    found = rules.events([ev(T0, "death", "learner-0"), ev(T0 + 1, "death", "learner-0")], T0 + 2)
    assert [a.kind for a in found] == ["death", "death", "crash_loop"]


# -- what an alert carries ---------------------------------------------------------------------


def test_the_payload_and_the_environment() -> None:
    record = ev(T0, "quorum_lost", detail="1 live learners, minimum quorum 2")
    alert = Alert("quorum_lost", "syncer", record["detail"], T0, suppressed=3, event=record)
    body = alerts.payload(alert, "demo-1", "/runs/demo-1")
    assert json.loads(json.dumps(body)) == body
    assert body["kind"] == "quorum_lost" and body["run"] == "demo-1" and body["event"] == record
    assert body["time"] == "2023-11-14T22:13:20+00:00" and body["suppressed"] == 3
    assert (
        body["text"]
        == "dldctl run demo-1: quorum_lost syncer: 1 live learners, minimum quorum 2 (+3 similar held back)"
    )
    env = alerts.env_vars(alert, "demo-1", "/runs/demo-1")
    assert env["DLDCTL_ALERT_KIND"] == "quorum_lost" and env["DLDCTL_ALERT_TARGET"] == "syncer"
    assert env["DLDCTL_ALERT_DETAIL"] == record["detail"] and env["DLDCTL_ALERT_RUN"] == "demo-1"
    assert env["DLDCTL_ALERT_SUPPRESSED"] == "3" and all(isinstance(v, str) for v in env.values())


def test_the_docs_name_every_kind_and_key() -> None:
    text = (ROOT / "docs" / "alerts.md").read_text()
    assert not [k for k in alertspec.KINDS if f"`{k}`" not in text]
    assert not [f for f in AlertsSpec.__dataclass_fields__ if f"\n{f} = " not in text]
