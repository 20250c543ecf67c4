"""CLI: `dldctl export [RUN]` — the run's global model as safetensors + config.json, or with
`--format hf` as a directory transformers' `from_pretrained` loads, verified (docs/model.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from dldctl import rundir
from dldctl.commands import complete
from dldctl.commands.options import output_console
from dldctl.errors import UsageError
from dldctl.lifecycle import export as export_mod
from dldctl.lifecycle import hfexport
from syncer.common import strictjson

console = output_console()
FORMATS = ("safetensors", "hf")


def export(
    run: str | None = typer.Argument(
        None,
        help="Run directory or run name, down or live (default: the most recent live run, else the most recent run).",
        autocompletion=complete.run_names,
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Write the files here (default: <run>/export, with --format hf <run>/export-hf)."
    ),
    fmt: str = typer.Option(
        "safetensors",
        "--format",
        metavar="|".join(FORMATS),
        help="safetensors: model.safetensors + config.json (named_parameters() names); "
        "hf: a transformers from_pretrained directory (needs the hf extra).",
    ),
    no_verify: bool = typer.Option(
        False, "--no-verify", help="--format hf: do not load it back and score it on the held-out batches."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print a dldctl.export/1 JSON document."),
) -> None:
    """Write the run's final global model in a format others load.

    From the export `down` wrote, else final_model.pt, else the newest valid checkpoint (torch
    needed to convert those two); the output says which. With --format hf: the built-in GPT
    presets as GPT2LMHeadModel, an `hf:` model as its own class with its tokenizer; loaded back
    with AutoModelForCausalLM and scored on the run's held-out batches (it fails if that is not
    the run's own held-out loss).

    Without RUN: the most recent live run, else the most recent run, as `status` takes.

    Example: dldctl export default --format hf --out ./model
    """
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}: use safetensors or hf")
    if no_verify and fmt != "hf":
        raise UsageError("--no-verify is for --format hf (the safetensors export is not converted, nor verified)")
    where = rundir.resolve(run, live_only=False)
    if fmt == "hf":
        progress = output_console(stderr=True)
        say = (lambda line: progress.print(f"{line}…", style="dim", markup=False)) if progress.is_terminal else None
        doc = hfexport.export_hf(where, out, verify=not no_verify, progress=say)
    else:
        if out is not None and (out.expanduser() / hfexport.PROVENANCE).is_file():  # its names would break it
            raise UsageError(
                f"--out {out} holds an hf export", hint="write the safetensors export to another directory"
            )
        doc = {"format": "safetensors", **export_mod.export(where, out)}
    if json_out:
        print(strictjson.dumps(doc))
    else:
        _print(doc)


def _print(doc: dict[str, Any]) -> None:
    """The export, for a person: where it came from, the files, and (hf) what verification measured."""
    loss, hf = doc.get("held_out_loss"), doc["format"] == "hf"
    console.print(f"run {doc['run']}: model from {doc['source']}", markup=False)
    if hf:
        console.print(f"  dir      {doc['dir']}  ({doc['class']}, from_pretrained)", markup=False)
    console.print(f"  weights  {doc['weights']}", markup=False)
    console.print(f"  config   {doc['config']}", markup=False)
    console.print(
        f"  {doc.get('model')}, {doc.get('params')} parameters, outer step {doc.get('outer_step')}, "
        f"held-out loss {'unknown' if loss is None else f'{loss:.4f}'}",
        markup=False,
    )
    if hf:
        console.print(_verification(doc), markup=False)


def _verification(doc: dict[str, Any]) -> str:
    """The verification's line: what the directory, loaded back, scored next to the run's loss."""
    if doc["verification"] == "off":
        return "  not verified (--no-verify)"
    if doc["verification"] == "skipped":
        return f"  not verified: {doc['why']}"
    line = f"  verified: from_pretrained scores {doc['verified_loss']:.6f} on {doc['eval_batches']} held-out batches"
    if doc.get("loss_diff") is not None:
        return line + f" (the run reported {doc['held_out_loss']:.6f}, difference {doc['loss_diff']:+.2e})"
    return line + f" (the run reported none; the same tensors in dldctl: {doc['reference_loss']:.6f})"
