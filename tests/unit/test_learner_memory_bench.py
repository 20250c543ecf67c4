"""bench/learner_memory.py's pure part: the estimate it sets against a learner's peak."""

from __future__ import annotations

import pytest

from bench import learner_memory
from dldctl import learnermem


def test_the_bench_judges_the_estimate_up_uses_with_its_parts_adding_up() -> None:
    row = learner_memory.estimate("gpt2-124m", 1, 1024)
    assert row["params"] == 86_039_040
    assert row["estimate_B"] == pytest.approx(row["base_B"] + row["state_B"] + row["activations_B"])
    assert row["state_B"] == learnermem.STATE_B * row["params"] and row["base_B"] == learnermem.BASE_B
    assert [c[0] for c in learner_memory.CASES][:2] == ["gpt-tiny", "gpt-small"]  # --quick's two
