"""The learner's replica of the global fragments: chunked state transfer (windowed, pinned to the
version of its first chunk, re-requested after a timeout, restarted when that version is gone),
updates applied only on top of the right version (bit-exact with the syncer) and buffered while a
transfer runs, gaps turned into re-fetches, crc32 checks against the syncer's checksum, `behind`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.replica import Replica, checksum
from syncer.wire import codec, quant


def _values(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype("<f4")


class FakeSyncer:
    """Serves fragments in chunks, as SyncerCore._state_req does."""

    def __init__(self, sizes: list[int], chunk: int) -> None:
        self.theta = [torch.from_numpy(_values(n, i)) for i, n in enumerate(sizes)]
        self.versions = [0] * len(sizes)
        self.chunk = chunk

    def state(self, p: int, offset: int, version: int = -1) -> tuple[int, int, int, np.ndarray]:
        """The current version's chunk (this fake keeps no older versions)."""
        n = min(self.chunk, self.theta[p].numel() - offset)
        return p, self.versions[p], offset, self.theta[p][offset : offset + n].numpy().copy()


def _fetch_all(replica: Replica, syncer: FakeSyncer, now: float = 0.0, window: int = 3) -> int:
    rounds = 0
    while True:
        reqs = replica.requests(now, syncer.chunk, window)
        if not reqs:
            return rounds
        rounds += 1
        for p, offset, version in reqs:
            replica.on_state(*syncer.state(p, offset, version))


# -- state transfer ------------------------------------------------------------------------------


def test_fresh_replica() -> None:
    r = Replica([10, 5])
    assert r.count == 2 and not r.complete()
    assert r.versions == [-1, -1] and r.latest == [None, None]
    assert r.requests(0.0, chunk=4, window=8) == []  # nothing scheduled yet


def test_chunked_transfer_learns_the_version_then_fills_the_window() -> None:
    r = Replica([10, 5])
    r.refetch_all()
    assert r.requests(0.0, chunk=4, window=3) == [(0, 0, -1), (1, 0, -1)]  # first chunks: "current"
    assert r.requests(0.0, chunk=4, window=3) == []  # waiting for the version
    syncer = FakeSyncer([10, 5], chunk=4)
    syncer.versions = [7, 2]
    assert r.on_state(*syncer.state(0, 0)) is False
    assert r.requests(0.0, chunk=4, window=3) == [(0, 4, 7), (0, 8, 7)]  # pinned to version 7
    assert r.on_state(*syncer.state(0, 8)) is False  # out of order is fine
    assert r.on_state(*syncer.state(0, 4)) is True  # fragment 0 complete
    assert torch.equal(r.latest[0], syncer.theta[0]) and r.versions[0] == 7
    assert not r.complete()
    assert r.on_state(*syncer.state(1, 0)) is False
    assert r.requests(0.0, chunk=4, window=3) == [(1, 4, 2)]
    assert r.on_state(*syncer.state(1, 4)) is True
    assert r.complete() and torch.equal(r.latest[1], syncer.theta[1])
    assert r.fetches == {}


def test_lost_chunk_is_requested_again_after_the_timeout() -> None:
    r = Replica([8])
    r.refetch(0)
    assert r.requests(0.0, chunk=4, window=4) == [(0, 0, -1)]
    assert r.requests(5.0, chunk=4, window=4, timeout=10.0) == []
    assert r.requests(10.5, chunk=4, window=4, timeout=10.0) == [(0, 0, -1)]
    syncer = FakeSyncer([8], chunk=4)
    r.on_state(*syncer.state(0, 0))
    assert r.requests(11.0, chunk=4, window=4, timeout=10.0) == [(0, 4, 0)]
    assert r.on_state(*syncer.state(0, 0)) is False  # a duplicate answer is ignored
    assert r.requests(30.0, chunk=4, window=4, timeout=10.0) == [(0, 4, 0)]  # lost: asked again, pinned
    assert r.on_state(*syncer.state(0, 4)) is True
    assert torch.equal(r.latest[0], syncer.theta[0])


