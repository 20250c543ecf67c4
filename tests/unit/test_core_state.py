"""The syncer's state machine driven directly (no sockets, fake clock): the status snapshot,
checkpoints (round trip, corrupted newest file skipped, export) and version-pinned state transfers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from syncer import checkpoint, status
from syncer.core import SyncerCore
from syncer.wire.protocol import Message
from tests.unit.coreharness import RUN, Harness, make_settings, sent_of, tensor_manifest

# -- status snapshot ---------------------------------------------------------------------------------

# ARCHITECTURE.md's `dldctl status --json` schema, minus what only the operator adds
# (syncer.address, learners[].restarts, events)
SCHEMA = {
    "run": str,
    "uptime_s": float,
    "goodput": float,
    "syncer": {"alive": bool, "fragments": int, "outer_steps": int, "checkpoint_outer_step": int},
    "quorum": {"min": int, "live": int, "total": int, "last_round_contributors": int},
    "tokens": {"trained": int, "merged": int, "per_s": float},
    "bytes": {"up": int, "down": int, "ddp_equivalent": int},
    "loss": {"train": (float, type(None)), "eval": (float, type(None))},
}
LEARNER_ROW = {
    "id": str,
    "host": str,
    "state": str,
    "pid": (int, type(None)),
    "step": int,
    "tokens": int,
    "tokens_per_s": float,
    "weight": float,
    "heartbeat_age_s": (float, type(None)),
}


def _check_schema(value: dict, schema: dict, where: str = "") -> None:
    for key, kind in schema.items():
        assert key in value, f"missing {where}{key}"
        if isinstance(kind, dict):
            _check_schema(value[key], kind, f"{where}{key}.")
        else:
            ok = isinstance(value[key], kind) and not (kind in (int, float) and isinstance(value[key], bool))
            if kind is float:
                ok = isinstance(value[key], (int, float)) and not isinstance(value[key], bool)
            assert ok, f"{where}{key} = {value[key]!r}"


def test_status_snapshot_schema() -> None:
    h = Harness(make_settings(quorum=2))
    snap = status.snapshot(h.core, 0.5)  # before anything happened
    _check_schema(snap, SCHEMA)
    h.join_all()
    h.push("a", 0, h.delta(0, 1), now=10.0)
    h.push("b", 0, h.delta(0, 2), now=10.0)
    h.tick(12.0)
    snap = status.snapshot(h.core, 12.0)
    _check_schema(snap, SCHEMA)
    json.dumps(snap, allow_nan=False)
    assert snap["run"] == RUN and snap["syncer"]["outer_steps"] == 1 and snap["syncer"]["initialized"] is True
    assert snap["quorum"]["last_round_contributors"] == 2 and snap["quorum"]["total"] == 3
    assert snap["syncer"]["versions"] == [1, 0]
    assert len(snap["learners"]) == 3
    for row in snap["learners"]:
        _check_schema(row, LEARNER_ROW)
    assert [r["id"] for r in snap["learners"]] == ["a", "b", "c"]
    assert snap["bytes"]["compression_ratio"] > 5  # int4 pushes
    assert 0.0 <= snap["goodput"] <= 1.0


def test_status_ddp_equivalent_bytes() -> None:
    # ring all-reduce: 2 (N-1)/N x 4 bytes x params per step, both ways
    assert status.ddp_equivalent_bytes(10, 1000, 4) == int(10 * 2 * 2 * 3 / 4 * 4 * 1000)
    assert status.ddp_equivalent_bytes(10, 1000, 1) == 0
    assert status.ddp_equivalent_bytes(10, 0, 4) == 0


# -- checkpoints ----------------------------------------------------------------------------------


def _run_rounds(h: Harness, n: int, start: float = 10.0) -> float:
    now = start
    for r in range(n):
        p = r % h.s.fragments
        h.push("a", p, h.delta(p, 100 + r), now=now)
        h.push("b", p, h.delta(p, 200 + r), now=now)
        h.push("c", p, h.delta(p, 300 + r), now=now)
        h.tick(now)
        now += 1.0
    return now


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    h = Harness(make_settings(quorum=2))
    h.join_all()
    _run_rounds(h, 5)
    h.core.bytes_up, h.core.bytes_down = 1234, 5678
    path = checkpoint.save(tmp_path, checkpoint.state_dict(h.core, wall=100.0))
    assert path.name.startswith("ckpt-0001-000000005-") and not list(tmp_path.glob(".*.tmp"))
    state, problems = checkpoint.load_latest(tmp_path)
    assert problems == [] and state is not None
    fresh = SyncerCore(h.s, RUN, ["a", "b", "c"], now=110.0, epoch=2)
    checkpoint.restore(fresh, state, now=110.0)
    for name in ("theta", "momentum", "residual"):
        for x, y in zip(getattr(fresh.model, name), getattr(h.core.model, name)):
            assert torch.equal(x, y), name
    assert fresh.model.versions == h.core.model.versions == [3, 2]
    assert fresh.model.manifest == h.core.model.manifest and fresh.model.plan == h.core.model.plan
    assert fresh.outer_steps == fresh.checkpoint_outer_step == 5
    assert (fresh.bytes_up, fresh.bytes_down) == (1234, 5678)
    assert fresh.fleet.merged_tokens == pytest.approx(h.core.fleet.merged_tokens)
    # the 10 s the syncer was down still count as provisioned time for the 3 declared learners
    assert fresh.fleet.provisioned_s == pytest.approx(h.core.fleet.provisioned_s + 30.0)
    assert set(fresh.fleet.learners) == {"a", "b", "c"}
    # ...but not after `down` closed the run (its final checkpoint says so): nobody was provisioned
    closed = SyncerCore(h.s, RUN, ["a", "b", "c"], now=110.0, epoch=2)
    checkpoint.restore(closed, {**state, "closed": True}, now=110.0)
    assert closed.fleet.provisioned_s == pytest.approx(h.core.fleet.provisioned_s)
    # the restored core keeps merging from where the old one stopped
    h2 = Harness(h.s)
    h2.core = fresh
    h2.join_all(now=111.0)
    h2.push("a", 0, h.delta(0, 9), now=112.0)
    h2.push("b", 0, h.delta(0, 8), now=112.0)
    h2.push("c", 0, h.delta(0, 7), now=112.0)
    out = h2.tick(112.0)
    assert sent_of(out, "update")[0][1]["version"] == 4


def test_checkpoint_restore_refuses_other_runs_and_layouts(tmp_path: Path) -> None:
    h = Harness(make_settings())
    h.join_all()
    state = checkpoint.state_dict(h.core, wall=1.0)
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.restore(SyncerCore(h.s, "other", [], now=0.0), state, now=1.0)
    other = dataclasses.replace(h.s, fragments=4)
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.restore(SyncerCore(other, RUN, [], now=0.0), state, now=1.0)
    bad = dict(state, theta=[t[:-1] for t in state["theta"]])
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.restore(SyncerCore(h.s, RUN, [], now=0.0), bad, now=1.0)


def _two_checkpoints(tmp_path: Path) -> tuple[Harness, Path, Path]:
    h = Harness(make_settings(quorum=2))
    h.join_all()
    now = _run_rounds(h, 2)
    older = checkpoint.save(tmp_path, checkpoint.state_dict(h.core, wall=1.0))
    _run_rounds(h, 2, start=now)
    newer = checkpoint.save(tmp_path, checkpoint.state_dict(h.core, wall=2.0))
    assert checkpoint.list_checkpoints(tmp_path) == [newer, older]
    return h, older, newer


@pytest.mark.parametrize("damage", ["flip_body", "flip_magic", "flip_digest", "truncate", "truncate_head", "empty"])
def test_corrupted_newest_checkpoint_is_skipped(tmp_path: Path, damage: str) -> None:
    _h, _older, newer = _two_checkpoints(tmp_path)
    data = bytearray(newer.read_bytes())
    if damage == "flip_body":
        data[len(data) // 2] ^= 0xFF
    elif damage == "flip_magic":
        data[0] ^= 0x01
    elif damage == "flip_digest":
        data[len(checkpoint.MAGIC) + 3] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "truncate_head":
        data = data[:20]
    else:
        data = bytearray()
    newer.write_bytes(bytes(data))
    state, problems = checkpoint.load_latest(tmp_path)
    assert state is not None and state["outer_steps"] == 2
    assert len(problems) == 1 and newer.name in problems[0]
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.read(newer)


def test_no_valid_checkpoint(tmp_path: Path) -> None:
    assert checkpoint.load_latest(tmp_path / "missing") == (None, [])
    _h, older, newer = _two_checkpoints(tmp_path)
    for path in (older, newer):
        path.write_bytes(path.read_bytes()[:-1])
    state, problems = checkpoint.load_latest(tmp_path)
    assert state is None and len(problems) == 2


def test_checkpoint_keeps_only_the_newest(tmp_path: Path) -> None:
    h = Harness(make_settings(quorum=2))
    h.join_all()
    now = 10.0
    saved = []
    for _ in range(5):
        now = _run_rounds(h, 1, start=now)
        saved.append(checkpoint.save(tmp_path, checkpoint.state_dict(h.core, wall=now), keep=3))
    assert checkpoint.list_checkpoints(tmp_path) == saved[::-1][:3]


def test_export_model(tmp_path: Path) -> None:
    h = Harness(make_settings(quorum=2))
    h.join_all()
    _run_rounds(h, 2)
    target = tmp_path / "model.pt"
    checkpoint.export_model(h.core, target)
    exported = torch.load(target, weights_only=True)
    tensors = exported["state_dict"]
    assert [(k, tuple(v.shape)) for k, v in tensors.items()] == [(s.name, s.shape) for s in h.manifest]
    for p in range(h.plan.count):
        assert torch.equal(h.plan.gather(p, tensors), h.core.model.theta[p])
    assert exported["versions"] == h.core.versions()


def test_duplicated_init_chunk_does_not_complete_the_fragment_early() -> None:
    h = Harness(make_settings(), manifest=tensor_manifest("gpt-tiny"))
    h.hello("a", 1.0)
    chunk = h.core.chunk_numel()
    values = h.init_values[0]
    first = Message(
        "init",
        {"fragment": 0, "offset": 0, "numel": chunk, "total": values.numel()},
        [values[:chunk].numpy().tobytes()],
    )
    for _ in range(-(-values.numel() // chunk)):  # the first chunk, as many times as there are chunks
        h.send("a", first, 1.0)
    for p in range(1, h.plan.count):  # every other fragment properly
        for off in range(0, h.init_values[p].numel(), chunk):
            part = h.init_values[p][off : off + chunk]
            h.send(
                "a",
                Message(
                    "init",
                    {"fragment": p, "offset": off, "numel": part.numel(), "total": h.init_values[p].numel()},
                    [part.numpy().tobytes()],
                ),
                1.0,
            )
    assert h.core.model is None  # fragment 0 still has holes


def test_a_transfer_keeps_its_version_while_a_merge_lands() -> None:
    """Chunks asked for version v are served from v even after v+1 was published (one back),
    as long as a transfer of that fragment is under way."""
    h = Harness(make_settings(quorum=1), manifest=tensor_manifest())  # fragments of many chunks
    h.join_all()
    old = h.core.model.theta[0].clone()
    old_crc = h.core.model.crc(0)

    def chunk(version: int, now: float) -> Message:
        ((_, state),) = h.send("b", Message("state_req", {"fragment": 0, "offset": 0, "version": version}), now).sends
        return state

    assert chunk(-1, 2.0)["version"] == 0  # a transfer starts on version 0
    h.beat_all(2.0)
    h.push("a", 0, h.delta(0, 1), now=2.0)
    h.tick(2.0 + h.core.rounds[0].grace_s + 1.0)
    assert h.core.model.versions[0] == 1
    pinned, latest = chunk(0, 4.0), chunk(-1, 4.0)
    assert pinned["version"] == 0 and pinned["crc"] == old_crc
    assert pinned.payloads[0] == old[: pinned["numel"]].numpy().tobytes()
    assert latest["version"] == 1 and latest["crc"] == h.core.model.crc(0)


def test_a_served_chunk_is_a_view_that_no_merge_writes() -> None:
    """State chunks go out without a copy, as views of the fragment's value; the value is lent:
    the next merge of that fragment writes a copy, so a chunk still queued in the socket keeps
    the bytes of its version. A fragment nobody fetched is merged in place, as before."""
    h = Harness(make_settings(quorum=1))
    h.join_all()
    m = h.core.model
    served = m.theta[0]
    untouched = m.theta[1]
    ((_, state),) = h.send("b", Message("state_req", {"fragment": 0, "offset": 0}), 2.0).sends
    view = state.payloads[0]
    assert isinstance(view, memoryview) and view.format == "B" and view.nbytes == 4 * state["numel"]
    before = bytes(view)
    assert before == served[: state["numel"]].numpy().tobytes()
    h.beat_all(2.0)
    for p in (0, 1):
        h.push("a", p, h.delta(p, 1), now=2.0)
    h.tick(2.0 + max(r.grace_s for r in h.core.rounds.values()) + 1.0)
    assert m.versions == [1, 1]
    assert m.theta[0] is not served and not torch.equal(m.theta[0], served), "merged into a copy"
    assert bytes(view) == before, "the lent value was never written"
    assert m.theta[1] is untouched, "never lent: merged in place"
    ((_, latest),) = h.send("b", Message("state_req", {"fragment": 0, "offset": 0}), 4.0).sends
    assert latest["version"] == 1 and latest["crc"] == m.crc(0)
    assert bytes(latest.payloads[0]) == m.theta[0][: latest["numel"]].numpy().tobytes()


def test_a_finished_transfer_keeps_no_previous_version() -> None:
    """Once a learner was served the last chunk of a fragment, its transfer is done: the next merge
    keeps no copy of the version it replaces (it did for 30 s after every join)."""
    h = Harness(make_settings(quorum=1), manifest=tensor_manifest())
    h.join_all()
    total, chunk = h.core.model.theta[0].numel(), h.core.chunk_numel()
    assert total > chunk
    for offset in range(0, total, chunk):
        h.send("b", Message("state_req", {"fragment": 0, "offset": offset, "version": 0}), 2.0)
    h.beat_all(2.0)
    h.push("a", 0, h.delta(0, 1), now=2.0)
    h.tick(2.0 + h.core.rounds[0].grace_s + 1.0)
    assert h.core.model.versions[0] == 1 and 0 not in h.core.serving.previous
    h.send("b", Message("state_req", {"fragment": 0, "offset": 0, "version": 1}), 4.0)  # another under way
    h.push("a", 0, h.delta(0, 2), now=4.0)
    h.tick(4.0 + h.core.rounds[0].grace_s + 1.0)
    assert h.core.serving.previous[0][0] == 1


def test_chunks_of_the_kept_version_are_served_across_several_merges() -> None:
    """A transfer pinned to version v keeps getting v's bytes while v+1 lands (v is the kept
    previous); once v+2 lands, v is gone and the chunk comes from the current version."""
    h = Harness(make_settings(quorum=1), manifest=tensor_manifest())  # fragments of many chunks
    h.join_all()
    v0 = h.core.model.theta[0].clone()

    def chunk(version: int, now: float) -> Message:
        ((_, msg),) = h.send("b", Message("state_req", {"fragment": 0, "offset": 0, "version": version}), now).sends
        return msg

    def merge(now: float) -> None:
        h.beat_all(now)
        h.push("a", 0, h.delta(0, int(now)), now=now)
        h.tick(now + h.core.rounds[0].grace_s + 1.0)

    assert chunk(-1, 2.0)["version"] == 0
    merge(2.0)
    first = chunk(0, 4.0)
    assert first["version"] == 0 and bytes(first.payloads[0]) == v0[: first["numel"]].numpy().tobytes()
    merge(5.0)
    assert h.core.model.versions[0] == 2
    assert bytes(first.payloads[0]) == v0[: first["numel"]].numpy().tobytes(), "still v0's bytes"
    assert chunk(0, 7.0)["version"] == 2, "v0 no longer kept: the current version"
