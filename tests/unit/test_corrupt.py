"""`dldctl chaos corrupt` from its tensors to its plans: the pure damage of each mode
(learner/corrupt.py: norms, signs, determinism, bitflip count and finiteness), the learner's
non-finite checks and reload (learner/health.py, OuterState.apply(overwrite=True)), the
control.json the chaos code writes as the learner reads it, and corrupt in experiment files,
the monkey's schedule, the JSON records and the verdict."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from dldctl.chaos import corruption, plan, records, verdict
from dldctl.faults import procs
from dldctl.hostruntime import HostRuntime
from dldctl.hosts.local import LocalHost
from learner import corrupt, files, offload
from learner.health import Health
from learner.outer import OuterState
from syncer.wire import fragments, quant


def _x(n: int = 1000, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-3


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


# -- learner/corrupt.py: each mode ----------------------------------------------------------------
def test_nan_sets_exactly_one_element_and_leaves_the_input_alone() -> None:
    x = _x()
    before = x.clone()
    out = corrupt.corrupt(x, "nan", 1.0, seed=5)
    assert int(torch.isnan(out).sum()) == 1 and torch.equal(x, before)
    keep = ~torch.isnan(out)
    assert torch.equal(out[keep], x[keep])
    assert torch.equal(torch.isnan(corrupt.corrupt(x, "nan", 1.0, seed=5)), torch.isnan(out)), "deterministic"


def test_scale_multiplies_by_the_factor() -> None:
    x = _x()
    out = corrupt.corrupt(x, "scale", 1e6, seed=1)
    torch.testing.assert_close(out, x * 1e6)
    assert _norm(out) == pytest.approx(1e6 * _norm(x), rel=1e-5)


def test_signflip_negates_every_value_and_keeps_the_norm() -> None:
    x = _x()
    out = corrupt.corrupt(x, "signflip", 1.0, seed=1)
    assert torch.equal(out, -x) and _norm(out) == pytest.approx(_norm(x))
    assert bool((torch.sign(out) == -torch.sign(x)).all())


def test_noise_has_the_norm_of_the_push_and_is_seeded() -> None:
    x = _x()
    a, b = corrupt.corrupt(x, "noise", 1.0, seed=7), corrupt.corrupt(x, "noise", 1.0, seed=7)
    assert torch.equal(a, b), "the same step and fragment: the same noise"
    assert not torch.equal(a, corrupt.corrupt(x, "noise", 1.0, seed=8))
    assert _norm(a) == pytest.approx(_norm(x), rel=1e-5)
    cosine = float(torch.dot(a, x)) / (_norm(a) * _norm(x))
    assert abs(cosine) < 0.2, "noise, not the push"
    assert not corrupt.corrupt(torch.zeros(10), "noise", 1.0, seed=1).any(), "a zero push stays zero"


def _changed_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.view(torch.int32) ^ b.view(torch.int32)


@pytest.mark.parametrize("count", [1, 4, 17])
def test_bitflip_flips_one_high_exponent_bit_of_count_values_and_stays_finite(count: int) -> None:
    x = _x()
    x[:50] = torch.linspace(1.0, 1.99, 50)  # bit 30 would make these inf: bit 29 instead
    x[50:60] = torch.tensor([0.0, -0.0, 2.0, -3.5, 1e30, -1e-30, 7.0, 1e-3, 1.0, -1.5])
    out = corrupt.corrupt(x, "bitflip", float(count), seed=3)
    assert torch.isfinite(out).all()
    flips = _changed_bits(out, x)
    changed = flips != 0
    assert int(changed.sum()) == count
    assert set(flips[changed].tolist()) <= {1 << 30, 1 << 29}
    assert torch.equal(corrupt.corrupt(x, "bitflip", float(count), seed=3), out), "deterministic"


def test_bitflip_uses_bit_29_where_bit_30_would_overflow() -> None:
    x = torch.linspace(1.0, 1.99, 64)  # exponent 127: bit 30 set makes 255 (inf or NaN)
    out = corrupt.bitflip(x, 64, seed=0)
    assert torch.isfinite(out).all() and set(_changed_bits(out, x).tolist()) == {1 << 29}
    y = torch.full((8,), 1e-3)  # bit 30 is clear and setting it stays finite: a huge value
    assert set(_changed_bits(corrupt.bitflip(y, 8, seed=0), y).tolist()) == {1 << 30}
    assert float(corrupt.bitflip(y, 8, seed=0).abs().min()) > 1e30


def test_bitflip_of_more_values_than_there_are_flips_them_all() -> None:
    x = _x(5)
    assert int((_changed_bits(corrupt.bitflip(x, 100, seed=1), x) != 0).sum()) == 5


@pytest.mark.parametrize("mode", quant.MODES)
def test_a_bitflipped_push_encodes_on_the_learner(mode: str) -> None:
    """What the learner's sender does next never raises, even at the top of fp32 (bf16 and int8
    then make values the syncer refuses: its defence, not the learner's crash)."""
    x = _x(512)
    x[:8] = 0.99999994  # bit 30: just under fp32's largest value
    out = corrupt.corrupt(x, "bitflip", 16.0, seed=2)
    assert torch.isfinite(out).all()
    block = quant.wire_block(mode, 128, 64)
    assert offload.blob(offload.take(out, mode, block), mode, block)


