"""CLI: `dldctl export RUN` — the run's global model as safetensors + config.json (docs/model.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from dldctl import rundir
from dldctl.commands.options import output_console
from dldctl.lifecycle import export as export_mod
from syncer.common import strictjson

console = output_console()


def export(
    run: str = typer.Argument(..., help="Run directory or run name (a run that is down, or live)."),
    out: Path | None = typer.Option(None, "--out", help="Write the files here (default: <run>/export)."),
    json_out: bool = typer.Option(False, "--json", help="Print a dldctl.export/1 JSON document."),
) -> None:
    """Write the run's final global model as model.safetensors + config.json others can load.

    From the export `down` wrote, else final_model.pt, else the newest valid checkpoint (torch
    needed to convert those two); the output says which.

    Example: dldctl export default --out ./model
    """
    doc = export_mod.export(rundir.resolve(run, live_only=False), out)
    if json_out:
        print(strictjson.dumps(doc))
        return
    loss = doc.get("held_out_loss")
    console.print(f"run {doc['run']}: model from {doc['source']}", markup=False)
    console.print(f"  weights  {doc['weights']}", markup=False)
    console.print(f"  config   {doc['config']}", markup=False)
    console.print(
        f"  {doc.get('model')}, {doc.get('params')} parameters, outer step {doc.get('outer_step')}, "
        f"held-out loss {'unknown' if loss is None else f'{loss:.4f}'}",
    )
