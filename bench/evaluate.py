"""One evaluation for every strategy: the eval loss of a final model on the learners' held-out batches.

Decoupled and synchronous DiLoCo leave `final_model.pt` (`{"state_dict": {name: tensor}}`, the
syncer's global parameters, without `lm_head.weight`, which is tied to the token embedding); the
data-parallel baseline leaves `checkpoint.pt` (`{"model": state_dict, ...}`). Both are loaded into
the same freshly built model (`workload.build_workload` with the run's settings, which
also yields the learners' fixed, evenly spaced held-out `eval_batches`) and scored by the same
function, in eval mode, on one CPU thread:

    eval_loss = mean over the eval batches of the next-token cross-entropy
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from syncer.common.settings import settings_from_dict
from workload import Workload, build_workload, scoring_context

TIED = {"lm_head.weight"}  # the GPT's LM head is the token embedding (weight tying)


def workload(settings: dict[str, Any]) -> Workload:
    """The learners' workload for these run settings (shard 0; the eval slice is the same for all)."""
    full = settings_from_dict({k: v for k, v in settings.items() if k != "name"}).to_dict()
    return build_workload(scoring_context(full))


def load_state_dict(path: Path | str) -> dict[str, torch.Tensor]:
    """The parameters in a `final_model.pt` (DiLoCo) or a DP `checkpoint.pt`."""
    doc = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model"):
        if isinstance(doc, dict) and isinstance(doc.get(key), dict):
            return doc[key]
    raise ValueError(f"{path}: neither a final_model.pt nor a DP checkpoint (keys {sorted(doc)[:8]})")


@torch.no_grad()
def eval_loss(state_dict: dict[str, torch.Tensor], settings: dict[str, Any], wl: Workload | None = None) -> float:
    """Mean loss of these parameters over the held-out eval batches of `settings`."""
    torch.set_num_threads(1)
    wl = wl or workload(settings)
    missing, unexpected = wl.model.load_state_dict(state_dict, strict=False)
    if set(missing) - TIED or unexpected:
        raise ValueError(f"state dict does not fit {settings['model']}: missing {missing}, unexpected {unexpected}")
    wl.model.eval()
    losses = [float(wl.loss(wl.model, batch)) for batch in wl.eval_batches]
    return sum(losses) / len(losses)


def eval_file(path: Path | str, settings: dict[str, Any]) -> float:
    """eval_loss of the model saved at `path`."""
    return eval_loss(load_state_dict(path), settings)


def relative_gap(value: float | None, reference: float | None) -> float | None:
    """(value - reference) / reference: 0.03 means 3% worse than the reference."""
    if value is None or reference is None or reference == 0:
        return None
    return (value - reference) / reference
