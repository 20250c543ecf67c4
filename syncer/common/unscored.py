"""Why a run's global model has no held-out score (and so no quality guard): one line, said everywhere.

The syncer scores the global model on the run's held-out batches (syncer/evaluator.py; a sharded
syncer's shard 0 scores its shards' checkpoints, syncer/shardscore.py) and its quality guard
judges every score. When it scores nothing, the reason is one line that travels with the run:
`loss.global_off` and `guard.off` of the status snapshot, `global_off` of the metrics samples, the
`global_eval_off` event, `held_out_loss_missing` of an export. The reasons the syncer gives:

    global_eval_every = 0                              off on purpose (the run's settings)
    cannot build the model on the syncer: E: ...       the model factory failed on the syncer's host
    scoring failed: E: ...                             a score raised mid-run; nothing is scored after it
    N shard(s) keep their checkpoints on another host  a sharded syncer cannot score live
    shard 0 scores the global model                    another shard's own snapshot

A leaf (no I/O, nothing of the project): the syncer builds these lines, dldctl reads them back
(`words` for tight spaces, `from_records` from what a run directory holds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

EVENT = "global_eval_off"  # the event that says it, once per syncer start
EVERY_OFF = "global_eval_every = 0"
GUARD_OFF = "quality_guard = 0"  # scored, but no score is judged
BUILD = "cannot build the model on the syncer"
FAILED = "scoring failed"
ELSEWHERE = "keep their checkpoints on another host"
SHARD0 = "shard 0 scores the global model"
_OLD_BUILD = "cannot score the global model on the syncer: "  # an older syncer's event detail


def build_failed(exc: BaseException) -> str:
    """The reason when the evaluator cannot build the model (its factory raised)."""
    return f"{BUILD}: {type(exc).__name__}: {exc}"[:300]


def scoring_failed(exc: BaseException) -> str:
    """The reason when a score raised: nothing is scored after it."""
    return f"{FAILED}: {type(exc).__name__}: {exc}"[:300]


def elsewhere(count: int) -> str:
    """A sharded syncer whose shards' checkpoints are not all in this run directory."""
    return f"{count} shard(s) {ELSEWHERE}; `dldctl down` scores the final model"


def on_purpose(reason: str | None) -> bool:
    """Whether scoring is off because the settings say so (not a failure)."""
    return reason == EVERY_OFF


def fix(reason: str) -> str:
    """What the operator can do about it ("" when nothing is to be done)."""
    if BUILD in reason:
        return (
            "make the model factory importable on the syncer's host (put its package in [run] workdir, "
            "which is shipped there) or set global_eval_every = 0"
        )
    if FAILED in reason:
        return "the learners' own eval losses still show; global_eval_every = 0 turns scoring off"
    return ""


def event_detail(reason: str) -> str:
    """The `global_eval_off` event's detail: the reason and the fix."""
    tail = fix(reason)
    return f"the global model is not scored, so the quality guard is off: {reason}" + (f"; {tail}" if tail else "")


def words(reason: str) -> tuple[str, ...]:
    """The reason in fewer and fewer words, for a narrow panel (the longest first, never empty)."""
    if reason == EVERY_OFF:
        return (EVERY_OFF, "global_eval_every=0", "by settings")
    if BUILD in reason or (reason.startswith(_OLD_BUILD) and not reason.startswith(_OLD_BUILD + FAILED)):
        tail = reason.split(f"{BUILD}: ", 1)[-1].split(_OLD_BUILD, 1)[-1]
        kind = tail.split(":", 1)[0].strip()
        named = (f"cannot build model ({kind})",) if kind and " " not in kind else ()
        return (*named, "cannot build model", "no model")
    if FAILED in reason:
        return ("scoring failed", "failed")
    if ELSEWHERE in reason:
        return ("shards on other hosts", "shards elsewhere")
    if reason == SHARD0:
        return ("scored by shard 0", "on shard 0")
    first = reason.split(";", 1)[0].split(": ", 1)[0].strip()
    return (reason, first) if first and first != reason else (reason or "not scored",)


def from_records(
    samples: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]], every: int | None = None
) -> str | None:
    """Why the global model of a run has no score, from its settings' `global_eval_every` (None:
    unknown), its metrics samples and its events, each oldest first. None: it is scored (or
    nothing says it is not). The newest sample's `global_off` is the syncer's own word; a run
    from before samples carried it falls back to its last `global_eval_off` event, unless a score
    came after it."""
    if every is not None and every <= 0:
        return EVERY_OFF
    if samples and "global_off" in samples[-1]:
        said = samples[-1]["global_off"]
        return str(said) if said else None
    off = [e for e in events if e.get("kind") == EVENT]
    if not off:
        return None
    when = _time(off[-1])
    if any(s.get("loss_global") is not None and _time(s) > when for s in samples):
        return None
    return str(off[-1].get("detail") or "not scored")


def _time(record: Mapping[str, Any]) -> float:
    t = record.get("t")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0
