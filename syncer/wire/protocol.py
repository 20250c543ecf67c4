"""Wire protocol between learners, the syncer and the operator (a leaf: stdlib + numpy only;
numpy imported where a raw chunk is checked, so that the operator's commands start without it).

A message is a list of ZeroMQ frames: one small header frame, then zero or more payload frames
(tensor bytes, codec blobs). `encode` and `decode` are pure and never touch a socket.

    header = b"DLDC" | protocol version (u16) | kind (u8) | payload count (u8)
             | payload lengths (u64 each) | JSON metadata (utf-8 object)

Raw fp32 chunks (`init`, `state`) travel without copies: `encode` takes payloads that are views
of a buffer (memoryview), and `decode` keeps such payloads of a received zmq.Frame as a view of
the frame; every other payload decodes to bytes.

`decode` raises ProtocolError (with a short `reason` used as a metrics counter) for anything
malformed: bad magic, other protocol version, unknown kind, missing or extra frames, payload
sizes that disagree with the header, metadata that misses a field or has the wrong type.
`check_raw_fragment` adds the checks that need the fragment layout: index in range, chunk
within the fragment, size matches, values finite.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

MAGIC = b"DLDC"
VERSION = 1
MAX_HEADER = 256 * 1024
MAX_PAYLOADS = 16
RAW_KINDS = frozenset({"init", "state"})  # fp32 chunks: decoded as views of the received frames
_FIXED = struct.Struct("<4sHBB")

_NUM = (int, float)
# kind -> (code, required metadata fields and their types)
SCHEMAS: dict[str, tuple[int, dict[str, tuple[type, ...]]]] = {
    # learner -> syncer
    "hello": (
        1,
        {
            "learner": (str,),
            "incarnation": (str,),
            "run": (str,),
            "pid": (int,),
            "host": (str,),
            "device": (str,),
            "batch_size": (int,),
            "codecs": (list,),
            "manifest": (list,),
            "fragments": (int,),
        },
    ),
    "init": (2, {"fragment": (int,), "offset": (int,), "numel": (int,), "total": (int,)}),
    "state_req": (3, {"fragment": (int,), "offset": (int,)}),
    "push": (
        4,
        {
            "fragment": (int,),
            "base_version": (int,),
            "seq": (int,),
            "epoch": (int,),
            "c_steps": (int,),
            "c_tokens": (int,),
            "c_time": _NUM,
            "step_time": _NUM,
        },
    ),
    "heartbeat": (5, {"step": (int,), "tokens": (int,), "state": (str,)}),
    "bye": (6, {"reason": (str,)}),  # the syncer echoes it back as a receipt
    # syncer -> learner
    "welcome": (
        10,
        {
            "epoch": (int,),
            "initialized": (bool,),
            "init_owner": (bool,),
            "versions": (list,),
            "chunk_numel": (int,),
            "step": (int,),
        },
    ),
    "state": (
        11,
        {"fragment": (int,), "version": (int,), "offset": (int,), "numel": (int,), "total": (int,), "epoch": (int,)},
    ),
    "update": (
        12,
        {"fragment": (int,), "version": (int,), "from_version": (int,), "epoch": (int,), "contributors": (list,)},
    ),
    "ack": (13, {"epoch": (int,), "versions": (list,), "initialized": (bool,)}),
    "resync": (14, {"fragment": (int,), "reason": (str,)}),
    "error": (15, {"reason": (str,), "fatal": (bool,)}),
    "call": (16, {"fragment": (int,), "epoch": (int,), "version": (int,)}),  # the round clock: push p now
    "units": (17, {"units": (list,), "drop": (list,)}),  # the data ledger: work units to train, to drop
    "quarantine": (18, {"seconds": _NUM, "reason": (str,)}),  # the screen shut this learner out (syncer/screening.py)
    # operator <-> syncer (control socket)
    "status_req": (20, {}),
    "status": (21, {"snapshot": (dict,)}),
    "control": (22, {"action": (str,)}),
    "control_rep": (23, {"ok": (bool,), "detail": (str,)}),
}
KINDS = {code: kind for kind, (code, _) in SCHEMAS.items()}
Payload = bytes | memoryview  # a payload frame's content: bytes, or a byte view of a buffer (no copy)


class ProtocolError(ValueError):
    """A message that must be dropped; `reason` is a short counter name."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


@dataclass
class Message:
    """One protocol message: a kind, JSON metadata and opaque payload frames."""

    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    payloads: list[Payload] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return self.meta[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key, default)

    def blob(self, i: int = 0) -> bytes:
        """Payload i as bytes: as decoded for every kind but RAW_KINDS (a view is copied)."""
        payload = self.payloads[i]
        return payload if isinstance(payload, bytes) else bytes(payload)


def encode(msg: Message) -> list[Payload]:
    """Frames for `msg` (validated against its schema, so a bug cannot emit garbage)."""
    if msg.kind not in SCHEMAS:
        raise ProtocolError("unknown_kind", f"cannot encode kind {msg.kind!r}")
    _check_meta(msg.kind, msg.meta)
    if len(msg.payloads) > MAX_PAYLOADS:
        raise ProtocolError("too_many_payloads", f"{len(msg.payloads)} > {MAX_PAYLOADS}")
    code = SCHEMAS[msg.kind][0]
    body = json.dumps(msg.meta, separators=(",", ":"), allow_nan=False).encode()
    lengths = struct.pack(f"<{len(msg.payloads)}Q", *(_nbytes(p) for p in msg.payloads))
    header = _FIXED.pack(MAGIC, VERSION, code, len(msg.payloads)) + lengths + body
    return [header, *msg.payloads]