def test_unwanted_chunks_are_ignored() -> None:
    r = Replica([8])
    syncer = FakeSyncer([8], chunk=4)
    assert r.on_state(*syncer.state(0, 0)) is False  # no fetch running
    r.refetch(0)
    r.requests(0.0, chunk=4, window=1)  # only offset 0 in flight
    assert r.on_state(*syncer.state(0, 4)) is False  # not requested
    assert r.fetches[0].received == 0


def test_version_gone_mid_transfer_restarts_the_fragment_keeping_buffered_updates() -> None:
    r = Replica([12])
    r.refetch(0)
    syncer = FakeSyncer([12], chunk=4)
    r.requests(0.0, chunk=4, window=8)
    r.on_state(*syncer.state(0, 0))  # version 0
    r.requests(0.0, chunk=4, window=8)
    assert r.on_update(0, 0, 1, b"blob", None) == "buffered"
    syncer.versions[0] = 1  # a merge lands and version 0 is not kept
    syncer.theta[0] = syncer.theta[0] + 1.0
    assert r.on_state(*syncer.state(0, 4)) is False  # version 1 served: restart
    assert r.fetches[0].received == 0 and r.fetches[0].version is None
    assert len(r.fetches[0].pending) == 1
    assert r.on_state(*syncer.state(0, 8)) is False  # the old request is gone too
    assert r.latest[0] is None


def test_updates_during_a_transfer_are_replayed_on_top_of_it() -> None:
    syncer = FakeSyncer([12], chunk=4)
    r = Replica([12])
    r.refetch(0)
    q1 = quant.quantize(torch.randn(12, generator=torch.Generator().manual_seed(1)), "int4", 4)
    q2 = quant.quantize(torch.randn(12, generator=torch.Generator().manual_seed(2)), "int4", 4)
    v1 = syncer.theta[0] + quant.dequantize(q1)
    v2 = v1 + quant.dequantize(q2)
    for p, offset, version in r.requests(0.0, chunk=4, window=8):
        r.on_state(*syncer.state(p, offset, version))
    assert r.on_update(0, 1, 2, codec.encode_quantized(q2), checksum(v2)) == "buffered"  # out of order
    assert r.on_update(0, 0, 1, codec.encode_quantized(q1), checksum(v1)) == "buffered"
    _fetch_all(r, syncer)  # completes at version 0, then replays 1 and 2
    assert r.versions[0] == 2 and torch.equal(r.latest[0], v2) and r.mismatches == 0


def test_refetch_restarts_a_transfer_in_progress() -> None:
    r = Replica([8])
    r.refetch(0)
    r.requests(0.0, chunk=4, window=8)
    syncer = FakeSyncer([8], chunk=4)
    r.on_state(*syncer.state(0, 0))
    r.refetch(0)
    assert r.fetches[0].received == 0
    assert r.on_state(*syncer.state(0, 4)) is False  # answer to the abandoned request
    _fetch_all(r, syncer)
    assert torch.equal(r.latest[0], syncer.theta[0])


# -- updates -------------------------------------------------------------------------------------


def _ready(sizes: list[int], versions: list[int]) -> tuple[Replica, list[torch.Tensor]]:
    r = Replica(sizes)
    r.epoch = 1
    values = [torch.from_numpy(_values(n, 10 + i)) for i, n in enumerate(sizes)]
    for p, (v, ver) in enumerate(zip(values, versions)):
        r.latest[p], r.versions[p] = v.clone(), ver
    return r, values


def test_update_applied_from_the_right_version_bit_exact() -> None:
    r, values = _ready([300], [3])
    theta = values[0].clone()  # the syncer's copy
    g = torch.Generator().manual_seed(1)
    for version in range(4, 30):
        q = quant.quantize(torch.randn(300, generator=g) * 1e-2, "int4", 64)
        theta = theta + quant.dequantize(q)
        assert r.on_update(0, version - 1, version, codec.encode_quantized(q)) == "applied"
        assert r.versions[0] == version
        assert torch.equal(r.latest[0], theta)


def test_stale_updates_are_ignored() -> None:
    r, values = _ready([16], [5])
    blob = codec.encode(torch.ones(16), "none")
    assert r.on_update(0, 4, 5, blob) == "stale"  # already have version 5
    assert r.on_update(0, 3, 4, blob) == "stale"
    assert torch.equal(r.latest[0], values[0]) and r.versions[0] == 5


