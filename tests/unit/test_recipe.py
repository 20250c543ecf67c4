"""The learner's training recipe (learner/recipe.py) and the outer gradient's device path
(learner/offload.py, quant.payload_here): pure parts, on the CPU; the CUDA path where a GPU is."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from learner import offload, recipe
from learner.sends import PushItem, coalesce
from syncer.wire import codec, quant

CPU = torch.device("cpu")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cpu_defaults_are_unchanged() -> None:
    r = recipe.resolve("auto", "auto", True, CPU)
    assert (r.autocast, r.compile, r.fused, r.tf32) == (None, False, False, False)
    assert (r.precision, r.warmup_steps, r.describe()) == ("fp32", 1, "fp32, eager")
    assert isinstance(recipe.autocast(r), type(recipe.autocast(r)))  # a context manager either way
    model = torch.nn.Linear(4, 4)
    assert recipe.compiled(r, model) is model
    opt = recipe.optimizer(r, model.parameters(), 1e-3, 0.1)
    assert not opt.defaults.get("fused")


def test_asked_for_recipe_on_the_cpu() -> None:
    r = recipe.resolve("bf16", True, True, CPU)
    assert (r.precision, r.compile, r.tf32, r.warmup_steps) == ("bf16", True, False, recipe.WARMUP_COMPILED)
    with recipe.autocast(r):
        y = torch.nn.Linear(8, 8)(torch.randn(2, 8))
    assert y.dtype == torch.bfloat16, "the forward runs in bf16"


@cuda
def test_cuda_defaults_are_a_gpu_users() -> None:
    r = recipe.resolve("auto", "auto", True, torch.device("cuda"))
    assert r.compile and r.fused and r.tf32
    assert r.precision == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")


def test_the_loss_meter_reads_in_batches_in_order() -> None:
    meter = recipe.LossMeter(every=3)
    for v in (1.0, 2.0):
        meter.add(torch.tensor(v))
        assert not meter.due()
    meter.add(torch.tensor(float("nan")))
    assert meter.due()
    got = meter.read()
    assert got[:2] == [1.0, 2.0] and math.isnan(got[2])
    assert meter.read() == [] and not meter.due()
    assert recipe.LossMeter.for_device(CPU).every == 1, "on the CPU a read is free: every step"


def test_steady_throughput_leaves_the_warmup_out() -> None:
    s = recipe.Steady(warmup_steps=3, started=100.0)
    for i, now in enumerate((110.0, 110.5, 111.0, 111.1, 111.2), start=1):
        s.stepped(i, 64 * i, now, loop_started=105.0)
    record = s.record(64 * 5, ended=111.2)
    assert record["first_step_s"] == 10.0 and record["warmup_s"] == 6.0
    assert record["steady_tokens"] == 128 and record["steady_s"] == pytest.approx(0.2)
    cold = recipe.Steady(warmup_steps=3, started=0.0)
    cold.stepped(1, 64, 1.0, 0.0)
    assert cold.record(64, 1.0)["steady_s"] is None, "a loop that never warmed has no steady rate"


@pytest.mark.parametrize("mode", quant.MODES)
@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 5000])
def test_the_payload_encoded_where_the_tensor_lives_is_encode_byte_for_byte(mode: str, n: int) -> None:
    torch.manual_seed(n)
    x = torch.randn(n) * 3
    if n > 200:
        x[:128] = 0  # an all-zero block
        x[140] = 1e-38  # a tiny one
    block = quant.wire_block(mode, 64, 16)
    payload = quant.payload_here(x, mode, block)
    assert codec.encode_payload(payload, mode, n, block) == codec.encode(x, mode, block)
    with pytest.raises(codec.CodecError):
        codec.encode_payload(payload[:-1] if payload.numel() else torch.zeros(1, dtype=torch.uint8), mode, n, block)


@dataclass
class _Done:
    """A finished copy (the event a CUDA DeviceDelta waits on)."""

    def synchronize(self) -> None:
        return None


def _device_delta(x: torch.Tensor) -> offload.DeviceDelta:
    return offload.DeviceDelta(quant.payload_here(x, "int4", 128), _Done(), "int4", x.numel(), 128)


def test_on_the_cpu_the_outer_gradient_is_the_tensor_and_its_blob_the_codecs() -> None:
    x = torch.randn(1000)
    taken = offload.take(x, "int4", 128)
    assert isinstance(taken, torch.Tensor) and taken.device == CPU
    assert offload.blob(taken, "int4", 128) == codec.encode(x, "int4", 128)
    assert offload.blob(_device_delta(x), "int4", 128) == codec.encode(x, "int4", 128)
    assert offload.to_device(x, CPU) is x


def test_two_waiting_pushes_of_a_device_delta_add_as_the_syncer_would_decode_them() -> None:
    a, b = torch.randn(512), torch.randn(512)
    older = PushItem(0, _device_delta(a), 3, 2, 64, 0.5, 0.25)
    newer = PushItem(0, b, 3, 1, 32, 0.25, 0.25)
    both = coalesce(older, newer)
    assert torch.equal(offload.values(both.delta), quant.roundtrip(a) + b)
    assert (both.c_steps, both.c_tokens) == (3, 96)


@cuda
def test_on_cuda_the_outer_gradient_leaves_encoded_and_bit_exact() -> None:
    x = torch.randn(100_003, device="cuda") * 2
    taken = offload.take(x, "int4", 128)
    assert isinstance(taken, offload.DeviceDelta) and taken.payload.is_pinned()
    assert taken.blob() == codec.encode(x.cpu(), "int4", 128), "the GPU's codes are the CPU's"
    value = torch.randn(4096)
    assert torch.equal(offload.to_device(value, torch.device("cuda")).cpu(), value)
