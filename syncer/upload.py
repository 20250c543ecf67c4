"""The first upload of the global model: one learner's chunks filling the syncer's buffers.

The first learner to say hello (or the next, if it went away) owns the upload (SyncerCore's
`_claim_init`). A chunk sent twice (again after a reconnect) counts once: what is covered is
kept per value, so the upload is complete when every value was written, not when enough bytes
arrived. Pure: tensors in, tensors out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from syncer.wire import fragments


@dataclass
class InitUpload:
    """The upload under way: its owner, the model it describes and the buffers it fills."""

    owner: str | None = None
    manifest: list[fragments.TensorSpec] | None = None
    buffers: list[torch.Tensor] = field(default_factory=list)
    filled: list[torch.Tensor] = field(default_factory=list)
    missing: int = 0  # values not covered yet

    def start(self, owner: str, manifest: list[fragments.TensorSpec], sizes: list[int]) -> None:
        self.owner, self.manifest = owner, manifest
        self.buffers = [torch.zeros(n, dtype=torch.float32) for n in sizes]
        self.filled = [torch.zeros(n, dtype=torch.bool) for n in sizes]
        self.missing = sum(sizes)

    def sizes(self) -> list[int]:
        return [b.numel() for b in self.buffers]

    def add(self, p: int, offset: int, values: np.ndarray) -> bool:
        """Write one checked chunk (a view of the received frame: the one copy); True once every
        value of the model is covered. O(chunk), never a scan of the whole model per chunk
        (quadratic: a 350M upload never ended)."""
        self.buffers[p].numpy()[offset : offset + values.size] = values
        covered = self.filled[p][offset : offset + values.size]
        self.missing -= values.size - int(covered.sum())
        covered.fill_(True)
        return self.missing == 0

    def take(self) -> list[torch.Tensor]:
        """The complete buffers (the upload lets go of them)."""
        buffers, self.buffers, self.filled = self.buffers, [], []
        return buffers
