"""Serving the global state to learners that fetch it (a join, a rejoin, a resync), in chunks.

Pure (no sockets): `StateServing.chunk` answers one `state_req` with a `state` message. A fetch
asks for a fragment chunk by chunk while merges go on; the first chunk names the version and the
rest ask for that one, so the version about to be replaced is kept while a transfer of it is
under way (`keep_previous`) and a transfer stays consistent. Values go out without a copy: a
lent value is never written again (GlobalModel.lend). The crc32 of each version is computed once,
when first needed (updates carry it every `checksum_every` versions; a transfer needs it always).
"""

from __future__ import annotations

from typing import Any

import torch

from syncer.globalmodel import GlobalModel
from syncer.wire.protocol import Message, ProtocolError, check_fragment_index

TRANSFER_S = 30.0  # a transfer with a chunk served this recently is under way


class StateServing:
    def __init__(self, chunk_mb: float) -> None:
        self.chunk_numel = max(1024, int(chunk_mb * (1 << 20)) // 4)
        self.crcs: dict[int, int | None] = {}  # None: not computed for this version (`crc`)
        self.previous: dict[int, tuple[int, torch.Tensor, int]] = {}
        self.fetching: dict[int, dict[str, float]] = {}  # fragment -> learner -> last chunk of a transfer under way

    def crc(self, model: GlobalModel, p: int) -> int:
        """crc32 of fragment p's current version, computed once per version when first needed."""
        crc = self.crcs.get(p)
        if crc is None:
            crc = self.crcs[p] = model.crc(p)
        return crc

    def known(self, model: GlobalModel | None) -> list[int | None]:
        """The crc32 of each fragment's current version where known (never computed here: a
        status request must not cost a pass over the model); None where not computed."""
        return [self.crcs.get(p) for p in range(model.plan.count)] if model else []

    def chunk(self, model: GlobalModel, learner: str, msg: Message, now: float, epoch: int) -> Message:
        """The `state` message that answers a `state_req` (ProtocolError if it is malformed)."""
        p = check_fragment_index(msg, model.plan.count)
        total = model.theta[p].numel()
        offset = msg["offset"]
        if not 0 <= offset < total:
            raise ProtocolError("shape", f"state_req: offset {offset} outside fragment {p}")
        n = min(self.chunk_numel, total - offset)
        fetching = self.fetching.setdefault(p, {})
        if offset + n < total:
            fetching[learner] = now
        else:  # its last chunk: the transfer is done (a fetch asks in order; a retry starts it again)
            fetching.pop(learner, None)
        version, value, crc = self._version_of(model, p, msg.get("version"))
        # zero-copy: a view of a value never written again (GlobalModel.lend, `keep_previous`)
        payload = value[offset : offset + n].numpy().data.cast("B")
        meta = {"fragment": p, "version": version, "offset": offset, "numel": n, "total": total}
        return Message("state", {**meta, "epoch": epoch, "crc": crc}, [payload])

    def _version_of(self, model: GlobalModel, p: int, wanted: Any) -> tuple[int, torch.Tensor, int]:
        """The version a fetch asked for, if still kept (the current and the previous one), so a
        multi-chunk transfer stays consistent while merges go on; else the current one. Either
        value is lent (never written again): its chunks go out without a copy."""
        current = model.versions[p]
        previous = self.previous.get(p)
        if isinstance(wanted, int) and wanted != current and previous is not None and previous[0] == wanted:
            return previous
        return current, model.lend(p), self.crc(model, p)

    def keep_previous(self, model: GlobalModel, p: int, now: float) -> None:
        """Before a merge of p: while a state transfer of p is under way (a chunk served in the
        last TRANSFER_S and its last chunk not yet), keep the version about to be replaced, so the
        transfer can finish on it: the value itself, lent, so the merge writes into a copy
        (`GlobalModel.writable`), one per merge. A finished transfer costs the merges nothing (they
        copied a fragment for 30 s after every join: a quarter of a gpt2-124m round)."""
        if any(now - t < TRANSFER_S for t in self.fetching.get(p, {}).values()):
            self.previous[p] = (model.versions[p], model.lend(p), self.crc(model, p))
        else:
            self.previous.pop(p, None)

    def clear(self) -> None:
        """Forget the kept crcs and previous versions (the global model was replaced)."""
        self.crcs.clear()
        self.previous.clear()
