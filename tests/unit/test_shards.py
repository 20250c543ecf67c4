"""The sharded syncer without sockets: the shard map, a shard's core (its welcome, its own
fragments only, its rounds in local numbers, its checkpoints), the learner's facade over one link
per shard, the resolved configuration's shard keys and the final model assembled from shards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from learner.config import LearnerConfig
from learner.link import Identity, LinkCore, ShardRole
from learner.sends import PushItem
from learner.syncerlink import SyncerLink
from syncer import checkpoint, shardmodel
from syncer.common import resolved
from syncer.common.resolved import LearnerEntry
from syncer.common.settings import RunSettings
from syncer.config import shard_dir
from syncer.core import SyncerCore
from syncer.wire import fragments, shards
from syncer.wire.protocol import Message, encode
from tests.unit.coreharness import RUN, Harness, make_settings, sent_of, tensor_manifest

# -- the map -------------------------------------------------------------------------------------


def test_every_fragment_has_one_owner_and_the_loads_are_balanced() -> None:
    sizes = [100, 90, 80, 70, 30, 20, 10, 5]
    m = shards.assign(sizes, 3)
    assert sorted(p for s in range(3) for p in m.owned(s)) == list(range(8))
    loads = m.loads(sizes)
    assert sum(loads) == sum(sizes) and max(loads) - min(loads) <= max(sizes)
    assert m == shards.assign(list(sizes), 3)  # a pure function: every learner and shard agree
    for p in range(8):
        s, q = m.local(p)
        assert m.owned(s)[q] == p


def test_one_shard_owns_everything_in_order_and_too_many_shards_are_refused() -> None:
    assert shards.assign([3, 1, 2], 1).owned(0) == (0, 1, 2)
    with pytest.raises(ValueError, match="fragments >= shards"):
        shards.assign([3, 1], 3)
    with pytest.raises(ValueError, match=">= 1"):
        shards.assign([3, 1], 0)


def test_a_shards_plan_is_the_runs_plan_of_its_fragments() -> None:
    manifest = tensor_manifest()
    full = fragments.plan(manifest, 4)
    owned = shards.assign(full.sizes(), 2).owned(1)
    sub = shards.shard_plan(manifest, 4, 1, 2)
    assert sub.fragments == tuple(full.fragments[p] for p in owned)
    assert shards.shard_plan(manifest, 4) == full


# -- a shard's core ------------------------------------------------------------------------------


def shard_harness(shard: int, count: int = 2, **settings: Any) -> Harness:
    """A Harness whose core is shard `shard` of `count`, its init values the shard's fragments."""
    h = Harness(make_settings(fragments=4, **settings))
    h.core = SyncerCore(h.s, RUN, ["a", "b", "c"], now=0.0, clock=h.clock, shard=(shard, count))
    owned = shards.assign(h.plan.sizes(), count).owned(shard)
    h.init_values = [h.init_values[p] for p in owned]
    h.plan = shards.sub_plan(h.plan, owned)
    return h


def test_a_shard_welcomes_with_its_fragments_and_holds_only_those() -> None:
    h = shard_harness(1)
    full = fragments.plan(h.manifest, 4)
    owned = list(shards.assign(full.sizes(), 2).owned(1))
    (_, welcome), *_ = sent_of(h.hello("a", 1.0), "welcome")
    assert (welcome["shard"], welcome["shards"], welcome["owned"]) == (1, 2, owned)
    h.join_all(("a", "b"))
    assert h.core.model is not None and h.core.model.plan.count == len(owned)
    assert h.core.model.numel == sum(full.sizes()[p] for p in owned) < sum(full.sizes())


def test_an_unsharded_welcome_owns_every_fragment() -> None:
    h = Harness(make_settings(fragments=4))
    (_, welcome), *_ = sent_of(h.hello("a", 1.0), "welcome")
    assert (welcome["shard"], welcome["shards"], welcome["owned"]) == (0, 1, [0, 1, 2, 3])


