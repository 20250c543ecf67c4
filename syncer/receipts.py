"""Which of each learner's pushes the syncer's state holds: the receipts its checkpoints give.

Every push carries a sequence number, increasing within a learner's incarnation. When a round
merges a learner's contribution, the highest sequence number in it is that learner's receipt
for the fragment (pushes of one fragment merge in order). A checkpoint stores the receipts with
the model they describe. Once it is written, the acks tell each learner its receipts (`saved`)
and the learner lets go of the pushes they cover (learner/kept.py). The welcome of a syncer
restarted from that checkpoint tells it the same (`covered`): what it sent above them died with
the old syncer, and it sends it again. Its hello named its kept pushes and their work units
(`kept`), so the data ledger counts those units as not pushed yet (`again`): they are merged when
the pushes arrive again, not handed out to be trained again; a `pushes_resent` event says how
many pushes come again. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from syncer.datadesk import MAX_IDS, unit_ids
from syncer.globalmodel import Outbox
from syncer.rounds import Contribution
from syncer.wire.protocol import ProtocolError

Receipt = tuple[str, dict[int, int]]  # (incarnation, fragment -> highest sequence number merged)


class PushReceipts:
    """The receipts of the live state (`merged`) and of the newest written checkpoint (`saved`)."""

    def __init__(self) -> None:
        self.merged: dict[str, Receipt] = {}
        self.saved: dict[str, Receipt] = {}

    def settled(self, p: int, contribs: Iterable[Contribution]) -> None:
        """A round of fragment p merged these contributions."""
        for c in contribs:
            if c.seq < 0:  # the carried share of a capped backlog: its push was counted when it merged
                continue
            incarnation, seqs = self.merged.get(c.learner, ("", {}))
            seqs = seqs if incarnation == c.incarnation else {}
            seqs[p] = max(c.seq, seqs.get(p, -1))
            self.merged[c.learner] = (c.incarnation, seqs)

    def state_dict(self) -> dict[str, Any]:
        return {lid: {"incarnation": inc, "seqs": _pairs(seqs)} for lid, (inc, seqs) in self.merged.items()}

    def load_state_dict(self, state: Any) -> None:
        """A restored checkpoint's receipts: the state now, and what is saved."""
        self.merged = _receipts(state)
        self.saved = _receipts(state)

    def written(self, state: Any) -> None:
        """A checkpoint holding these receipts (its `state_dict`) was written."""
        self.saved = _receipts(state)

    def covered(self, learner: str, incarnation: str, saved: bool = False) -> list[list[int]]:
        """[[fragment, seq], ...]: `learner`'s receipts in the state (`saved`: the newest checkpoint)."""
        inc, seqs = (self.saved if saved else self.merged).get(learner, ("", {}))
        return _pairs(seqs) if inc == incarnation else []

    def again(
        self, kept: Any, learner: str, incarnation: str, epoch: int, owned: Sequence[int], now: float, out: Outbox
    ) -> dict[int, set[int]]:
        """From a hello's `kept` ({epoch, pushes: [[fragment, seq, [units]], ...]}): unit -> the
        global fragments (`owned`: the local index's) on which this learner sends it again. Only
        for pushes sent to another syncer epoch, above this state's receipts (an event says how
        many)."""
        if kept is None:
            return {}
        if not isinstance(kept, dict) or not isinstance(kept.get("pushes"), list) or len(kept["pushes"]) > MAX_IDS:
            raise ProtocolError("schema", f"hello: kept must be {{epoch, pushes}} with at most {MAX_IDS} pushes")
        if kept.get("epoch") == epoch:
            return {}
        covered = {pair[0]: pair[1] for pair in self.covered(learner, incarnation)}
        units: dict[int, set[int]] = {}
        pushes = 0
        for entry in kept["pushes"]:
            if not isinstance(entry, list) or len(entry) != 3:
                raise ProtocolError("schema", "hello: each kept push is [fragment, seq, [units]]")
            (p, seq), uids = unit_ids(entry[:2], "hello kept"), unit_ids(entry[2], "hello kept")
            if p < len(owned) and seq > covered.get(p, -1):
                pushes += 1
                for uid in uids:
                    units.setdefault(uid, set()).add(owned[p])
        if pushes:
            why = "merged after the checkpoint this syncer restarted from, or lost with the syncer that died"
            out.event(now, "pushes_resent", learner, f"{pushes} pushes sent again ({why})")
        return units


def _pairs(seqs: dict[int, int]) -> list[list[int]]:
    return sorted([p, s] for p, s in seqs.items())


def _receipts(state: Any) -> dict[str, Receipt]:
    """Receipts from a checkpoint (anything malformed: none, as before this was kept)."""
    out: dict[str, Receipt] = {}
    for lid, entry in (state or {}).items() if isinstance(state, dict) else ():
        try:
            out[str(lid)] = (str(entry["incarnation"]), {int(p): int(s) for p, s in entry["seqs"]})
        except (KeyError, TypeError, ValueError):
            continue
    return out
