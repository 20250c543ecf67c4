"""bench/quality.py's rows and plot when the data-parallel baseline failed (the run itself takes
minutes: it is a benchmark). A failed baseline once crashed the plot before the JSON was written,
losing a 25-minute run's DiLoCo results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import quality


def _rows(dp_loss: float | None) -> list[dict]:
    extra = {"runs": 1}
    return [
        quality.row("data-parallel (gloo)", 100, dp_loss, dp_loss, extra),  # type: ignore[arg-type]
        quality.row("DiLoCo tau=2", 100, 1.7, dp_loss, extra),
    ]


def test_rows_without_a_baseline_have_no_gap_and_still_plot(tmp_path: Path) -> None:
    rows = _rows(None)
    assert rows[1]["vs DP"] is None
    quality.plot(rows, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 0


def test_rows_with_a_baseline_carry_the_gap(tmp_path: Path) -> None:
    rows = _rows(1.6)
    assert abs(rows[1]["vs DP"] - 0.0625) < 1e-9
    quality.plot(rows, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 0


def _fake_job(monkeypatch: pytest.MonkeyPatch, final: bool) -> None:
    """run_ddp's seam (the real torchrun job runs in tests/integration/test_ddp_baseline.py): a job
    that exits 1 after (or before) writing its final model, as a gloo teardown abort did."""
    from bench import ddp_baseline, evaluate

    def run_ddp(settings: dict, workers: int, out: Path, **_: object) -> dict:
        out.mkdir(parents=True)
        (out / "checkpoint.pt").write_bytes(b"model")
        events = [{"event": "start", "time": 1.0}]
        if final:
            events.append({"event": "final", "time": 11.0, "compute_s": 40.0, "tokens": 1000})
        (out / "progress.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        return {"ok": False, "returncode": 1, "timed_out": False}

    monkeypatch.setattr(ddp_baseline, "run_ddp", run_ddp)
    monkeypatch.setattr(evaluate, "eval_file", lambda path, settings: 1.5)


@pytest.mark.parametrize("final", [True, False])
def test_a_dp_job_that_died_after_its_final_model_is_measured(monkeypatch: pytest.MonkeyPatch, final: bool) -> None:
    from bench import dprun

    _fake_job(monkeypatch, final)
    res = dprun.run_dp({"name": "dp"}, 4)
    if final:
        assert res["ok"] and res["teardown_exit"] == 1 and res["eval_loss_shared"] == 1.5
        assert res["train_window_s"] == 10.0
    else:
        assert not res["ok"] and res["eval_loss_shared"] is None and "log_tail" in res


def test_run_overrides_are_typed_and_bad_ones_name_the_item() -> None:
    from bench.common import overrides

    assert overrides("H=64,outer_lr=0.7,rebase=true") == {"H": 64, "outer_lr": 0.7, "rebase": True}
    for bad, says in (("nosuchkey=1", "'nosuchkey=1'"), ("H", "'H'"), ("H=sixty", "takes a int")):
        with pytest.raises(SystemExit, match=says):
            overrides(bad)


def test_chaos_only_plans_the_monkey_run_alone_and_judges_it_on_its_own() -> None:
    args = quality.common.parse_args("quality", "", quality._extra, ["--chaos-only", "--H", "16"])
    todo = quality.plans(args, steps=100)
    assert [name for name, _ in todo] == [f"{quality.DEFAULTS_NAME} + chaos monkey"]
    assert todo[0][1].chaos is not None and todo[0][1].run["H"] == 16 and todo[0][1].budget_tokens
    rows = [
        quality.row("data-parallel (gloo)", 100, 1.6, 1.6, {}),
        quality.row(f"{quality.DEFAULTS_NAME} + chaos monkey", 100, 1.7, 1.6, {}),
    ]
    assert quality.chaos_verdict(rows)["chaos_met"] is False  # +6.25%
    rows[1] = quality.row(f"{quality.DEFAULTS_NAME} + chaos monkey", 100, 1.65, 1.6, {})
    assert quality.chaos_verdict(rows) == {"chaos_met": True, "text": "chaos monkey: +3.1% vs DP (target <= +5%: MET)"}


def test_a_repeated_set_keeps_every_occurrence_and_the_later_key_wins() -> None:
    from bench import loadgen
    from bench.common import overrides, parse_args

    argv = ["--set", "checkpoint_every=1000000", "--set", "checkpoint_s=0,H=32", "--set", "H=16"]
    args = parse_args("loadgen", "", loadgen._extra, argv)
    assert overrides(args.set) == {"checkpoint_every": 1000000, "checkpoint_s": 0.0, "H": 16}
    # a default stays unless a --set names its key
    q = parse_args("quality", "", quality._extra, ["--set", "H=16"])
    assert overrides(q.set) == {"lr_schedule": "cosine", "H": 16}
    assert overrides(parse_args("quality", "", quality._extra, []).set) == {"lr_schedule": "cosine"}
