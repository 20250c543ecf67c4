"""`chaos link` as data (dldctl/faults/linkcap.py): rates, what a host's probe says, the tc
commands for each end and their undo; the plan's `link` faults. The commands run for real on
shaped network namespaces in tests/e2e/test_sites.py."""

from __future__ import annotations

import random
import re

import pytest

from dldctl.chaos import plan
from dldctl.faults import linkcap
from dldctl.faults.linkcap import LinkCapError, LinkSide

PROBE = """uid=0
tc=/usr/sbin/tc
ip=198.18.1.1
route=198.18.1.1 via 198.18.2.1 dev dlds2-ab src 198.18.2.2 uid 0 \\    cache
dev=dlds2-ab
qdisc=qdisc htb 1: root refcnt 2 r2q 10 default 0x1 direct_packets_stat 0 direct_qlen 1000
"""


def test_rates_in_tc_units() -> None:
    assert linkcap.parse_rate("1mbit") == 1_000_000
    assert linkcap.parse_rate("500kbit") == 500_000
    assert linkcap.parse_rate("2.5gbit") == 2_500_000_000
    for bad in ("1MB", "fast", "10", "1000bit"):
        with pytest.raises(LinkCapError):
            linkcap.parse_rate(bad)


def test_a_probe_gives_the_device_the_address_and_the_root_qdisc() -> None:
    side = linkcap.parse_probe("site2", "198.18.1.1", PROBE)
    assert side == LinkSide("site2", "198.18.1.1", "dlds2-ab", "198.18.2.2", "htb", "1")
    assert linkcap.parse_root("qdisc noqueue 0: root refcnt 2") == ("noqueue", "0")
    assert linkcap.parse_root("") == ("noqueue", "0")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (("uid=0", "uid=1000"), "host site2: not root (tc needs CAP_NET_ADMIN"),
        (("tc=/usr/sbin/tc", "tc="), "host site2: tc not found (install iproute2)"),
        (("ip=198.18.1.1", "ip="), "host site2: cannot resolve 198.18.1.1"),
        (("dev=dlds2-ab", "dev="), "host site2: no route to 198.18.1.1"),
    ],
)
def test_a_host_that_cannot_take_a_cap_is_named_with_the_reason(change: tuple[str, str], words: str) -> None:
    with pytest.raises(LinkCapError, match=re.escape(words)):
        linkcap.parse_probe("site2", "198.18.1.1", PROBE.replace(*change))


def test_on_a_shaped_link_the_cap_is_one_more_class_beside_it() -> None:
    side = linkcap.parse_probe("site2", "198.18.1.1", PROBE)
    commands = linkcap.cap_commands(side, "learner-3", 0, 1_000_000, linkcap.to_syncer("198.18.1.1", 5555))
    assert commands == [
        "tc class replace dev dlds2-ab parent 1: classid 1:a003 htb rate 1000000bit ceil 1000000bit "
        "burst 16384 cburst 16384",
        "tc filter replace dev dlds2-ab parent 1: protocol ip pref 40003 u32 "
        "match ip dst 198.18.1.1/32 match ip dport 5555 0xffff flowid 1:a003",
    ]
    undo = linkcap.uncap_script(side, "learner-3", 0)
    assert "tc filter del dev dlds2-ab parent 1: pref 40003" in undo and "classid 1:a003" in undo
    assert "qdisc del" not in undo  # the link's own shaping stays


def test_on_a_default_qdisc_dldctl_adds_its_own_root_and_removes_it_with_the_last_cap() -> None:
    side = LinkSide("syncer-host", "198.18.2.2", "eth0", "198.18.1.1", "fq_codel", "0")
    commands = linkcap.cap_commands(side, "learner-3", 1, 1_000_000, linkcap.from_syncer("198.18.2.2", 5555))
    assert commands[:2] == [
        "tc qdisc replace dev eth0 root handle d1d: htb default 1",
        "tc class replace dev eth0 parent d1d: classid d1d:1 htb rate 100gbit",  # everything else: full speed
    ]
    assert "classid d1d:b003" in commands[2] and "match ip sport 5555 0xffff flowid d1d:b003" in commands[3]
    after = LinkSide("syncer-host", "198.18.2.2", "eth0", "198.18.1.1", "htb", "d1d")
    assert "tc qdisc del dev eth0 root" in linkcap.uncap_script(after, "learner-3", 1)


def test_a_root_qdisc_of_someone_else_is_refused() -> None:
    side = LinkSide("site2", "198.18.1.1", "eth0", "198.18.2.2", "tbf", "8001")
    with pytest.raises(LinkCapError, match="host site2: eth0's root qdisc is tbf"):
        linkcap.cap_commands(side, "learner-1", 0, 1_000_000, "match ip dst 1.2.3.4/32")


def test_both_ends_of_one_learner_fit_on_one_device() -> None:
    assert linkcap.ids("learner-3", 0) != linkcap.ids("learner-3", 1)
    assert linkcap.ids("learner-3", 0) != linkcap.ids("learner-4", 0)
    assert linkcap.burst_bytes(1_000_000_000) == 2_500_000  # 20 ms at 1 Gbit/s


def test_link_faults_in_experiments_and_the_monkey() -> None:
    exp = plan.parse_experiment(
        {"experiment": {"name": "x"}, "fault": [{"at": 5, "action": "link", "target": "learner-1", "rate": "2mbit"}]}
    )
    (fault,) = exp.faults
    assert (fault.action, fault.rate, fault.duration) == ("link", "2mbit", 10.0)
    assert "2mbit for 10 s" in fault.describe()
    with pytest.raises(plan.PlanError, match="rate: '2MB' is not a rate"):
        plan.parse_experiment(
            {"experiment": {"name": "x"}, "fault": [{"at": 5, "action": "link", "target": "l", "rate": "2MB"}]}
        )
    schedule = plan.monkey_schedule(
        random.Random(1), mtbf_s=5, duration_s=60, targets=["learner-0"], actions=["link"], link_rate="3mbit"
    )
    assert schedule and all(f.action == "link" and f.rate == "3mbit" for f in schedule)
