"""The learner's replica of the global fragments, bit-identical to the syncer's (pure, no I/O).

It is filled by chunked state transfers (full fp32 fragments) and then kept current by update
blobs. A chunk is copied once, from the received frame straight into the fragment's buffer, and
the buffer's crc32 is extended over it while it is in cache (chunks come in order; one that comes
early waits for the gap to fill); the fragment is kept only if the crc of all of it matches.
Then updates: `latest[p] = latest[p] + decode(blob)` as two separate fp32 operations, exactly what the
syncer computed. An update that does not start from our version (we missed one) or a new syncer
epoch turns into a re-fetch of the full fragment.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from syncer.wire import codec
from syncer.wire.protocol import ProtocolError


def checksum(t: torch.Tensor) -> int:
    """crc32 of a CPU fp32 tensor's bytes (what the syncer sends with every version)."""
    return zlib.crc32(t.contiguous().numpy().data)  # .data: the array's buffer, as a memoryview


PENDING_MAX = 64
CRC_SLICE = 1 << 16  # values copied, then added to the crc, while still in the core's cache (256 KiB)


@dataclass
class Fetch:
    """A full-fragment transfer in progress."""

    version: int | None = None
    crc: int | None = None
    buffer: torch.Tensor | None = None
    received: int = 0
    next_offset: int = 0
    chunk: int = 0  # values per chunk, pinned by the first request (the last chunk is shorter)
    in_flight: dict[int, float] = field(default_factory=dict)  # offset -> requested at
    pending: list[tuple[int, int, bytes, int | None]] = field(default_factory=list)  # updates that came meanwhile
    crc_at: int = 0  # `running` is the crc32 of buffer[:crc_at]
    running: int = 0
    early: dict[int, int] = field(default_factory=dict)  # offset -> numel of chunks stored past crc_at

    def store(self, offset: int, values: np.ndarray) -> None:
        """Copy one chunk into the buffer, a cache-sized slice at a time, each slice added to the
        running crc right after its copy (in order) or later, when the gap before it is filled."""
        assert self.buffer is not None, "a fetch with a version has its buffer"  # set by the first chunk
        dest = self.buffer.numpy()
        in_order = offset == self.crc_at
        for start in range(offset, offset + values.size, CRC_SLICE):
            stop = min(start + CRC_SLICE, offset + values.size)
            dest[start:stop] = values[start - offset : stop - offset]
            if in_order:
                self.running = zlib.crc32(dest[start:stop].data, self.running)
        self.received += values.size
        if in_order:
            self.crc_at += values.size
        else:
            self.early[offset] = values.size
        while self.crc_at in self.early:
            n = self.early.pop(self.crc_at)
            self.running = zlib.crc32(dest[self.crc_at : self.crc_at + n].data, self.running)
            self.crc_at += n


