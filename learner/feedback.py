"""Error feedback: what a thin codec did not carry of a learner's pushes, added to its next ones.

The codecs below int4 (syncer/wire/thin.py: 2bit, topk) drop most of an outer gradient: top-k
sends 1.6% of its values. What they drop is kept here, per fragment, and added to that
fragment's next outer gradient before it is coded, so nothing a learner trained is lost, only
delayed (EF-SGD; SparseLoCo and MuLoCo keep the same residual). The residual is committed only
when the push has left (`commit` after the socket took it; `discard` when it could not leave and
goes back to the queue, to be coded again with the same residual), so a push is never counted
twice. The older modes (int4 and up) lose little and keep no residual.

A restarted learner starts with none: the residual is progress of a trajectory the restart
abandoned (the learner starts over from the global model), as the unsent steps of a crash are;
it is at most what the codec left out of the last pushes. Owned by the link's sender thread
(learner/client.py): no lock.
"""

from __future__ import annotations

import torch

from syncer.wire import codec, quant


class ErrorFeedback:
    """Per fragment, what the pushes that left did not carry (fp32 CPU, the fragment's size)."""

    def __init__(self) -> None:
        self.residual: dict[int, torch.Tensor] = {}
        self._pending: tuple[int, torch.Tensor] | None = None

    def encode(self, p: int, values: torch.Tensor, mode: str, block: int, zstd: bool) -> bytes:
        """The blob of fragment p's outer gradient `values` (a thin mode: plus its residual), the
        new residual held until `commit`."""
        self._pending = None
        if mode not in quant.THIN:
            return codec.encode(values, mode, block, zstd)
        carried = self.residual.get(p)
        x = values + carried if carried is not None and carried.numel() == values.numel() else values.clone()
        q, sent = quant.quantize_roundtrip(x, mode, block)
        blob = codec.encode_quantized(q, zstd)
        self._pending = (p, x.sub_(sent))
        return blob

    def commit(self) -> None:
        """The push just coded has left: its residual is the fragment's now."""
        if self._pending is not None:
            p, rest = self._pending
            self.residual[p] = rest
            self._pending = None

    def discard(self) -> None:
        """The push just coded did not leave: it is coded again later, from the old residual."""
        self._pending = None

    def carried(self) -> float:
        """The residual's total squared norm (a health figure: bounded under error feedback)."""
        return sum(float(r.square().sum()) for r in self.residual.values())