def test_gap_schedules_a_refetch_and_later_updates_wait_for_it() -> None:
    r, values = _ready([16, 8], [5, 2])
    blob = codec.encode(torch.ones(16), "none")
    assert r.on_update(0, 6, 7, blob) == "gap"  # missed version 6
    assert 0 in r.fetches and r.versions[0] == 5
    assert torch.equal(r.latest[0], values[0])  # nothing applied
    assert r.on_update(0, 7, 8, blob) == "buffered"  # kept, replayed once the fetch is in
    assert r.behind([9, 2]) == []  # fragment 0 is being fetched already
    assert r.on_update(1, 2, 3, codec.encode(torch.ones(8), "none")) == "applied"


def test_update_before_the_state_is_there_is_stale() -> None:
    r = Replica([4])
    assert r.on_update(0, -1, 0, codec.encode(torch.ones(4), "none")) == "stale"


def test_bad_update_blob_raises_codec_error_and_changes_nothing() -> None:
    r, values = _ready([16], [1])
    with pytest.raises(codec.CodecError):
        r.on_update(0, 1, 2, codec.encode(torch.ones(15), "none"))  # wrong size
    with pytest.raises(codec.CodecError):
        r.on_update(0, 1, 2, codec.encode(torch.full((16,), float("nan")), "int4"))
    assert r.versions[0] == 1 and torch.equal(r.latest[0], values[0])


def test_behind() -> None:
    r, _ = _ready([4, 4, 4], [1, 2, 3])
    assert r.behind([1, 2, 3]) == []
    assert r.behind([2, 2, 5]) == [0, 2]
    assert r.behind([0, 0, 0]) == []  # the syncer is never "behind" us here
    assert r.behind([9, 9]) == []  # wrong length: ignored
    r.refetch(1)
    assert r.behind([1, 3, 3]) == []  # being fetched
    empty = Replica([4])
    assert empty.behind([3]) == []  # nothing to be behind with yet


def test_transfer_then_updates_end_to_end() -> None:
    syncer = FakeSyncer([50, 30], chunk=16)
    r = Replica([50, 30])
    r.epoch = 1
    r.refetch_all()
    _fetch_all(r, syncer)
    g = torch.Generator().manual_seed(2)
    for step in range(10):
        p = step % 2
        q = quant.quantize(torch.randn(syncer.theta[p].numel(), generator=g), "int8", 16)
        syncer.theta[p] = syncer.theta[p] + quant.dequantize(q)
        syncer.versions[p] += 1
        assert r.on_update(p, syncer.versions[p] - 1, syncer.versions[p], codec.encode_quantized(q)) == "applied"
    assert all(torch.equal(a, b) for a, b in zip(r.latest, syncer.theta))
    assert r.versions == syncer.versions


# -- checksums -----------------------------------------------------------------------------------


def test_checksum_is_crc32_of_the_fp32_bytes() -> None:
    import zlib

    t = torch.tensor([1.0, -2.0, 3.5])
    assert checksum(t) == zlib.crc32(np.array([1.0, -2.0, 3.5], "<f4").tobytes())
    assert checksum(t) != checksum(torch.tensor([1.0, -2.0, 3.5000002]))
    assert checksum(torch.arange(6.0).view(2, 3).t()) == checksum(torch.tensor([0.0, 3, 1, 4, 2, 5]))


def _fetch_all_crc(r: Replica, syncer: FakeSyncer, crc: int, rounds: int = 10) -> None:
    for _ in range(rounds):
        for p, off, version in r.requests(0.0, chunk=4, window=8):
            r.on_state(*syncer.state(p, off, version), crc=crc)


def test_state_transfer_with_matching_crc() -> None:
    syncer = FakeSyncer([10], chunk=4)
    crc = checksum(syncer.theta[0])
    r = Replica([10])
    r.refetch(0)
    _fetch_all_crc(r, syncer, crc)
    assert r.complete() and r.crcs == [crc] and r.mismatches == 0