def test_a_shard_calls_only_its_own_rounds_in_its_own_numbers() -> None:
    h = shard_harness(0, round_clock="syncer", quorum=1)
    h.join_all(("a", "b"))
    h.core.round_clock.advance = lambda now, times: [0, 1, 2, 3]  # type: ignore[method-assign,assignment]
    calls = sent_of(h.tick(2.0), "call")
    assert sorted(m["fragment"] for _, m in calls) == list(range(len(h.core.owned))) == [0, 1]


def test_a_checkpoint_of_another_shard_is_refused_and_its_own_restores(tmp_path: Path) -> None:
    h = shard_harness(1)
    h.join_all(("a", "b"))
    h.push("a", 0, h.delta(0, 1), 2.0)
    h.push("b", 0, h.delta(0, 2), 2.0)
    h.tick(2.5)
    state = checkpoint.state_dict(h.core, 10.0)
    other = SyncerCore(h.s, RUN, ["a"], now=0.0, shard=(0, 2))
    with pytest.raises(checkpoint.CheckpointError, match="shard 1 of 2, this is shard 0 of 2"):
        checkpoint.restore(other, state, 11.0)
    assert other.model is None and other.owned == ()
    same = SyncerCore(h.s, RUN, ["a"], now=0.0, shard=(1, 2))
    checkpoint.restore(same, state, 11.0)
    assert same.owned == h.core.owned and same.model is not None and same.model.versions == h.core.model.versions


def test_a_shard_accounts_its_fragments_as_the_whole_model() -> None:
    """Shard 0's goodput and merged tokens are the run's: its 2 of 4 fragments count as the model."""
    h = shard_harness(0)
    h.join_all(("a", "b"))
    h.push("a", 0, h.delta(0, 1), 2.0, c_tokens=128)
    h.push("b", 0, h.delta(0, 2), 2.0, c_tokens=128)
    h.tick(2.5)
    assert h.core.outer_steps == 1 and h.core.fleet.merged_tokens == 2 * 128 / 2


# -- the final model of every shard ----------------------------------------------------------------


def test_the_final_model_is_every_shards_checkpoint_scattered(tmp_path: Path) -> None:
    parts = [shard_harness(s) for s in (0, 1)]
    for h in parts:
        h.join_all(("a", "b"))
        d = shard_dir(tmp_path, h.core.shard) / "checkpoints"
        checkpoint.save(d, checkpoint.state_dict(h.core, 1.0))
    model = shardmodel.assemble(tmp_path, 2)
    full = fragments.plan(parts[0].manifest, 4)
    for h in parts:
        for q, p in enumerate(h.core.owned):
            assert torch.equal(full.gather(p, model.tensors), h.init_values[q])
    assert [s.shard for s in model.sources] == [0, 1] and model.versions == [0, 0, 0, 0]
    for path in (shard_dir(tmp_path, 1) / "checkpoints").iterdir():
        path.unlink()
    with pytest.raises(checkpoint.CheckpointError, match="syncer shard 1: no valid checkpoint"):
        shardmodel.assemble(tmp_path, 2)


# -- the learner's side ----------------------------------------------------------------------------


def test_a_link_refuses_a_shard_that_owns_other_fragments() -> None:
    me = Identity("learner-1", "inc", "run", 1, "h", "cpu", 8, [], ShardRole(1, 2, (0, 3), 4))
    core = LinkCore(me, [16, 16], RunSettings(round_clock="learner"))
    core.opened(0.0)
    meta = dict(epoch=1, initialized=True, init_owner=False, versions=[0, 0], chunk_numel=1024, step=0)
    core.receive(0.1, encode(Message("welcome", {**meta, "shard": 1, "shards": 2, "owned": [1, 2]})))
    assert core.fatal is not None and "owning fragments [1, 2]" in core.fatal and "[0, 3]" in core.fatal
    good = LinkCore(me, [16, 16], RunSettings(round_clock="learner"))
    good.opened(0.0)
    good.receive(0.1, encode(Message("welcome", {**meta, "shard": 1, "shards": 2, "owned": [0, 3]})))
    assert good.fatal is None and good.linked()


