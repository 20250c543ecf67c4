"""learner.recipe.resolve_device: what a host's `device` setting becomes.

On a GPU host (torch 2.11, H200) `device = "cuda"` killed every learner at start: the bare
"cuda" device has no index and `torch.cuda.set_device` refuses that. The CUDA calls are replaced
here by ones that behave like torch's (set_device refuses a device without an index); the real
thing runs in tests/integration/test_cuda_learner.py wherever torch sees a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from learner.recipe import resolve_device


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    chosen: list[torch.device] = []

    def set_device(device: torch.device) -> None:
        if device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        chosen.append(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return chosen


def test_bare_cuda_gets_the_current_device_index(fake_gpus: list[torch.device]) -> None:
    assert resolve_device("cuda") == torch.device("cuda:0")
    assert fake_gpus == [torch.device("cuda:0")]


def test_an_island_rank_takes_its_local_rank_gpu(fake_gpus: list[torch.device]) -> None:
    assert resolve_device("cuda", SimpleNamespace(local_rank=3)) == torch.device("cuda:3")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    assert fake_gpus == [torch.device("cuda:3"), torch.device("cuda:1")]


def test_cpu_and_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"device 'cuda' requested but torch.cuda.is_available\(\) is False"):
        resolve_device("cuda")
    with pytest.raises(RuntimeError, match="unknown device 'tpu'; use cpu, cuda or cuda:N"):
        resolve_device("tpu")
