"""bench/learner_throughput.py's pure parts (the runs themselves start fleets: a benchmark): the
recipe's `[run]` keys, the steady throughput of a learner's `finished` record with and without
the warmup keys, the plain loop cut at the same warmup, the paired ratios, their range and the
targets' verdicts, and which cases a command line picks. No process is started."""

from __future__ import annotations

import argparse
import os

import pytest

from bench import learner_throughput as lt
from bench import plain_loop
from bench.plain_loop import Recipe
from syncer.common.settings import settings_from_dict

# a plain loop of 10 steps of 100 tokens: 2 s to compile in step 1, then 0.1 s a step
PLAIN = {
    "steps": 10,
    "tokens": 1000,
    "loop_s": 2.9,
    "marks_s": [2.0, 2.1, 2.2],  # its 3 warmup steps, timed one by one
    "mark_tokens": [100, 200, 300],
    "first_step_s": 6.0,
    "peak_memory_bytes": 1000,
}
OLD_RECORD = {"steps": 10, "tokens": 1000, "device": "cuda:0", "train_s": 3.0, "busy_s": 2.9, "blocked_s": 0.03}
NEW_RECORD = {
    **OLD_RECORD,
    "warmup_steps": 3,
    "warmup_s": 2.1,
    "steady_tokens": 700,
    "steady_s": 0.75,
    "first_step_s": 9.0,
    "peak_memory_bytes": 1050,
    "precision": "bf16",
    "compiled": True,
}


def test_a_recipe_becomes_the_learners_run_keys_and_the_settings_accept_every_case() -> None:
    case = next(c for c in lt.CASES if c.name == "cuda-gpt2-124m-bf16")
    run = lt.run_table(case, 300)
    assert (run["precision"], run["compile"], run["tf32"]) == ("bf16", True, True)
    assert (run["model"], run["seq_len"], run["batch_size"], run["steps"]) == ("gpt2-124m", 1024, 16, 300)
    assert run["eval_every"] > run["steps"]  # no evaluation inside the timed loop
    for c in lt.CASES:
        s = settings_from_dict(lt.run_table(c, c.steps))
        assert (s.precision, s.compile) == (c.recipe.precision, c.recipe.compile)
    assert Recipe("fp32", False).label == "fp32" and lt.BF16_COMPILE.label == "bf16+compile"
    assert plain_loop.default_warmup(True) == 3 and plain_loop.default_warmup(False) == 1


def test_the_steady_throughput_of_a_record_with_the_warmup_keys() -> None:
    ours = lt.learner_steady(NEW_RECORD)
    assert ours["basis"] == "steady" and ours["warmup_steps"] == 3 and ours["warmup_s"] == 2.1
    assert ours["tokens_per_s"] == pytest.approx(700 / 0.75)
    assert ours["blocked"] == pytest.approx(0.03 / 0.75)  # of the steady loop, not of the compilation
    assert lt.recipe_of(NEW_RECORD) == "bf16+compile"


def test_a_record_without_them_counts_its_whole_loop() -> None:
    ours = lt.learner_steady(OLD_RECORD)
    assert ours["basis"] == "whole loop" and ours["warmup_steps"] == 0 and ours["warmup_s"] is None
    assert ours["tokens_per_s"] == pytest.approx(1000 / 3.0)
    assert ours["blocked"] == pytest.approx(0.01)
    assert lt.recipe_of(OLD_RECORD) is None
    assert lt.learner_steady({**NEW_RECORD, "steady_s": 0})["basis"] == "whole loop"


def test_the_plain_loop_is_cut_at_any_warmup_up_to_its_timed_steps() -> None:
    cut = plain_loop.steady(PLAIN, 3)
    assert (cut["warmup_steps"], cut["warmup_s"], cut["steady_tokens"]) == (3, 2.2, 700)
    assert cut["tokens_per_s"] == pytest.approx(700 / 0.7)
    whole = plain_loop.steady(PLAIN, 0)
    assert whole["tokens_per_s"] == pytest.approx(1000 / 2.9) and whole["warmup_s"] == 0.0
    assert plain_loop.steady(PLAIN, 1)["tokens_per_s"] == pytest.approx(900 / 0.9)
    assert plain_loop.steady(PLAIN, 9)["warmup_steps"] == 3  # past the timed steps: cut at the last