class Replica:
    """Latest global value and version of every fragment; what still has to be fetched."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = list(sizes)
        self.latest: list[torch.Tensor | None] = [None] * len(sizes)
        self.versions: list[int] = [-1] * len(sizes)
        self.epoch: int | None = None
        self.fetches: dict[int, Fetch] = {}
        self.crcs: list[int | None] = [None] * len(sizes)
        self.mismatches = 0

    @property
    def count(self) -> int:
        return len(self.sizes)

    def complete(self) -> bool:
        return all(t is not None for t in self.latest)

    def refetch(self, p: int) -> None:
        """Schedule a full transfer of fragment p (restarting one in progress)."""
        self.fetches[p] = Fetch()

    def refetch_all(self) -> None:
        for p in range(self.count):
            self.refetch(p)

    def requests(self, now: float, chunk: int, window: int, timeout: float = 10.0) -> list[tuple[int, int, int]]:
        """(fragment, offset, version) state requests to send now, at most `window` in flight.

        The first chunk asks for the current version (-1); the rest ask for that same version,
        which the syncer keeps while one newer merge lands, so a transfer stays consistent."""
        out: list[tuple[int, int, int]] = []
        in_flight = 0
        for p in sorted(self.fetches):
            f = self.fetches[p]
            for offset, at in list(f.in_flight.items()):
                if now - at > timeout:  # lost (syncer restarted, message dropped): ask again
                    out.append((p, offset, -1 if f.version is None else f.version))
                    f.in_flight[offset] = now
            in_flight += len(f.in_flight)
        for p in sorted(self.fetches):
            f = self.fetches[p]
            f.chunk = f.chunk or chunk
            while in_flight < window and f.next_offset < self.sizes[p]:
                if f.version is None and f.in_flight:
                    break  # learn the version from the first chunk before asking for more
                out.append((p, f.next_offset, -1 if f.version is None else f.version))
                f.in_flight[f.next_offset] = now
                f.next_offset += f.chunk
                in_flight += 1
        return out

    def on_state(self, p: int, version: int, offset: int, values: np.ndarray, crc: int | None = None) -> bool:
        """Store one chunk; True when fragment p is complete and its checksum matches. A chunk
        that is not the size asked for raises ProtocolError (dropped; asked again after the timeout)."""
        f = self.fetches.get(p)
        if f is None or offset not in f.in_flight:
            return False  # a chunk we no longer want (refetch restarted it)
        if values.size != min(f.chunk, self.sizes[p] - offset):
            raise ProtocolError(
                "shape", f"state: chunk [{offset}, +{values.size}) of fragment {p} is not the chunk asked for"
            )
        if f.version is None:
            f.version, f.crc = version, crc
            f.buffer = torch.empty(self.sizes[p], dtype=torch.float32)
        elif version != f.version:  # our version is no longer kept: start this fragment again
            self.fetches[p] = Fetch(pending=f.pending)
            return False
        del f.in_flight[offset]
        f.store(offset, values)
        if f.received < self.sizes[p]:
            return False
        assert f.buffer is not None and f.crc_at == self.sizes[p], "every chunk stored, in the running crc"
        if f.crc is not None and f.running != f.crc:
            self.mismatches += 1
            self.fetches[p] = Fetch(pending=f.pending)  # corrupted in transit: fetch it again
            return False
        self.latest[p], self.versions[p], self.crcs[p] = f.buffer, f.version, f.crc
        del self.fetches[p]
        for from_version, version, blob, crc in sorted(f.pending, key=lambda u: u[1]):
            if self.on_update(p, from_version, version, blob, crc) in ("gap", "mismatch"):
                break  # a refetch is scheduled
        return True

    def on_update(self, p: int, from_version: int, version: int, blob: bytes, crc: int | None = None) -> str:
        """Apply an update blob: 'applied', 'stale' (already have it), 'gap' or 'mismatch'
        (a refetch is scheduled)."""
        if p in self.fetches:  # keep it for when the transfer completes (bounded)
            pending = self.fetches[p].pending
            pending.append((from_version, version, blob, crc))
            del pending[:-PENDING_MAX]
            return "buffered"
        current = self.latest[p]
        if current is None or version <= self.versions[p]:
            return "stale"
        if from_version != self.versions[p]:
            self.refetch(p)
            return "gap"
        change = codec.decode(blob, expect_numel=self.sizes[p])
        updated = current + change  # a separate fp32 add, as the syncer did
        self.latest[p] = updated
        self.versions[p] = version
        self.crcs[p] = crc
        if crc is not None and checksum(updated) != crc:
            self.mismatches += 1  # not bit-identical to the syncer: never train on it
            self.refetch(p)
            return "mismatch"
        return "applied"

    def behind(self, versions: list[int]) -> list[int]:
        """Fragments where the syncer reports a newer version than ours and no fetch is running."""
        if len(versions) != self.count:
            return []
        return [
            p
            for p in range(self.count)
            if versions[p] > self.versions[p] and p not in self.fetches and self.latest[p] is not None
        ]