def test_an_unknown_mode_is_refused_naming_the_modes() -> None:
    with pytest.raises(ValueError, match="use one of nan, scale, signflip, noise, bitflip"):
        corrupt.corrupt(_x(), "zero", 1.0, seed=0)


def test_seeds_differ_per_step_and_fragment() -> None:
    seeds = {corrupt.seed_of(step, p) for step in range(50) for p in range(8)}
    assert len(seeds) == 400


def test_dldctl_names_the_same_modes_and_factors_as_the_learner() -> None:
    assert corruption.MODES == corrupt.MODES and corruption.WEIGHT_MODES == corrupt.WEIGHT_MODES
    assert corruption.DEFAULT_FACTOR == corrupt.DEFAULT_FACTOR


# -- dldctl/chaos/corruption.py: the input checks ---------------------------------------------------
def test_factor_defaults_and_refusals() -> None:
    assert corruption.factor_of("scale", None) == 1e6 and corruption.factor_of("bitflip", None) == 4
    assert corruption.factor_of("scale", 10.0) == 10.0 and corruption.factor_of("signflip", None) == 1.0
    for mode, factor, said in [
        ("scale", -1.0, "positive, finite"),
        ("scale", 0.0, "positive, finite"),
        ("scale", float("inf"), "positive, finite"),
        ("scale", float("nan"), "positive, finite"),
        ("bitflip", 2.5, "whole number"),
        ("noise", 3.0, "noise takes no factor"),
        ("bogus", None, "use one of nan, scale"),
    ]:
        with pytest.raises(ValueError, match=said):
            corruption.factor_of(mode, factor)


# -- learner/health.py: the non-finite checks ---------------------------------------------------
def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3), torch.randn(2, 4)


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_non_finite_gradients_skip_the_step_and_mark_the_learner(grad_clip: float) -> None:
    model, x = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    health = Health(device_skip=False, island=False)
    (model(x).sum() * float("nan")).backward()
    assert not health.step_ok(model.parameters(), grad_clip, opt)
    assert health.reasons == ["gradients"]
    opt.zero_grad()
    model(x).sum().backward()
    assert health.step_ok(model.parameters(), grad_clip, opt)


def test_fused_adamw_skips_a_non_finite_step_on_the_device() -> None:
    """CUDA's path (fused AdamW), on the CPU: no host read per step; the norm is read with the losses."""
    model, x = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    health = Health(device_skip=True, island=False)
    before = [p.detach().clone() for p in model.parameters()]
    (model(x).sum() * float("inf")).backward()
    assert health.step_ok(model.parameters(), 1.0, opt)  # the step is taken, and does nothing
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert health.reasons == []
    health.read_norms()
    assert health.reasons == ["gradients"]
    opt.zero_grad()
    model(x).sum().backward()
    assert health.step_ok(model.parameters(), 1.0, opt)
    opt.step()
    assert not torch.equal(before[0], next(model.parameters()))


def test_a_non_finite_outer_gradient_is_not_pushed() -> None:
    health = Health(device_skip=False, island=False)
    delta = _x(100)
    assert health.outgoing(2, delta, step=10) is delta
    delta[3] = float("inf")
    assert health.outgoing(2, delta, step=10) is None
    assert health.reasons == ["outer gradient of fragment 2"]


def test_the_reload_line_says_what_and_comes_at_most_once_a_second() -> None:
    health = Health(device_skip=False, island=False)
    health.mark("gradients")
    health.mark("loss")
    health.mark("loss")
    assert health.reload_line(16) == "non-finite loss and gradients at step 16; reloading the global model"
    assert not health.diverged
    health.mark("loss")
    assert health.reload_line(17) is None, "one second apart at most"
    health._said_at -= 2
    health.mark("outer gradient of fragment 1")
    assert health.reload_line(30) == (
        "non-finite outer gradient of fragment 1 at step 30; reloading the global model (1 more since the last line)"
    )


