"""The syncer's half of `dldctl status --json`: a pure function of the core's state and `now`.

The operator side (dldctl) adds what only it knows (pids from its state file, restarts counted
by the supervisor, the events log) to build the full snapshot of ARCHITECTURE.md. Whether the
global model is scored and guarded, and why not, is `loss.global_off` and `guard.off`
(syncer/common/unscored.py): the evaluator's side keeps it in `core.guard.off`.
"""

from __future__ import annotations

from typing import Any

from syncer.common import unscored
from syncer.core import SyncerCore


def ddp_equivalent_bytes(steps: int, n_params: int, workers: int) -> int:
    """Bytes a ring all-reduce of fp32 gradients would move for `steps` worker-steps.

    Per worker and step a ring all-reduce sends 2 (N-1)/N x bytes(params) and receives as much;
    counted both ways, like our own up + down.
    """
    if workers < 2 or n_params <= 0:
        return 0
    return int(steps * 2 * 2 * (workers - 1) / workers * 4 * n_params)


def snapshot(core: SyncerCore, now: float) -> dict[str, Any]:
    """Everything the syncer can say about the run right now (JSON-ready)."""
    fleet = core.fleet
    live = fleet.live(now)
    rounds = list(core.recent_rounds)
    last = rounds[-1] if rounds else {}
    n_params = core.model.numel if core.model else 0
    up, down = core.bytes_up, core.bytes_down
    wire = up + down
    return {
        "run": core.run_id,
        "uptime_s": now - core.started,
        "now": now,
        "insecure": core.s.insecure,
        "syncer": {
            "alive": True,
            "fragments": core.s.fragments,
            "outer_steps": core.outer_steps,
            "checkpoint_outer_step": core.checkpoint_outer_step,
            "epoch": core.epoch,
            "initialized": core.model is not None,
            "params": n_params,
            "versions": core.versions(),
            "rejected": dict(core.rejected),
            "dropped_sends": core.counters["dropped_sends"],
            "dropped_pushes": core.counters["dropped_pushes"],
            "clipped": core.counters["clipped"],
            "t_sync_s": core.t_sync or 0.0,
            "warnings": list(core.warnings),  # lasting: e.g. the run's history was lost
            "risks": core.s.risks(len(fleet.declared)),  # settings known to hurt the global model
        },
        "quorum": {
            "min": core.s.quorum,
            "live": len(live),
            "total": len(fleet.declared),
            "last_round_contributors": last.get("contributors", 0),
            "recent_contributors": [r["contributors"] for r in rounds],
            "grace_window_s": last.get("grace_s", 0.0),
            "grace_used_s": last.get("grace_used_s", 0.0),
            "open_rounds": sum(1 for r in core.rounds.values() if r.contributions),
            "below_quorum": len(live) < core.s.quorum,
            "finished": sorted(fleet.finished()),  # left with their budget spent: still in the average
            "ending": fleet.ending,  # `dldctl down` began
        },
        "goodput": fleet.goodput(),
        "goodput_window": fleet.goodput_window(),
        "tokens": {
            "trained": fleet.trained_tokens(),
            "merged": int(fleet.merged_tokens),
            "per_s": fleet.tokens_per_s(now),
        },
        "bytes": {
            "up": up,
            "down": down,
            "ddp_equivalent": ddp_equivalent_bytes(fleet.steps_total, n_params, len(fleet.declared)),
            "compression_ratio": _ratio(core),
        },
        "loss": {
            "train": fleet.mean_loss(now, "loss"),
            "eval": fleet.mean_loss(now, "eval_loss"),
            "global": (core.guard.last or {}).get("loss"),
            "global_off": global_off(core),  # why the global model is not scored (None: it is)
        },
        "guard": {
            "threshold": core.s.quality_guard,
            "last": core.guard.last,
            "trips": core.guard.trips,
            "rollbacks": core.counters["rollbacks"],
            "off": guard_off(core),  # why no score is judged (None: the guard runs)
        },
        "learners": _quarantined(core, _with_replicas(core, fleet.rows(now)), now),
        "screen": core.screen.snapshot(now),  # judged, rejected, quarantined (syncer/screening.py)
        "data": core.data.snapshot(),  # the data ledger (None: off, or not this shard's)
        "wire_bytes": wire,
    }


