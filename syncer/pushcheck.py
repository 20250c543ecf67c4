"""Whether a push may enter a round: its shape, its values, its sequence, its version.

A part of the core (syncer/core.py composes it). A push must carry one payload and sane counts
(else a ProtocolError), decode to finite values of the fragment's size (else it is rejected and
the learner refetches the fragment), come in sequence within its learner's incarnation (a replay
is refused) and never claim a base version the syncer has not published yet. At `dldctl down`,
a stopping learner's last, partial windows are kept out of the final model. Pure.
"""

from __future__ import annotations

import collections
from typing import Any

from syncer.globalmodel import GlobalModel, Outbox
from syncer.wire import codec
from syncer.wire.protocol import Message, ProtocolError


class PushChecks:
    """The checks of a push and the memory they need (the last sequence per incarnation)."""

    def __init__(self, counters: collections.Counter[str]) -> None:
        self.counters = counters  # the run's tallies (syncer/accounting.py): "kept_out:*", "last_tokens_kept_out"
        self.last_seq: dict[tuple[str, str], int] = {}  # (incarnation, learner) -> newest seq taken

    @staticmethod
    def check_schema(msg: Message) -> None:
        if len(msg.payloads) != 1 or msg["c_steps"] < 1 or msg["c_tokens"] < 0 or msg["c_time"] < 0:
            raise ProtocolError("schema", "push: needs one payload, c_steps >= 1, c_tokens >= 0, c_time >= 0")

    @staticmethod
    def decode(msg: Message, p: int, model: GlobalModel, kernel: Any) -> tuple[Any, tuple[str, str] | None]:
        """The push's outer gradient, or why it is rejected ((reason, detail)): damaged or non-finite."""
        try:
            return codec.decode_quantized(msg.blob(), expect_numel=model.theta[p].numel(), kernel=kernel), None
        except codec.CodecError as exc:
            reason = "nan" if "NaN" in str(exc) or "non-finite" in str(exc) else "codec"
            return None, (reason, str(exc))

    def problem(
        self, learner: str, incarnation: str, p: int, msg: Message, epoch: int, version: int
    ) -> tuple[str, str] | None:
        """Replayed pushes (sequence not increasing within one incarnation) and versions from
        the future are refused: both would move the model with something it never produced.
        `version`: fragment p's current version."""
        key = (incarnation, learner)
        if msg["seq"] <= self.last_seq.get(key, -1):
            return "replay", f"push seq {msg['seq']} after {self.last_seq[key]}"
        if msg["epoch"] == epoch and msg["base_version"] > version:
            return (
                "future_version",
                f"base version {msg['base_version']} > current {version} of fragment {p}",
            )
        self.last_seq[key] = msg["seq"]
        return None

    def keep_out(self, learner: str, tokens: int, now: float, out: Outbox) -> None:
        """`dldctl down`: a stopping learner's last, partial windows stay out of the final model
        (docs/algorithm.md, "The end of a run"); their tokens count as trained, not merged."""
        if not self.counters[f"kept_out:{learner}"]:  # one event per learner, not per fragment
            out.event(now, "last_windows_kept_out", learner, "its last partial windows at down (not merged)")
        self.counters[f"kept_out:{learner}"] += 1
        self.counters["last_tokens_kept_out"] += tokens