def test_reloads_in_a_row_wait_longer_each_time_and_a_finite_stretch_forgets_them() -> None:
    """A device that turns every step non-finite must not spin a core (or a GPU) at reloading:
    on 2 cores the spinning learner took 27% of the healthy learners' rate."""
    health = Health(device_skip=False, island=False)
    waits = []
    for step in range(10, 17):  # non-finite every step, a reload each
        health.mark("loss")
        health.reload_line(step)
        waits.append(health.wait_s())
    assert waits == [0.0, 0.0, 0.5, 1.0, 2.0, 4.0, 8.0]
    for _ in range(3):
        health.mark("loss")
        health.reload_line(17)
    assert health.wait_s() == 10.0, "at most 10 s"
    health._said_at -= 2
    health.mark("loss")
    assert "in a row: waiting 10 s" in (health.reload_line(18) or "")
    health.mark("loss")
    health.reload_line(100)  # trained finite for a while: a transient, reloaded at once
    assert health.wait_s() == 0.0


SPECS = [fragments.TensorSpec("w", (6, 4)), fragments.TensorSpec("b", (8,))]


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=g) for s in SPECS}


def test_the_weight_modes_damage_the_learner_but_not_an_island() -> None:
    frag = fragments.plan(SPECS, 2)
    for island in (False, True):
        health, params = Health(False, island), _params()
        health.corruption = ("nan", 1.0, time.time() + 60)
        health.before_step(frag, params, step=3)  # fragment 3 % 2 = 1
        nans = [int(torch.isnan(frag.gather(p, params)).sum()) for p in range(2)]
        assert nans == ([0, 0] if island else [0, 1])
        health.corruption = ("scale", 1e6, time.time() + 60)
        before = frag.gather(0, params)
        health.before_take(frag, 0, params, step=4)
        torch.testing.assert_close(frag.gather(0, params), before if island else before * 1e6)


def test_the_push_modes_corrupt_what_is_pushed_until_the_fault_ends() -> None:
    health, delta = Health(False, island=True), _x(64)
    health.corruption = ("signflip", 1.0, time.time() + 60)
    out = health.outgoing(0, delta, step=1)
    assert out is not None and torch.equal(out, -delta), "an island's pushes too"
    health.corruption = ("signflip", 1.0, time.time() - 1)
    assert health.outgoing(0, delta, step=1) is delta


def test_a_reload_overwrites_even_a_rebasing_learner() -> None:
    """Rebase (local := global + local - mark) kept a NaN of the local weights forever."""
    frag = fragments.plan(SPECS, 2)
    params = _params()
    values = [(1, torch.zeros(frag.numel(p))) for p in range(2)]
    outer = OuterState.start(frag, 8, 0.0, values, params, rebase=True)
    outer.count_step(100, 0.1)
    params["w"][0, 0] = float("nan")
    global_value = torch.ones(frag.numel(0))
    outer.apply(0, 2, global_value, params)
    assert torch.isnan(frag.gather(0, params)).any(), "a reply rebases: the NaN stays"
    outer.apply(0, 3, global_value, params, overwrite=True)
    torch.testing.assert_close(frag.gather(0, params), global_value)
    torch.testing.assert_close(outer.mark[0], global_value)
    assert outer.counters[0].steps == 0 and outer.base_version[0] == 3


# -- control.json: written by the chaos code, read by the learner ---------------------------------
def test_the_learner_reads_the_corruption_the_chaos_code_writes(tmp_path: Path) -> None:
    runtime = HostRuntime("here", "python3", "", str(tmp_path), str(tmp_path / "config.json"))
    host = LocalHost("here")
    control = files.Controls(tmp_path / "learners" / "learner-0" / "control.json")
    assert procs.apply("corrupt", host, runtime, "learner-0", None, 30.0, 4.0, mode="bitflip")
    procs.apply("slow", host, runtime, "learner-0", None, 30.0, 2.0)  # merged, not replacing
    control.read()
    mode, factor, until = control.corruption() or ("", 0.0, 0.0)
    assert (mode, factor) == ("bitflip", 4.0) and until == pytest.approx(time.time() + 30, abs=5)
    assert control.slow_factor() == 2.0
    assert procs.undo("corrupt", host, runtime, "learner-0", None)
    control.mtime = 0.0  # as if its mtime changed (a coarse clock may not show it yet)
    control.read()
    assert control.corruption() is None and control.slow_factor() == 2.0