def test_a_pair_compares_like_with_like() -> None:
    new = lt.pair(PLAIN, NEW_RECORD, lt.BF16_COMPILE)
    assert new["ratio"] == pytest.approx((700 / 0.75) / (700 / 0.7))  # both after 3 warmup steps
    assert new["warmup_steps"] == new["plain_warmup_steps"] == 3
    assert new["memory_ratio"] == pytest.approx(1.05)
    assert (new["plain_first_step_s"], new["learner_first_step_s"]) == (6.0, 9.0)
    assert (new["plain_warmup_s"], new["learner_warmup_s"]) == (2.2, 2.1)
    old = lt.pair(PLAIN, OLD_RECORD, lt.BF16_COMPILE)
    assert old["basis"] == "whole loop" and old["plain_warmup_steps"] == 0
    assert old["ratio"] == pytest.approx((1000 / 3.0) / (1000 / 2.9))  # the plain loop's whole loop too
    assert old["memory_ratio"] is None and old["learner_first_step_s"] is None
    assert old["plain_warmup_s"] == 2.2  # shown at the recipe's default warmup (3 compiled)


def _pair(ratio: float, blocked: float = 0.001, memory: float | None = 1.02) -> dict:
    return {"basis": "steady", "ratio": ratio, "blocked": blocked, "memory_ratio": memory, "learner_recipe": "fp32"}


def test_repeats_give_the_median_ratio_its_range_and_the_verdicts() -> None:
    row = lt.summarize([_pair(0.99), _pair(0.98), _pair(1.01)], lt.GPU_TARGETS)
    assert row["ratio"] == 0.99 and (row["ratio_lo"], row["ratio_hi"]) == (0.98, 1.01)
    assert row["noise"] == pytest.approx(0.03 / 0.99)
    assert {k: t["verdict"] for k, t in row["targets"].items()} == {
        "ratio >= 0.97": "pass",
        "blocked < 1%": "pass",
        "peak memory <= 1.1 x plain": "pass",
    }
    assert lt.verdict_line(row["targets"]).startswith("ratio >= 0.97: pass; blocked < 1%: pass")


def test_noise_that_spans_the_limit_is_unclear_and_a_missing_figure_is_not_a_pass() -> None:
    row = lt.summarize([_pair(0.96, memory=None), _pair(0.98, memory=None), _pair(0.99, 0.02, None)], lt.GPU_TARGETS)
    verdicts = {k: t["verdict"] for k, t in row["targets"].items()}
    assert verdicts["ratio >= 0.97"] == "unclear"
    assert verdicts["peak memory <= 1.1 x plain"] == "not reported"
    one = lt.summarize([_pair(0.95, 0.02, 1.2)], lt.GPU_TARGETS)
    assert one["noise"] is None and {t["verdict"] for t in one["targets"].values()} == {"FAIL"}
    assert lt.summarize([_pair(0.5)], ())["targets"] == {}  # a case without targets only reports


def test_a_learner_that_ran_another_recipe_fails_its_row() -> None:
    ran = lt.summarize([_pair(1.0)], (), lt.FP32)["targets"]["learner ran fp32"]
    assert ran == {"value": "fp32", "verdict": "pass"}
    eager = lt.summarize([_pair(1.0)], (), lt.BF16_COMPILE)["targets"]["learner ran bf16+compile"]
    assert eager["verdict"] == "FAIL"  # learner/recipe.py trains eager where compile fails
    silent = lt.summarize([{**_pair(1.0), "learner_recipe": None}], (), lt.FP32)
    assert silent["targets"]["learner ran fp32"]["verdict"] == "not reported"


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"devices": "cpu", "case": None, "quick": False, **kw})


def test_the_command_line_picks_the_cases() -> None:
    assert [(c.name, n) for c, n in lt.select(_args())] == [("cpu-gpt-tiny", 400), ("cpu-gpt-small", 300)]
    assert [(c.name, n) for c, n in lt.select(_args(quick=True))] == [("cpu-gpt-small", 60)]
    cuda = [c.name for c, _ in lt.select(_args(devices="cuda"))]
    assert cuda[0] == "cuda-gpt2-124m-bf16" and len(cuda) == 3  # the headline first
    assert [c.name for c, _ in lt.select(_args(case="cpu-gpt-tiny", quick=True))] == ["cpu-gpt-tiny"]
    with pytest.raises(SystemExit, match="unknown case"):
        lt.select(_args(case="nope"))


def test_the_budget_and_the_fresh_compile_cache() -> None:
    assert lt.Deadline(None).left(100.0) == 100.0
    assert lt.Deadline(1000.0).left(100.0) == 100.0
    with pytest.raises(TimeoutError):
        lt.Deadline(5.0).left(100.0)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with lt.compile_cache("fresh") as env:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == env["TORCHINDUCTOR_CACHE_DIR"] != before
        assert "TRITON_CACHE_DIR" in env
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before
    with lt.compile_cache("shared") as env:
        assert env == {}