def decode(frames: Sequence[Any]) -> Message:
    """Parse frames (bytes, memoryview or zmq.Frame) into a Message, or raise ProtocolError."""
    if not frames:
        raise ProtocolError("empty", "no frames")
    header = _bytes(frames[0])
    if len(header) < _FIXED.size:
        raise ProtocolError("truncated", f"header of {len(header)} bytes")
    if len(header) > MAX_HEADER:
        raise ProtocolError("oversized", f"header of {len(header)} bytes")
    magic, version, code, count = _FIXED.unpack_from(header)
    if magic != MAGIC:
        raise ProtocolError("bad_magic", f"magic {magic!r}")
    if version != VERSION:
        raise ProtocolError("version", f"protocol version {version}, this side speaks {VERSION}")
    if code not in KINDS:
        raise ProtocolError("unknown_kind", f"kind code {code}")
    kind = KINDS[code]
    end = _FIXED.size + 8 * count
    if count > MAX_PAYLOADS or len(header) < end:
        raise ProtocolError("truncated", f"header announces {count} payloads")
    lengths = struct.unpack_from(f"<{count}Q", header, _FIXED.size)
    payloads = [_view(f) if kind in RAW_KINDS else _bytes(f) for f in frames[1:]]
    if len(payloads) != count:
        raise ProtocolError("frame_count", f"{kind}: header announces {count} payloads, got {len(payloads)}")
    for i, (want, got) in enumerate(zip(lengths, payloads)):
        if want != _nbytes(got):
            raise ProtocolError("size", f"{kind}: payload {i} is {_nbytes(got)} bytes, header says {want}")
    meta = _parse_meta(kind, header[end:])
    return Message(kind, meta, payloads)


def _bytes(frame: Any) -> bytes:
    if isinstance(frame, bytes):
        return frame
    if hasattr(frame, "bytes"):  # zmq.Frame
        data: bytes = frame.bytes
        return data
    return bytes(frame)


def _view(frame: Any) -> Payload:
    """A received zmq.Frame's content as a view of the frame (no copy); anything else as bytes."""
    buffer = getattr(frame, "buffer", None)  # zmq.Frame (this leaf does not import zmq)
    if isinstance(buffer, memoryview):
        return buffer.cast("B") if buffer.format != "B" else buffer
    return _bytes(frame)


def _nbytes(payload: Payload) -> int:
    return payload.nbytes if isinstance(payload, memoryview) else len(payload)


def _parse_meta(kind: str, body: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(body.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise ProtocolError("bad_json", f"{kind}: {exc}") from None
    except RecursionError:  # deeply nested arrays/objects
        raise ProtocolError("bad_json", f"{kind}: metadata nested too deeply") from None
    if not isinstance(meta, dict):
        raise ProtocolError("schema", f"{kind}: metadata must be an object")
    _check_meta(kind, meta)
    return meta


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf without passing through parse_constant
        raise ValueError(f"{text} is not a finite number")
    return value


def _check_meta(kind: str, meta: dict[str, Any]) -> None:
    for key, types in SCHEMAS[kind][1].items():
        if key not in meta:
            raise ProtocolError("schema", f"{kind}: missing field {key!r}")
        value = meta[key]
        if isinstance(value, bool) and bool not in types:
            raise ProtocolError("schema", f"{kind}: field {key!r} must be {types[0].__name__}")
        if not isinstance(value, types):
            raise ProtocolError("schema", f"{kind}: field {key!r} must be {types[0].__name__}")
        if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 62) < value < 1 << 62:
            raise ProtocolError("schema", f"{kind}: field {key!r} out of range")


def check_raw_fragment(msg: Message, sizes: Sequence[int]) -> np.ndarray:
    """For `init`/`state` chunks: validate against the fragment layout; return the fp32 values."""
    p, offset, numel, total = msg["fragment"], msg["offset"], msg["numel"], msg["total"]
    if not 0 <= p < len(sizes):
        raise ProtocolError("shape", f"{msg.kind}: fragment {p} out of range 0..{len(sizes) - 1}")
    if total != sizes[p]:
        raise ProtocolError("shape", f"{msg.kind}: fragment {p} has {sizes[p]} values, message says {total}")
    if numel <= 0 or offset < 0 or offset + numel > total:
        raise ProtocolError("shape", f"{msg.kind}: chunk [{offset}, {offset + numel}) outside fragment {p}")
    if len(msg.payloads) != 1 or _nbytes(msg.payloads[0]) != 4 * numel:
        raise ProtocolError("shape", f"{msg.kind}: payload is not {numel} fp32 values")
    import numpy as np  # a dict lookup once imported

    values = np.frombuffer(msg.payloads[0], dtype="<f4")  # read-only; a view of the frame where it was one
    if not np.isfinite(values).all():
        raise ProtocolError("nan", f"{msg.kind}: fragment {p} holds NaN or Inf")
    return values


def check_fragment_index(msg: Message, count: int) -> int:
    """The message's fragment index, validated against the number of fragments."""
    p: int = msg["fragment"]  # an int: decode checked the schema
    if not 0 <= p < count:
        raise ProtocolError("shape", f"{msg.kind}: fragment {p} out of range 0..{count - 1}")
    return p


def control(action: str, **args: Any) -> Message:
    """A control request for the syncer's operator socket."""
    return Message("control", {"action": action, **args})