def facade(tmp_path: Path, sizes: list[int], addresses: tuple[str, ...]) -> SyncerLink:
    cfg = LearnerConfig(
        "run",
        RunSettings(round_clock="learner", insecure=True, fragments=len(sizes)),
        LearnerEntry("learner-0"),
        addresses[0],
        None,
        None,
        tmp_path,
        syncer_addresses=addresses,
    )
    return SyncerLink(cfg, [], sizes, lambda: [torch.zeros(n) for n in sizes], "inc")


def test_the_facade_routes_each_fragment_to_its_shard_in_its_numbers(tmp_path: Path) -> None:
    sizes = [40, 30, 20, 10]
    link = facade(tmp_path, sizes, ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"))
    try:
        owned = [shards.assign(sizes, 2).owned(s) for s in (0, 1)]
        assert owned == [(0, 3), (1, 2)] and link.addresses == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
        link.push(PushItem(2, torch.zeros(20), 5, 8, 64, 1.0, 0.1))
        assert list(link.clients[1]._core.queue) == [1] and not link.clients[0]._core.queue
        link.clients[1]._core.inbox.replies.add(0)  # shard 1's local 0 = global 1
        link.clients[0]._core.inbox.forced.add(1)  # shard 0's local 1 = global 3
        assert link.take_updates() == ({1}, {3})
        link.clients[1]._core.replica.versions[1] = 7
        link.clients[0]._core.replica.epoch, link.clients[1]._core.replica.epoch = 4, 9
        assert link.versions() == [-1, -1, 7, -1] and link.epochs() == [4, 9, 9, 4]
        assert link.pending() == 1 and not link.linked() and not link.linked(2)
    finally:
        for c in link.clients:
            c._ctx.term()


def test_one_address_is_the_unsharded_link(tmp_path: Path) -> None:
    link = facade(tmp_path, [4, 4], ("tcp://127.0.0.1:1",))
    try:
        assert len(link.clients) == 1 and link.clients[0]._core.me.role == ShardRole(0, 1, (), 2)
        link.push(PushItem(1, torch.zeros(4), 0, 1, 8, 1.0, 0.1))
        assert list(link.clients[0]._core.queue) == [1]
    finally:
        link.clients[0]._ctx.term()


# -- the resolved configuration ----------------------------------------------------------------------


def config_with(tmp_path: Path, syncer: dict[str, Any], fragments_count: int = 4) -> Path:
    path = tmp_path / "config.json"
    data = {
        "version": 1,
        "run_id": "r",
        "run": {"fragments": fragments_count, "H": 8},
        "syncer": {"port": 7000, "control_port": 7001, **syncer},
        "learners": [{"id": "learner-0"}],
    }
    path.write_text(json.dumps(data))
    return path


def test_the_config_gives_each_shard_its_ports_and_addresses(tmp_path: Path) -> None:
    cfg = resolved.load(config_with(tmp_path, {"shards": 3, "shard_ports": [7002, 7003, 7004, 7005]}))
    assert [cfg.syncer.shard(s).control_port for s in range(3)] == [7001, 7003, 7005]
    assert cfg.syncer.addresses == ("tcp://127.0.0.1:7000", "tcp://127.0.0.1:7002", "tcp://127.0.0.1:7004")
    assert cfg.to_json()["syncer"]["shards"] == 3
    one = resolved.load(config_with(tmp_path, {}))
    assert "shards" not in one.to_json()["syncer"] and one.syncer.addresses == ("tcp://127.0.0.1:7000",)


@pytest.mark.parametrize(
    ("syncer", "message"),
    [
        ({"shards": 5, "shard_ports": list(range(8))}, r"\[syncer.shards\] must be between 1 and fragments = 4"),
        ({"shards": 2, "shard_ports": [1]}, r"\[syncer.shard_ports\] needs two ports per shard after the first"),
        ({"shards": 0}, r"\[syncer.shards\] must be between 1"),
    ],
)
def test_a_bad_shard_setting_is_one_line_naming_the_key(tmp_path: Path, syncer: dict[str, Any], message: str) -> None:
    with pytest.raises(resolved.ResolvedConfigError, match=message):
        resolved.load(config_with(tmp_path, syncer))
