"""`dldctl export RUN --format hf`: the run's model as a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads, checked by loading it back.

    <run>/export/          the safetensors export (dldctl/lifecycle/export.py: the one `down` wrote,
                           else final_model.pt, else the newest checkpoint, converted), made first
    <out>/                 default <run>/export-hf
      config.json, model.safetensors, generation_config.json     save_pretrained
      tokenizer.json, tokenizer_config.json, ...                 an `hf:` model's, from the run's model dir
      dldctl_export.json   where it came from and what verification measured (PROVENANCE_SCHEMA)
      README.md            how to load it

The conversion needs torch, transformers and the workload's code, which dldctl never imports
(tests/unit/test_layering.py), so it runs `python -m workload.hfexport` as a process (as dldctl
runs the learners and the syncer), in the run directory (where the syncer resolved a relative
`data` path), and reads the one JSON line it prints. It writes into a staging directory beside
`out`; only a verified result (or an unverified one, when asked or when the data is elsewhere)
replaces `out`. `judge` (pure) decides: the directory, loaded back, must score the run's own
held-out loss to REL_TOL (the target, met in the tests, is 1e-4).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dldctl import extras, modelspec
from dldctl.errors import OperationError, UsageError
from dldctl.lifecycle import export as export_mod
from dldctl.rundir import RunDir
from syncer.common import modelexport, strictjson
from syncer.common.atomic import atomic_write

HF_DIR = "export-hf"  # the default --out, in the run directory
PROVENANCE = "dldctl_export.json"
PROVENANCE_SCHEMA = "dldctl.hf-export/1"
WORKER_SCHEMA = "dldctl.hfexport/1"  # workload/hfexport.py SCHEMA: its result line
REL_TOL = 1e-3  # loaded back, it scores this far from the run's loss: the weights or the mapping are wrong
NEEDS = ("torch", "transformers")
ROOT = Path(__file__).resolve().parents[2]  # where dldctl (and workload beside it) was imported from
Progress = Callable[[str], None]


def refusal(run: str, spec: str) -> UsageError:
    """Why a user's own module has no `--format hf`, and what they have instead."""
    return UsageError(
        f"run {run}: model {spec!r} is your own module, and transformers has no class for it: "
        "there is no from_pretrained directory to write",
        hint=f"`dldctl export {run}` writes model.safetensors named as its named_parameters() for "
        "load_state_dict; if your factory builds a transformers PreTrainedModel, train it as "
        'model = "hf:DIR" instead',
    )


def require(run: str) -> None:
    """UsageError (exit 2) with the one pip command, unless this Python has torch and transformers."""
    missing = [m for m in NEEDS if not extras.installed(m)]
    if missing:
        wanted = ",".join(dict.fromkeys(extras.EXTRAS[m] for m in missing))
        raise UsageError(
            f"`dldctl export {run} --format hf` needs {' and '.join(missing)}, "
            f"and this Python ({sys.executable}) has none",
            hint=f"pip install 'dldctl[{wanted}]'",
        )


def judge(result: dict[str, Any], held_out_loss: float | None) -> tuple[str | None, float | None]:
    """(the problem, or None; verified - reported loss). Pure. The reported loss is the syncer's
    score of these weights; the reference is the worker's rescoring of them in the workload's own
    model, so a run that reported none is still checked."""
    if result.get("verification") != "done":
        return None, None
    verified, reference = result.get("verified_loss"), result.get("reference_loss")
    if not isinstance(verified, (int, float)) or not math.isfinite(verified):
        return "loaded back, it scores no finite held-out loss", None
    diff = None if held_out_loss is None else verified - held_out_loss
    for what, loss in (("the run's reported held-out loss", held_out_loss), ("the same tensors in dldctl", reference)):
        if loss is None:
            continue
        if not isinstance(loss, (int, float)) or abs(verified - loss) > REL_TOL * max(abs(loss), 1e-12):
            return f"loaded back, it scores {verified:.6f} on the held-out batches, {what} is {loss}", diff
    return None, diff