def test_a_control_file_with_nonsense_reads_as_no_corruption(tmp_path: Path) -> None:
    path = tmp_path / "control.json"
    control = files.Controls(path)
    for values in (
        '{"corrupt_mode": "melt", "corrupt_until": 1e12}',
        '{"corrupt_mode": "nan", "corrupt_until": "soon"}',
        '{"corrupt_mode": 3, "corrupt_until": 1e12}',
    ):
        path.write_text(values)
        control.mtime = 0.0
        control.read()
        assert control.corruption() is None, values
    path.write_text('{"corrupt_mode": "scale", "corrupt_until": 1e12, "corrupt_factor": -5}')
    control.mtime = 0.0
    control.read()
    assert control.corruption() == ("scale", 1e6, 1e12), "a bad factor: the mode's default"


# -- experiments, the monkey, records, verdict ----------------------------------------------------
def _experiment(**fault: object) -> plan.Experiment:
    entry = {"at": 1, "action": "corrupt", "target": "learner-1", "duration": "5s", **fault}
    return plan.parse_experiment({"fault": [entry]})


def test_an_experiment_takes_a_corrupt_fault_with_its_mode_and_factor() -> None:
    fault = _experiment(mode="scale", factor=100).faults[0]
    assert (fault.mode, fault.factor, fault.duration) == ("scale", 100.0, 5.0)
    assert "corrupt   learner-1  scale x100 for 5 s" in fault.describe()
    assert _experiment(mode="bitflip").faults[0].factor == 4.0
    assert records.planned(_experiment(mode="signflip").faults[0])["mode"] == "signflip"
    assert records.planned(_experiment(mode="signflip").faults[0])["factor"] is None
    for fault_keys, said in [
        ({}, "a corrupt fault needs mode = one of nan"),
        ({"mode": "melt"}, "mode: unknown corruption mode 'melt'"),
        ({"mode": "scale", "factor": -1}, "factor: must be a positive, finite number"),
        ({"mode": "noise", "factor": 2}, "noise takes no factor"),
    ]:
        with pytest.raises(plan.PlanError, match=said):
            _experiment(**fault_keys)
    with pytest.raises(plan.PlanError, match="only a corrupt fault has a mode"):
        plan.parse_experiment({"fault": [{"at": 1, "action": "pause", "target": "learner-1", "mode": "nan"}]})


def test_the_monkey_corrupts_only_when_asked_and_draws_the_mode() -> None:
    def schedule(actions: list[str]) -> list[plan.Fault]:
        return plan.monkey_schedule(
            random.Random(3), mtbf_s=1.0, duration_s=200.0, targets=["learner-0"], actions=actions
        )

    assert all(f.action != "corrupt" and not f.mode for f in schedule(["kill", "pause", "slow"]))
    corrupted = [f for f in schedule(["kill", "corrupt"]) if f.action == "corrupt"]
    assert {f.mode for f in corrupted} == set(corruption.MODES)
    assert all(f.factor == corruption.factor_of(f.mode, None) for f in corrupted)
    assert schedule(["kill", "corrupt"]) == schedule(["kill", "corrupt"]), "seeded"


@pytest.mark.parametrize("action", ["corrupt", "link"])
def test_the_verdict_judges_a_corrupt_or_link_fault(action: str) -> None:
    fault = plan.Fault(1.0, action, "learner-1", 5.0, mode="signflip" if action == "corrupt" else "")
    exp = plan.Experiment("x", 20.0, (fault,))
    events = [
        {"t": 103.0, "kind": "reject", "target": "learner-1"},
        {"t": 106.0, "kind": "fault_undo", "target": "learner-1"},
    ]
    result = verdict.evaluate(exp, [{"now": 100.0}, {"now": 120.0}], events, [101.0])
    report = result.faults[0].to_dict()
    assert report["back_after_s"] == 5.0
    assert report["detected_after_s"] == (2.0 if action == "corrupt" else None)


def test_the_json_of_a_corruption_has_its_mode_and_the_others_are_as_they_were() -> None:
    hit = records.Injection(
        "corrupt", "learner-1", "a", 7, 1.0, 30.0, 31.0, "corrupt ...", None, 4.0, "f1", mode="bitflip"
    )
    doc = records.injected("r", hit)
    assert (doc["mode"], doc["factor"], doc["fault_id"]) == ("bitflip", 4.0, "f1")
    assert "mode" not in records.injected("r", records.Injection("pause", "learner-1", "a", 7, 1.0, 2.0, 3.0, "x"))
    fault = _experiment(mode="noise").faults[0]
    missed = records.fault_line("r", fault, None, "refused", 5.0)
    assert (missed["injected"], missed["mode"], missed["factor"], missed["fault_id"]) == (False, "noise", None, None)
