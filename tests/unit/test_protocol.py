"""Wire protocol: encode/decode round trip for every kind, and ProtocolError (with the expected
`reason`) for every malformation: wrong magic/version/kind, truncated headers, frame counts and
sizes that disagree with the header, bad JSON, missing or wrong-typed fields, and the fragment
layout checks (index/chunk out of range, size mismatch, NaN/Inf in raw fragments).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from syncer.wire import protocol as P
from syncer.wire.protocol import Message, ProtocolError

FAST = settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
FIXED = struct.Struct("<4sHBB")

VALID: dict[str, tuple[dict[str, Any], list[bytes]]] = {
    "hello": (
        {
            "learner": "learner-0",
            "incarnation": "abc",
            "run": "r",
            "pid": 12,
            "host": "h",
            "device": "cpu",
            "batch_size": 16,
            "codecs": ["int4"],
            "manifest": [["w", [2, 3], "dense"]],
            "fragments": 1,
        },
        [],
    ),
    "init": ({"fragment": 0, "offset": 0, "numel": 2, "total": 4}, [np.ones(2, "<f4").tobytes()]),
    "state_req": ({"fragment": 1, "offset": 1024}, []),
    "push": (
        {
            "fragment": 0,
            "base_version": 3,
            "seq": 7,
            "epoch": 1,
            "c_steps": 16,
            "c_tokens": 2048,
            "c_time": 1.5,
            "step_time": 0.1,
        },
        [b"\x01\x02\x03"],
    ),
    "heartbeat": ({"step": 10, "tokens": 100, "state": "running", "loss": 2.5}, []),
    "bye": ({"reason": "done"}, []),
    "welcome": (
        {"epoch": 1, "initialized": True, "init_owner": False, "versions": [0, 1], "chunk_numel": 1024, "step": 0},
        [],
    ),
    "state": (
        {"fragment": 0, "version": 2, "offset": 0, "numel": 2, "total": 2, "epoch": 1},
        [np.zeros(2, "<f4").tobytes()],
    ),
    "update": ({"fragment": 1, "version": 5, "from_version": 4, "epoch": 1, "contributors": ["a", "b"]}, [b"blob"]),
    "ack": ({"epoch": 2, "versions": [], "initialized": False}, []),
    "resync": ({"fragment": -1, "reason": "nan"}, []),
    "error": ({"reason": "no", "fatal": True}, []),
    "call": ({"fragment": 1, "epoch": 2, "version": 7}, []),
    "units": ({"units": [3, 4], "drop": []}, []),
    "quarantine": ({"seconds": 30.0, "reason": "3 contributions rejected"}, []),
    "status_req": ({}, []),
    "status": ({"snapshot": {"run": "r", "nested": {"a": [1, 2.5, None]}}}, []),
    "control": ({"action": "fleet", "learners": ["learner-0"]}, []),
    "control_rep": ({"ok": True, "detail": "fine"}, []),
}


def _frames(kind: str, meta: dict | None = None, payloads: list[bytes] | None = None) -> list[bytes]:
    m, p = VALID[kind]
    return P.encode(Message(kind, dict(m) if meta is None else meta, list(p) if payloads is None else payloads))


def _raw_header(
    code: int,
    count: int,
    body: bytes,
    lengths: list[int] | None = None,
    magic: bytes = P.MAGIC,
    version: int = P.VERSION,
) -> bytes:
    lengths = [0] * count if lengths is None else lengths
    return FIXED.pack(magic, version, code, count) + struct.pack(f"<{len(lengths)}Q", *lengths) + body


def _reason(frames: list[Any]) -> str:
    with pytest.raises(ProtocolError) as info:
        P.decode(frames)
    return info.value.reason


# -- round trip ----------------------------------------------------------------------------------


def test_valid_table_covers_every_kind() -> None:
    assert set(VALID) == set(P.SCHEMAS)
    codes = [code for code, _ in P.SCHEMAS.values()]
    assert len(codes) == len(set(codes)) and all(0 <= c < 256 for c in codes)


@pytest.mark.parametrize("kind", sorted(P.SCHEMAS))
def test_round_trip_every_kind(kind: str) -> None:
    meta, payloads = VALID[kind]
    frames = P.encode(Message(kind, meta, payloads))
    assert len(frames) == 1 + len(payloads)
    msg = P.decode(frames)
    assert msg.kind == kind and msg.meta == meta and msg.payloads == payloads

    # other frame types carry the same bytes (zmq gives memoryview-like frames or zmq.Frame)
    class FakeZmqFrame:
        def __init__(self, data: bytes) -> None:
            self.bytes = data

    for convert in (memoryview, bytearray, FakeZmqFrame):
        again = P.decode([convert(f) for f in frames])
        assert (again.kind, again.meta, again.payloads) == (kind, meta, payloads)


def test_header_layout() -> None:
    frames = _frames("push")
    magic, version, code, count = FIXED.unpack_from(frames[0])
    assert (magic, version, code, count) == (b"DLDC", 1, 4, 1)
    (length,) = struct.unpack_from("<Q", frames[0], FIXED.size)
    assert length == 3
    assert json.loads(frames[0][FIXED.size + 8 :]) == VALID["push"][0]


def test_message_accessors_and_control_helper() -> None:
    msg = P.decode(_frames("control"))
    assert msg["action"] == "fleet" and msg.get("missing", 5) == 5
    c = P.control("checkpoint", force=True)
    assert c.kind == "control" and c.meta == {"action": "checkpoint", "force": True}
    assert P.decode(P.encode(c)).meta == c.meta


def test_numbers_accept_int_for_float_fields_and_extra_fields() -> None:
    meta = dict(VALID["push"][0], c_time=2, step_time=0, extra="kept")
    assert P.decode(_frames("push", meta))["c_time"] == 2
    assert P.decode(_frames("push", meta))["extra"] == "kept"


# -- framing malformations -----------------------------------------------------------------------


def test_empty_and_truncated_header() -> None:
    assert _reason([]) == "empty"
    header = _frames("bye")[0]
    for cut in range(FIXED.size):
        assert _reason([header[:cut]]) == "truncated"


def test_oversized_header() -> None:
    body = json.dumps({"reason": "x" * (P.MAX_HEADER + 10)}).encode()
    assert _reason([_raw_header(6, 0, body)]) == "oversized"


def test_bad_magic_version_kind() -> None:
    body = b'{"reason":"x"}'
    assert _reason([_raw_header(6, 0, body, magic=b"DLDX")]) == "bad_magic"
    assert _reason([_raw_header(6, 0, body, version=2)]) == "version"
    assert _reason([_raw_header(6, 0, body, version=0)]) == "version"
    assert _reason([_raw_header(99, 0, body)]) == "unknown_kind"
    assert _reason([_raw_header(0, 0, body)]) == "unknown_kind"


def test_payload_lengths_truncated_or_too_many() -> None:
    # header announces 2 payloads but only has room for one length
    header = FIXED.pack(P.MAGIC, P.VERSION, 4, 2) + struct.pack("<Q", 3)
    assert _reason([header, b"abc", b"def"]) == "truncated"
    # more payloads than allowed
    header = _raw_header(4, P.MAX_PAYLOADS + 1, b"{}")
    assert _reason([header] + [b""] * (P.MAX_PAYLOADS + 1)) == "truncated"


def test_frame_count_mismatch() -> None:
    frames = _frames("push")
    assert _reason(frames[:1]) == "frame_count"  # payload missing
    assert _reason([*frames, b"extra"]) == "frame_count"  # one too many
    assert _reason([*_frames("bye"), b"x"]) == "frame_count"


def test_payload_size_mismatch() -> None:
    frames = _frames("push")
    assert _reason([frames[0], frames[1][:-1]]) == "size"
    assert _reason([frames[0], frames[1] + b"\0"]) == "size"
    assert _reason([frames[0], b""]) == "size"


# -- JSON and schema malformations ---------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"not json",
        b"\xff\xfe{}",
        b'{"reason": "x"',
        b'{"reason":"x"} trailing',
        b'{"reason":"x","v":NaN}',
        b'{"reason":"x","v":Infinity}',
        b'{"reason":"x","v":-Infinity}',
        b'{"reason":"x","v":1e999}',
        b'{"reason":"x","v":-1e400}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 30_000 + b"1" + b"}" * 30_000,
    ],
)
def test_bad_json(body: bytes) -> None:
    assert _reason([_raw_header(6, 0, body)]) == "bad_json"


def test_non_finite_float_in_typed_field_is_bad_json() -> None:
    # step_time = 1e999 used to arrive as inf and make the grace window infinite
    body = json.dumps(VALID["push"][0]).replace('"step_time": 0.1', '"step_time": 1e999').encode()
    assert b"1e999" in body
    assert _reason([_raw_header(4, 1, body, [3]), b"abc"]) == "bad_json"


@pytest.mark.parametrize("body", [b"[]", b"[1, 2]", b'"reason"', b"3", b"null", b"true"])
def test_metadata_must_be_an_object(body: bytes) -> None:
    assert _reason([_raw_header(6, 0, body)]) == "schema"


@pytest.mark.parametrize("kind", sorted(k for k in P.SCHEMAS if P.SCHEMAS[k][1]))
def test_every_missing_field_is_a_schema_error(kind: str) -> None:
    meta, payloads = VALID[kind]
    code = P.SCHEMAS[kind][0]
    for key in P.SCHEMAS[kind][1]:
        broken = {k: v for k, v in meta.items() if k != key}
        header = _raw_header(code, len(payloads), json.dumps(broken).encode(), [len(p) for p in payloads])
        assert _reason([header, *payloads]) == "schema", key
        with pytest.raises(ProtocolError) as info:
            P.encode(Message(kind, broken, payloads))
        assert info.value.reason == "schema"


_WRONG: dict[type, list[Any]] = {
    int: ["1", 1.0, True, None, [1], 1 << 62, -(1 << 62)],
    str: [1, None, ["x"], True],
    bool: [1, 0, "true", None],
    list: [{}, "[]", 1, None],
    dict: [[], "{}", 1, None],
    float: ["1.0", True, None, [1.0]],
}


@pytest.mark.parametrize("kind", sorted(k for k in P.SCHEMAS if P.SCHEMAS[k][1]))
def test_every_wrong_type_is_a_schema_error(kind: str) -> None:
    meta, payloads = VALID[kind]
    code = P.SCHEMAS[kind][0]
    for key, types in P.SCHEMAS[kind][1].items():
        for value in _WRONG[float if types == P._NUM else types[0]]:
            broken = dict(meta, **{key: value})
            header = _raw_header(code, len(payloads), json.dumps(broken).encode(), [len(p) for p in payloads])
            assert _reason([header, *payloads]) == "schema", (key, value)


def test_large_ints_in_range_are_accepted() -> None:
    meta = dict(VALID["push"][0], seq=(1 << 62) - 1, base_version=-(1 << 62) + 1)
    assert P.decode(_frames("push", meta))["seq"] == (1 << 62) - 1
    huge = "9" * 5000  # longer than Python's int-from-str limit
    body = json.dumps(VALID["bye"][0]).replace('"done"', '"done", "n": ' + huge).encode()
    assert _reason([_raw_header(6, 0, body)]) == "bad_json"


# -- encode refuses bad messages -----------------------------------------------------------------


def test_encode_refuses() -> None:
    with pytest.raises(ProtocolError) as info:
        P.encode(Message("nope", {}))
    assert info.value.reason == "unknown_kind"
    with pytest.raises(ProtocolError) as info:
        P.encode(Message("push", dict(VALID["push"][0], c_steps="16"), [b""]))
    assert info.value.reason == "schema"
    with pytest.raises(ProtocolError) as info:
        P.encode(Message("status_req", {}, [b""] * (P.MAX_PAYLOADS + 1)))
    assert info.value.reason == "too_many_payloads"
    # NaN is never put on the wire (json allow_nan=False); it is a ValueError, not garbage
    with pytest.raises(ValueError):
        P.encode(Message("push", dict(VALID["push"][0], c_time=float("nan")), [b""]))


# -- fragment layout checks ----------------------------------------------------------------------


def _chunk(kind: str, fragment: int, offset: int, numel: int, total: int, values: np.ndarray | None = None) -> Message:
    if values is None:
        values = np.arange(numel, dtype="<f4")
    meta = {"fragment": fragment, "offset": offset, "numel": numel, "total": total}
    if kind == "state":
        meta.update(version=1, epoch=1)
    return P.decode(P.encode(Message(kind, meta, [values.astype("<f4").tobytes()])))


@pytest.mark.parametrize("kind", ["init", "state"])
def test_check_raw_fragment_valid(kind: str) -> None:
    values = P.check_raw_fragment(_chunk(kind, 1, 2, 3, 5), [4, 5])
    assert values.dtype == np.dtype("<f4") and values.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("kind", ["init", "state"])
@pytest.mark.parametrize(
    ("fragment", "offset", "numel", "total", "n_values"),
    [
        (2, 0, 1, 4, 1),  # fragment index past the end
        (-1, 0, 1, 4, 1),  # negative fragment index
        (0, 0, 1, 5, 1),  # total disagrees with the layout
        (0, 0, 0, 4, 0),  # empty chunk
        (0, -1, 2, 4, 2),  # negative offset
        (0, 3, 2, 4, 2),  # chunk runs past the fragment
        (0, 4, 1, 4, 1),  # chunk starts at the end
        (0, 0, 2, 4, 3),  # payload holds more values than numel says
        (0, 0, 2, 4, 1),  # ... or fewer
    ],
)
def test_check_raw_fragment_shape_errors(
    kind: str, fragment: int, offset: int, numel: int, total: int, n_values: int
) -> None:
    msg = _chunk(kind, fragment, offset, numel, total, np.zeros(n_values, "<f4"))
    with pytest.raises(ProtocolError) as info:
        P.check_raw_fragment(msg, [4, 2])
    assert info.value.reason == "shape"


def test_check_raw_fragment_payload_count_and_odd_bytes() -> None:
    msg = Message("init", {"fragment": 0, "offset": 0, "numel": 2, "total": 4}, [])
    with pytest.raises(ProtocolError) as info:
        P.check_raw_fragment(msg, [4])
    assert info.value.reason == "shape"
    msg = Message("init", {"fragment": 0, "offset": 0, "numel": 2, "total": 4}, [b"\0" * 7])
    with pytest.raises(ProtocolError):
        P.check_raw_fragment(msg, [4])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_check_raw_fragment_non_finite(bad: float) -> None:
    values = np.array([1.0, bad, 3.0], dtype="<f4")
    with pytest.raises(ProtocolError) as info:
        P.check_raw_fragment(_chunk("state", 0, 0, 3, 3, values), [3])
    assert info.value.reason == "nan"


def test_check_fragment_index() -> None:
    assert P.check_fragment_index(P.decode(_frames("state_req")), 2) == 1
    for p in (-1, 2, 100):
        with pytest.raises(ProtocolError) as info:
            P.check_fragment_index(Message("push", {"fragment": p}), 2)
        assert info.value.reason == "shape"


# -- hypothesis: nothing but ProtocolError -------------------------------------------------------


def _decode_only_protocol_errors(frames: list[Any]) -> None:
    try:
        msg = P.decode(frames)
    except ProtocolError as exc:
        assert exc.reason and isinstance(exc.reason, str)
        return
    assert msg.kind in P.SCHEMAS
    assert len(msg.payloads) == len(frames) - 1


@FAST
@given(frames=st.lists(st.binary(max_size=64), max_size=4))
def test_property_random_frames(frames: list[bytes]) -> None:
    _decode_only_protocol_errors(frames)


@FAST
@given(
    code=st.integers(0, 255),
    count=st.integers(0, 3),
    body=st.binary(max_size=80),
    payloads=st.lists(st.binary(max_size=8), max_size=3),
)
def test_property_random_bodies_after_a_valid_prefix(code: int, count: int, body: bytes, payloads: list[bytes]) -> None:
    header = _raw_header(code, count, body, [len(p) for p in payloads][:count] + [0] * max(0, count - len(payloads)))
    _decode_only_protocol_errors([header, *payloads])


@FAST
@given(
    kind=st.sampled_from(sorted(P.SCHEMAS)),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 10_000)),
    frame_ops=st.sampled_from(["keep", "drop_last", "add", "duplicate_header"]),
)
def test_property_mutated_valid_frames(
    kind: str, edits: list[tuple[int, int]], cut: int | None, frame_ops: str
) -> None:
    frames = _frames(kind)
    header = bytearray(frames[0])
    for pos, value in edits:
        header[pos % len(header)] = value
    if cut is not None:
        header = header[: cut % (len(header) + 1)]
    out: list[bytes] = [bytes(header), *frames[1:]]
    if frame_ops == "drop_last" and len(out) > 1:
        out.pop()
    elif frame_ops == "add":
        out.append(b"x")
    elif frame_ops == "duplicate_header":
        out.insert(1, bytes(header))
    _decode_only_protocol_errors(out)


@FAST
@given(
    meta=st.dictionaries(
        st.text(max_size=12),
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers()
            | st.floats(allow_nan=False, allow_infinity=False)
            | st.text(max_size=8),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
            max_leaves=10,
        ),
        max_size=6,
    ),
    kind=st.sampled_from(sorted(P.SCHEMAS)),
)
def test_property_arbitrary_json_metadata(meta: dict, kind: str) -> None:
    body = json.dumps(meta).encode()
    payloads = VALID[kind][1]
    header = _raw_header(P.SCHEMAS[kind][0], len(payloads), body, [len(p) for p in payloads])
    _decode_only_protocol_errors([header, *payloads])


def test_raw_chunks_of_zmq_frames_decode_as_views_and_others_as_bytes() -> None:
    """`state`/`init` payloads of received zmq.Frames are read in place (no copy); every other
    kind's payloads are bytes; `blob()` gives bytes either way."""
    import zmq

    values = np.arange(6, dtype="<f4")
    meta = {"fragment": 0, "version": 3, "offset": 0, "numel": 6, "total": 6, "epoch": 1}
    view = memoryview(values).cast("B")  # what the syncer sends: a view of its fp32 values
    frames = P.encode(Message("state", meta, [view]))
    assert struct.unpack_from("<Q", frames[0], FIXED.size)[0] == 24 and frames[1] is view
    received = [zmq.Frame(bytes(f)) for f in frames]
    msg = P.decode(received)
    payload = msg.payloads[0]
    assert isinstance(payload, memoryview) and payload.obj is received[1]
    assert P.check_raw_fragment(msg, [6]).tolist() == values.tolist() and msg.blob() == values.tobytes()
    update = P.decode([zmq.Frame(bytes(f)) for f in P.encode(Message("update", *_update()))])
    assert isinstance(update.payloads[0], bytes) and update.blob() == b"blob"
    short = [received[0], zmq.Frame(b"\0" * 20)]
    with pytest.raises(ProtocolError) as exc:
        P.decode(short)
    assert exc.value.reason == "size"


def _update() -> tuple[dict[str, Any], list[bytes]]:
    return {"fragment": 0, "version": 1, "from_version": 0, "epoch": 1, "contributors": []}, [b"blob"]
