"""Who may join the run and what they bring: hello checks and the init upload.

A part of the core (syncer/core.py composes it). A hello is refused for good when it names
another run, cannot decode the run's updates (its `codecs`), or its model does not match the
run's (fragment count, parameter names and shapes, enough tensors), or the model would not fit in
the memory this host has free before anything is allocated. While no global model exists, the
first learner to arrive (or the next, if the first went away) uploads it chunk by chunk
(syncer/upload.py). Pure: `now` and the model are passed in.
"""

from __future__ import annotations

import torch

from syncer.common import memfit
from syncer.fleet import Ledger
from syncer.globalmodel import GlobalModel
from syncer.upload import InitUpload
from syncer.wire import fragments, shards
from syncer.wire.protocol import Message, ProtocolError, check_raw_fragment


class Admission:
    """The run's identity check, the manifest check, the memory check, and the init upload."""

    def __init__(self, run_id: str, fragments_count: int, compression: str = "int4") -> None:
        self.run_id = run_id
        self.compression = compression  # what the updates are coded in: every learner must decode it
        self.fragments = fragments_count
        self.upload = InitUpload()  # the first upload of the global model, while no model exists
        self.memory_free: tuple[int, str] | None = None  # bytes free here, which limit (the shell: at hellos)

    def check(
        self, msg: Message, model: GlobalModel | None, shard: int, count: int
    ) -> tuple[list[fragments.TensorSpec], tuple[str, str] | None]:
        """The hello's manifest and why it is refused ((reason, detail); None: welcome). This
        process is shard `shard` of `count`. A manifest that does not parse is a ProtocolError."""
        if msg["run"] != self.run_id:
            return [], ("wrong_run", f"this syncer serves run {self.run_id}, not {msg['run']}")
        try:
            manifest = fragments.manifest_from_json(msg["manifest"])
        except ValueError as exc:
            raise ProtocolError("schema", f"hello: {exc}") from None
        if self.compression not in msg["codecs"]:
            decodes = ", ".join(map(str, msg["codecs"])) or "nothing"
            detail = f"this run's updates are {self.compression}; the learner decodes only {decodes}"
            return [], ("codec", f"{detail}: run the same dldctl version on its host")
        problem = self._manifest_problem(manifest, msg["fragments"], model, shard, count)
        return manifest, ("manifest", problem) if problem else None

    def _manifest_problem(
        self, manifest: list[fragments.TensorSpec], count: int, model: GlobalModel | None, shard: int, shard_count: int
    ) -> str | None:
        if count != self.fragments:
            return f"learner cuts the model into {count} fragments, the run uses {self.fragments}"
        reference = model.manifest if model else self.upload.manifest
        if reference is not None and manifest != reference:
            return "learner's model has different parameter names/shapes than the run's global model"
        if len(manifest) < count:
            return f"model has {len(manifest)} parameter tensors, fewer than fragments={count}"
        if model is None and self.memory_free is not None:  # nothing allocated yet: will it fit here?
            n = sum(shards.shard_plan(manifest, count, shard, shard_count).sizes())
            name = f"syncer shard {shard}" if shard_count > 1 else "the syncer"
            return memfit.floor_problem(n, *self.memory_free, name)
        return None

    def may_upload(self, learner: str, fleet: Ledger, liveness_s: float, now: float) -> bool:
        """Whether `learner` takes the init upload (while no model exists): no other live owner."""
        owner = fleet.learners.get(self.upload.owner or "")
        return owner is None or owner.id == learner or not owner.live(now, liveness_s)

    def start_upload(self, learner: str, manifest: list[fragments.TensorSpec], sizes: list[int]) -> None:
        self.upload.start(learner, manifest, sizes)

    def chunk(self, learner: str, msg: Message, model: GlobalModel | None) -> bool | None:
        """Write one chunk of the init upload: None if `learner` may not (not the owner, or a model
        exists), True once the upload is complete (`take` it)."""
        up = self.upload
        if model is not None or learner != up.owner or up.manifest is None:
            return None
        values = check_raw_fragment(msg, up.sizes())  # read-only, a view of the received frame
        return up.add(msg["fragment"], msg["offset"], values)

    def take(self) -> tuple[list[fragments.TensorSpec], list[torch.Tensor]]:
        """The complete upload: its manifest and buffers (the upload lets go of them)."""
        assert self.upload.manifest is not None
        return self.upload.manifest, self.upload.take()