def export_hf(
    run: RunDir, out: Path | None = None, *, verify: bool = True, progress: Progress | None = None
) -> dict[str, Any]:
    """Write `out` (default <run>/export-hf); the dldctl.export/1 document with format "hf"."""
    say = progress or (lambda _line: None)
    cfg = run.read_config()
    if modelspec.kind(cfg.run.model) == "factory":
        raise refusal(run.name, cfg.run.model)
    dest = (out or run.path / HF_DIR).expanduser().resolve()
    _check_dest(run, dest)
    require(run.name)
    say(f"reading the trained tensors (the safetensors export, {run.path / modelexport.EXPORT_DIR})")
    base = export_mod.export(run)  # <run>/export, made or reused: its tensors and where they came from
    staging = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    try:
        _clear(staging)
        result = _run_worker(
            run, Path(base["weights"]), staging, verify, lambda line: say(line.replace(str(staging), str(dest)))
        )
        problem, diff = judge(result, base.get("held_out_loss"))
        doc = _document(run, dest, base, result, diff)
        if problem:
            raise OperationError(
                f"run {run.name}: the hf export is wrong: {problem} "
                f"(the weights or the mapping are wrong; nothing written to {dest})",
                hint=f"report it with the run's config.json; `dldctl export {run.name}` (safetensors) is unaffected",
            )
        _finish(staging, doc, cfg.run.data)
        _replace(staging, dest)
    finally:
        _clear(staging)
    return doc


def _check_dest(run: RunDir, dest: Path) -> None:
    """`dest` may be new, empty, or an earlier hf export (replaced whole); nothing else is overwritten."""
    if dest == (run.path / modelexport.EXPORT_DIR).resolve():
        raise UsageError(f"--out {dest} is the run's safetensors export", hint=f"leave --out out: {run.path / HF_DIR}")
    if not dest.exists():
        return
    if not dest.is_dir() or (any(dest.iterdir()) and not (dest / PROVENANCE).is_file()):
        raise UsageError(
            f"--out {dest} exists and is not an hf export dldctl wrote", hint="name a new or empty directory"
        )


