"""`dldctl check` and `up --dry-run` check the data on every host before anything starts: a
built-in preset whose `[run] data` is on disk is probed (the default, on the built-in corpus, is
not: it must stay fast), a probe's failure that names the data's file is a "data" problem with its
own fix, and the probe run on this machine against a truncated token file names the file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dldctl import inventory
from dldctl.hosts import LocalHost
from dldctl.lifecycle import modelprobe
from workload import probe

ROOT = Path(__file__).resolve().parents[2]


def load(tmp_path: Path, run: str) -> inventory.Inventory:
    path = tmp_path / "inv.toml"
    path.write_text(f'[run]\n{run}\nfragments = 2\nH = 8\n\n[[hosts]]\nname = "a"\naddress = "local"\nlearners = 2\n')
    return inventory.load(path)


def truncated(tmp_path: Path) -> Path:
    """A token file cut mid-token: 3 bytes of uint16 ids (workload/data.py refuses an odd size)."""
    path = tmp_path / "x.bin"
    path.write_bytes(b"\x01\x00\x02")
    return path


def test_the_builtin_default_is_not_probed_and_data_on_disk_is(tmp_path: Path) -> None:
    truncated(tmp_path)
    assert not modelprobe.needed(load(tmp_path, 'model = "gpt-tiny"'))
    assert modelprobe.before_run(load(tmp_path, 'model = "gpt-tiny"')) == ([], [])  # nothing started
    on_disk = load(tmp_path, 'model = "gpt-tiny"\ndata = "x.bin"')
    assert on_disk.run.data == str(tmp_path / "x.bin")  # made absolute from the inventory's directory
    assert modelprobe.needed(on_disk) and modelprobe.data_on_disk(on_disk)
    (tmp_path / "tokenizer.json").write_text("{}")
    tokenized = load(tmp_path, 'model = "gpt-tiny"\ntokenizer = "tokenizer.json"')
    assert modelprobe.needed(tokenized)  # the built-in corpus through a tokenizer: that file must load
    assert modelprobe.needed(load(tmp_path, 'model = "pkg.mod:factory"'))  # as before: a factory always


def test_data_on_disk_probes_each_learner_host_and_the_syncers(tmp_path: Path) -> None:
    truncated(tmp_path)
    inv = load(tmp_path, 'model = "gpt-tiny"\ndata = "x.bin"')
    targets, skipped = modelprobe.targets_unstarted(inv, None)
    assert skipped == [] and [(t.host, t.roles) for t in targets] == [("a", ("learner", "syncer"))]
    unscored = load(tmp_path, 'model = "gpt-tiny"\ndata = "x.bin"\nglobal_eval_every = 0')
    targets, _ = modelprobe.targets_unstarted(unscored, None)
    assert [(t.host, t.roles) for t in targets] == [("a", ("learner",))]


def test_a_failure_naming_the_data_is_the_datas() -> None:
    settings = {"data": "/d/tokens", "tokenizer": "~/tok.json"}
    assert probe.about_data(ValueError("data '/d/tokens/part-3.bin': odd size"), settings)
    assert probe.about_data(FileNotFoundError(2, "No such file", str(Path.home() / "tok.json")), settings)
    assert not probe.about_data(RuntimeError("CUDA out of memory"), settings)
    assert probe.data_paths({"data": "builtin", "tokenizer": ""}) == []


def answer(host: str, **data: object) -> modelprobe.Answer:
    target = modelprobe.Target(host, ("learner",), "py", "", None, lambda: LocalHost(host))
    return modelprobe.Answer(target, dict(data))


def test_judge_gives_a_data_problem_its_own_fix_and_words() -> None:
    failed = answer("b", ok=False, stage="data", error="ValueError: data '/d/x.bin': odd size")
    (line,) = modelprobe.judge([failed], 2)
    assert line == f"host b (learner): ValueError: data '/d/x.bin': odd size; {modelprobe.FIX['data']}"
    assert modelprobe.refusal(line) == "the data does not load"
    scorer = modelprobe.Target("local", ("syncer",), "py", "", None, lambda: LocalHost("local"))
    (line,) = modelprobe.judge([modelprobe.Answer(scorer, failed.data)], 2)
    assert "global_eval_every = 0" in line and modelprobe.refusal(line) == "the data does not load"
    built = answer("b", ok=False, stage="build", error="ValueError: boom")
    assert modelprobe.refusal(modelprobe.judge([built], 2)[0]) == "the model does not build"


def run_probe(data: Path, tmp_path: Path) -> dict:
    """`python -m workload.probe` on this machine, as `check` runs it on a learner host."""
    settings = {"model": "gpt-tiny", "data": str(data), "seq_len": 32, "batch_size": 4, "eval_batches": 1}
    out = subprocess.run(
        [sys.executable, "-m", "workload.probe"],
        input=json.dumps({"settings": settings, "shards": 2, "role": "learner"}),
        env={"PYTHONPATH": str(ROOT), "DLDCTL_CACHE": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        check=True,
        timeout=100,
    )
    said: dict = json.loads(out.stdout.strip().splitlines()[-1])
    return said


@pytest.mark.timeout(120)
def test_the_probe_on_this_machine_names_a_truncated_token_file(tmp_path: Path) -> None:
    bad = truncated(tmp_path)
    said = run_probe(bad, tmp_path)
    assert said["ok"] is False and said["stage"] == "data", said
    assert str(bad) in said["error"]
    text = tmp_path / "notes.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    said = run_probe(text, tmp_path)
    assert said["ok"] is True and "loss" not in said, said  # a preset: its data is loaded, its loss not run


@pytest.mark.timeout(120)
def test_check_names_the_host_and_the_file_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLDCTL_CACHE", str(tmp_path / "cache"))
    bad = truncated(tmp_path)
    answers, problems = modelprobe.before_run(load(tmp_path, 'model = "gpt-tiny"\ndata = "x.bin"\nseq_len = 32'))
    assert [a.data.get("stage") for a in answers] == ["data"], [a.data for a in answers]
    (line,) = problems
    assert line.startswith("host a (learner and syncer): ") and str(bad) in line


def test_a_venv_host_gets_the_readers_its_data_needs() -> None:
    from dldctl.lifecycle.provision import data_deps

    assert data_deps("gpt-tiny", "builtin", "") == ()
    assert data_deps("gpt-tiny", "corpus.txt", "tokenizer.json") == ("tokenizers>=0.20",)
    assert data_deps("gpt-tiny", "shards/train.parquet#text", "") == ("pyarrow>=14",)
    assert data_deps("hf:./m", "c.parquet", "t.json") == ("transformers>=4.46", "tokenizers>=0.20", "pyarrow>=14")


def test_this_machine_needs_the_data_extra_only_when_its_processes_read_such_data(tmp_path: Path) -> None:
    from dldctl import extras

    assert extras.data_modules(load(tmp_path, 'data = "builtin"')) == []
    wanted = extras.data_modules(load(tmp_path, 'data = "corpus.parquet#body"\ntokenizer = "tok.json"'))
    assert wanted == [("tokenizers", "tokenizer"), ("pyarrow", "data")]
    assert extras.fix("pyarrow") == "pip install 'dldctl[data]'"
