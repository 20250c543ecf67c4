"""dldctl/learnermem.py and memcheck.learner_needs: what CPU learners need, per machine."""

from __future__ import annotations

import pytest

from dldctl import learnermem, syncermem
from dldctl.errors import OperationError
from dldctl.inventory import HostSpec, Inventory, SSHSpec, SyncerSpec
from dldctl.learnermem import MachineNeed, verdict
from dldctl.lifecycle import memcheck
from syncer.common.settings import RunSettings
from workload import presets


def test_the_estimate_is_base_plus_state_plus_activations_linear_in_tokens() -> None:
    cfg = presets.config_for("gpt2-124m", vocab_size=256, block_size=1024)
    one, two = learnermem.activations(cfg, 1, 1024), learnermem.activations(cfg, 2, 1024)
    assert two == pytest.approx(2 * one)  # no seq x seq scores: torch's CPU attention keeps none
    assert learnermem.activations(cfg, 1, 512) == pytest.approx(one / 2)
    need = learnermem.learner_need(cfg, 86_039_040, 1, 1024)
    assert need == pytest.approx(learnermem.BASE_B + 28 * 86_039_040 + one)
    assert 3.2e9 < need < 3.8e9  # bench/learner_memory.py measured 3.29-3.53 GB for this learner


def test_the_verdict_fails_above_free_and_warns_within_ten_percent() -> None:
    need = MachineNeed("a", 2, (1e9, 1e9), 0.5e9)
    assert verdict(need, int(3e9), "MemAvailable", "m")[0] == syncermem.FITS
    assert verdict(need, int(2.6e9), "MemAvailable", "m")[0] == syncermem.MAY_NOT_FIT
    status, line = verdict(need, int(2e9), "cgroup limit", "m")
    assert status == syncermem.DOES_NOT_FIT
    assert line == "2 CPU learners (m) need 2.0 GB, 1.0 GB each, beside the syncer's 0.5 GB; 2.0 GB free (cgroup limit)"
    assert verdict(need, None, "not asked: x", "m") == (
        syncermem.FITS,
        line.split("; ")[0] + "; free memory unknown (not asked: x)",
    )
    alone = verdict(MachineNeed("a", 1, (1e9,), 0.0), int(8e9), "MemAvailable", "m")[1]
    assert alone == "1 CPU learner (m) need 1.0 GB; 8.0 GB free (MemAvailable)"


def _inv(*hosts: HostSpec) -> Inventory:
    run = RunSettings(name="t", model="gpt-small", batch_size=16, seq_len=128, fragments=4)
    return Inventory(run, SSHSpec(), SyncerSpec(), hosts)


def test_hosts_that_share_an_address_are_one_machine_and_gpus_and_sites_are_not_counted() -> None:
    inv = _inv(
        HostSpec("fast", "local", learners=2),
        HostSpec("slow", "local", learners=1, batch_size=8),
        HostSpec("gpu", "10.0.0.2", learners=2, device="cuda"),
        HostSpec("cpu-a", "10.0.0.3", learners=1, nproc=2),
        HostSpec("cpu-b", "10.0.0.3", learners=1),
        HostSpec("site", "local", learners=3, scheduler="slurm"),
    )
    syncer = [memcheck.HostMemory(None, "", "ok", "", need=syncermem.Need("local", (0,), 1, 3e8, 4e8, 5e8))]
    needs = {need.machine: need for _, need in memcheck.learner_needs(inv, syncer)}
    assert set(needs) == {"fast, slow", "cpu-a, cpu-b"}
    here, there = needs["fast, slow"], needs["cpu-a, cpu-b"]
    assert here.learners == 3 and here.beside == 3e8 and here.each[0] == here.each[1] > here.each[2]
    assert there.learners == 3 and there.beside == 0  # learners x ranks; no syncer there


def test_learner_add_asks_the_host_for_cpu_learners_only() -> None:
    inv = _inv(HostSpec("here", "local", learners=1))
    assert memcheck.add_check(inv, HostSpec("here", "local"), 1) is None  # 0.45 GB: this machine has it
    with pytest.raises(OperationError, match=r"host here: 100000 CPU learners \(gpt-small\) need .* GB free \("):
        memcheck.add_check(inv, HostSpec("here", "local"), 100_000)
    gpu, site = HostSpec("g", "10.0.0.9", device="cuda"), HostSpec("s", "local", scheduler="slurm")
    assert memcheck.add_check(inv, gpu, 100_000) is None and memcheck.add_check(inv, site, 100_000) is None