def test_state_transfer_with_wrong_crc_is_fetched_again() -> None:
    syncer = FakeSyncer([10], chunk=4)
    r = Replica([10])
    r.refetch(0)
    _fetch_all_crc(r, syncer, checksum(syncer.theta[0]) ^ 1, rounds=2)
    assert r.mismatches == 1 and r.latest[0] is None
    assert 0 in r.fetches and r.fetches[0].received == 0  # starts over
    _fetch_all_crc(r, syncer, checksum(syncer.theta[0]))
    assert r.complete() and torch.equal(r.latest[0], syncer.theta[0])


def test_update_crc_match_and_mismatch() -> None:
    r, values = _ready([64], [0])
    q = quant.quantize(torch.randn(64, generator=torch.Generator().manual_seed(3)), "int4", 16)
    theta = values[0] + quant.dequantize(q)
    blob = codec.encode_quantized(q)
    assert r.on_update(0, 0, 1, blob, crc=checksum(theta)) == "applied"
    assert r.crcs[0] == checksum(theta) and r.mismatches == 0
    q2 = quant.quantize(torch.ones(64), "int4", 16)
    assert r.on_update(0, 1, 2, codec.encode_quantized(q2), crc=checksum(theta)) == "mismatch"
    assert r.mismatches == 1 and 0 in r.fetches  # never trained on: refetched
    assert r.on_update(0, 2, 3, blob) == "buffered"  # waits for the fetch


# -- chunks: one copy, a running crc, sizes checked ---------------------------------------------


def test_the_running_crc_covers_chunks_in_any_order_and_catches_a_changed_one() -> None:
    """Chunks larger than a crc slice, answered last-first: the crc waits for the gap, then
    covers every byte of the buffer; one changed value in one chunk makes it a mismatch."""
    n, chunk = 200_000, 70_000  # 3 chunks, each several CRC_SLICEs
    syncer = FakeSyncer([n], chunk=chunk)
    crc = checksum(syncer.theta[0])
    for damaged in (False, True):
        r = Replica([n])
        r.refetch(0)
        first = r.requests(0.0, chunk=chunk, window=8)
        assert r.on_state(*syncer.state(0, 0), crc=crc) is False
        rest = r.requests(0.0, chunk=chunk, window=8)
        assert first == [(0, 0, -1)] and [off for _, off, _ in rest] == [70_000, 140_000]
        for _, off, version in reversed(rest):
            p, v, o, values = syncer.state(0, off, version)
            if damaged and off == 70_000:
                values[123] += 1.0
            r.on_state(p, v, o, values, crc=crc)
        assert r.complete() is not damaged and r.mismatches == int(damaged)
    r = Replica([n])
    r.refetch(0)
    _fetch_all(r, syncer, window=1)
    assert torch.equal(r.latest[0], syncer.theta[0])


def test_a_chunk_of_the_wrong_size_is_refused_and_asked_again_after_the_timeout() -> None:
    from syncer.wire.protocol import ProtocolError

    syncer = FakeSyncer([10], chunk=4)
    r = Replica([10])
    r.refetch(0)
    assert r.requests(0.0, chunk=4, window=4) == [(0, 0, -1)]
    p, version, offset, values = syncer.state(0, 0)
    for bad in (values[:3], np.concatenate([values, values[:2]])):
        with pytest.raises(ProtocolError) as exc:
            r.on_state(p, version, offset, bad)
        assert exc.value.reason == "shape"
    assert r.fetches[0].received == 0 and r.fetches[0].version is None and 0 in r.fetches[0].in_flight
    assert r.requests(11.0, chunk=4, window=4) == [(0, 0, -1)]  # asked again
    assert r.on_state(*syncer.state(0, 0)) is False
    _fetch_all(r, syncer, now=11.0)
    assert torch.equal(r.latest[0], syncer.theta[0])


def test_the_chunk_size_is_pinned_by_the_first_request() -> None:
    syncer = FakeSyncer([10], chunk=4)
    r = Replica([10])
    r.refetch(0)
    r.requests(0.0, chunk=4, window=4)
    r.on_state(*syncer.state(0, 0))
    asked = r.requests(0.0, chunk=2, window=4)
    assert [off for _, off, _ in asked] == [4, 8]  # not 4, 6, 8
    assert [r.on_state(*syncer.state(p, off, v)) for p, off, v in asked] == [False, True]
    assert torch.equal(r.latest[0], syncer.theta[0])