def _run_worker(run: RunDir, weights: Path, out: Path, verify: bool, say: Progress) -> dict[str, Any]:
    """`python -m workload.hfexport` in the run directory; its result (ok), or the error it reported."""
    # -P: the run directory (the cwd) stays off the import path: the workload imported is this dldctl's
    argv = [sys.executable, "-P", "-m", "workload.hfexport", "--weights", str(weights), "--run-config", str(run.config)]
    argv += ["--out", str(out)] + ([] if verify else ["--no-verify"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    if (ROOT / "workload" / "__init__.py").is_file():  # the workload next to this dldctl, from any cwd
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    result: dict[str, Any] | None = None
    tail: list[str] = []
    with subprocess.Popen(
        argv,
        cwd=run.path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("progress: "):
                say(line[len("progress: ") :].rstrip())
            elif (record := _result(line)) is not None:
                result = record
            elif line.strip():
                tail = [*tail[-19:], line.rstrip()]
    if result is None:
        last = tail[-1] if tail else "no output"
        raise OperationError(
            f"run {run.name}: the hf conversion exited {proc.returncode} without a result: {last}",
            hint=f"run it to see everything: cd {run.path} && {' '.join(argv[: -2 if verify else -3])} --out DIR",
        )
    if not result.get("ok"):
        error = UsageError if result.get("kind") == "usage" else OperationError
        raise error(f"run {run.name}: {result.get('error')}", hint=result.get("hint"))
    return result


def _result(line: str) -> dict[str, Any] | None:
    """The worker's result record, if `line` is it."""
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("schema") == WORKER_SCHEMA else None


def _document(
    run: RunDir, dest: Path, base: dict[str, Any], result: dict[str, Any], diff: float | None
) -> dict[str, Any]:
    """The dldctl.export/1 document of an hf export (the provenance file holds it too)."""
    weights = dest / "model.safetensors"
    index = dest / "model.safetensors.index.json"  # save_pretrained shards a model past its shard size
    cfg = run.read_config()
    return {
        "schema": export_mod.SCHEMA,
        "format": "hf",
        "run": run.name,
        "run_id": cfg.run_id,
        "source": base["source"],
        "dir": str(dest),
        "weights": str(index if index.name in result.get("files", []) else weights),
        "config": str(dest / "config.json"),
        "safetensors": base.get("dir"),  # the run's own safetensors export it was made from
        **{k: base.get(k) for k in ("model", "params", "outer_step", "tokens_merged", "held_out_loss")},
        "model_args": dict(cfg.model_args),
        "class": result.get("class"),
        "model_type": result.get("model_type"),
        "tokenizer": result.get("tokenizer"),
        "verification": result.get("verification"),  # "done" | "skipped" (why says why) | "off"
        "why": result.get("why"),
        "verified_loss": result.get("verified_loss"),
        "reference_loss": result.get("reference_loss"),
        "loss_diff": diff,
        "eval_batches": result.get("eval_batches"),
        "provenance": str(dest / PROVENANCE),
        "readme": str(dest / "README.md"),
    }


def _finish(staging: Path, doc: dict[str, Any], data: str) -> None:
    """The provenance record and the README, written into the staging directory. The record
    leaves out the paths of this machine (the directory may be copied anywhere)."""
    here = ("schema", "dir", "weights", "config", "provenance", "readme")
    record = {"schema": PROVENANCE_SCHEMA, **{k: v for k, v in doc.items() if k not in here}}
    record |= {"created": time.time(), "dldctl_version": modelexport.version()}
    try:
        atomic_write(staging / PROVENANCE, strictjson.dumps(record, indent=1) + "\n")
        atomic_write(staging / "README.md", readme(doc, data))
    except OSError as exc:
        raise OperationError(f"cannot write {staging}: {exc.strerror or exc}") from None


def readme(doc: dict[str, Any], data: str) -> str:
    """How to load the directory, and what it is (pure)."""
    lines = [
        f"# {doc['model']} from dldctl run {doc['run']}",
        "",
        f"Written by `dldctl export {doc['run']} --format hf` from {doc['source']}: outer step "
        f"{doc['outer_step']}, {doc['tokens_merged']} tokens merged. `{PROVENANCE}` records where it came from.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("path/to/this/directory")  # {doc["class"]}, float32',
    ]
    if doc.get("tokenizer"):
        lines += [
            "",
            "from transformers import AutoTokenizer",
            "",
            'tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory")',
        ]
    lines += ["```", ""]
    if modelspec.kind(str(doc["model"])) == "preset":
        lines += [*_vocabulary(data), ""]
    lines += [_verdict(doc), ""]
    return "\n".join(lines)


def _vocabulary(data: str) -> list[str]:
    """What a preset's token ids are: it ships no tokenizer (the run's data defines the vocabulary)."""
    if data.endswith(".bin"):
        return [
            f"There is no tokenizer here: the token ids are those of the run's data ({data}), "
            "tokenized by whatever prepared it (nanoGPT's prepare.py: GPT-2's BPE)."
        ]
    return [
        f"There is no tokenizer here: the run read its data ({data}) as bytes, so a token id is a byte value:",
        "`input_ids = torch.tensor([list(text.encode())])`, and `bytes(ids).decode(errors='replace')` back.",
    ]


def _verdict(doc: dict[str, Any]) -> str:
    """The verification, in one sentence."""
    if doc["verification"] == "skipped":
        return f"It was not verified: {doc['why']}."
    if doc["verification"] != "done":
        return "It was not verified (`--no-verify`)."
    reported = doc["held_out_loss"]
    said = "the run reported none" if reported is None else f"the run reported {reported:.6f} for these weights"
    return (
        f"Loaded back with `from_pretrained`, it scores a held-out loss of {doc['verified_loss']:.6f} on the run's "
        f"{doc['eval_batches']} held-out batches ({said}; the same tensors in dldctl's own model: "
        f"{doc['reference_loss']:.6f})."
    )


def _clear(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _replace(staging: Path, dest: Path) -> None:
    """Put the finished directory at `dest`; an earlier export there is moved aside, then removed
    (or put back if the move in fails)."""
    old = dest.parent / f".{dest.name}.old-{os.getpid()}"
    _clear(old)
    try:
        if dest.exists():
            dest.rename(old)
        staging.rename(dest)
    except OSError as exc:
        if old.exists() and not dest.exists():
            old.rename(dest)
        raise OperationError(f"cannot write the hf export to {dest}: {exc.strerror or exc}") from None
    _clear(old)