def global_off(core: SyncerCore) -> str | None:
    """Why the global model is not scored: the evaluator's word, or the settings'."""
    return core.guard.off or (unscored.EVERY_OFF if core.s.global_eval_every <= 0 else None)


def guard_off(core: SyncerCore) -> str | None:
    """Why the quality guard judges nothing: no score, or `quality_guard = 0`."""
    return global_off(core) or (unscored.GUARD_OFF if core.s.quality_guard <= 0 else None)


def _with_replicas(core: SyncerCore, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per learner: how many fragments of its replica are at our version with our checksum."""
    versions, crcs = core.versions(), core.crcs()
    for row in rows:
        info = core.fleet.learners[row["id"]]
        same = [p for p, v in enumerate(info.versions[: len(versions)]) if v == versions[p]]
        row["replica"] = {
            "versions": list(info.versions),
            "current": len(same),
            "identical": sum(1 for p in same if _agree(info.crcs, crcs, p)),
            "crc_mismatches": info.crc_mismatches,
        }
    return rows


def _quarantined(core: SyncerCore, rows: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """A quarantined learner's state is "quarantined", whatever its process says."""
    for row in rows:
        if (left := core.screen.quarantine.remaining(row["id"], now)) > 0:
            row["state"], row["quarantine_s"] = "quarantined", round(left, 1)
    return rows


def _agree(theirs: list[Any], ours: list[Any], p: int) -> bool:
    """A fragment at our version is identical unless the checksums contradict each other: between
    two checked versions (`checksum_every`) neither side has one, and that counts as identical."""
    mine, other = ours[p], theirs[p] if p < len(theirs) else None
    return mine is None or other is None or mine == other


def _ratio(core: SyncerCore) -> float:
    """fp32 bytes represented by the pushes received, over their bytes on the wire."""
    raw = core.counters["push_raw_bytes"]
    sent = core.counters["push_wire_bytes"]
    return raw / sent if sent else 0.0


def sample_record(snap: dict[str, Any], now: float, dropped_writes: dict[str, int]) -> dict[str, Any]:
    """The metrics log's periodic "sample" record: the headline numbers of a status `snap`
    (the server's: `snapshot` plus its socket counters) and the records dropped so far, per file."""
    return {
        "t": now,
        "kind": "sample",
        "goodput": snap["goodput"],
        "goodput_window": snap["goodput_window"],
        "tokens_trained": snap["tokens"]["trained"],
        "tokens_merged": snap["tokens"]["merged"],
        "tokens_per_s": snap["tokens"]["per_s"],
        "bytes_up": snap["bytes"]["up"],
        "bytes_down": snap["bytes"]["down"],
        "ddp_equivalent": snap["bytes"]["ddp_equivalent"],
        "loss_train": snap["loss"]["train"],
        "loss_eval": snap["loss"]["eval"],
        "loss_global": snap["loss"]["global"],
        "global_off": snap["loss"].get("global_off"),  # why it is not scored (None: it is)
        "quorum_live": snap["quorum"]["live"],
        "quorum_min": snap["quorum"]["min"],
        "outer_steps": snap["syncer"]["outer_steps"],
        "dropped_writes": dropped_writes,
        **_data_keys(snap.get("data")),
        "learners": {
            row["id"]: {k: row[k] for k in ("tokens_per_s", "step", "state", "loss", "tokens", "blocked_frac")}
            for row in snap["learners"]
        },
    }


def _data_keys(data: dict[str, Any] | None) -> dict[str, Any]:
    """The data ledger's headline numbers as flat metrics keys (none when the ledger is off)."""
    if not data:
        return {}
    keys = ("epoch", "merged_share", "in_flight", "lost", "reissued", "merged_tokens", "tokens_by_learner")
    return {f"data_{k}": data[k] for k in (*keys, "bookkeeping_s")}
