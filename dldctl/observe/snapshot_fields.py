"""How the typed snapshot's records read their JSON: one reader per kind of value, and the flat
record that is built from a JSON object by its fields' readers and written back to one.

This is where tolerance lives: a reader answers its default (None, 0, "", False, an empty tuple)
for a value that is absent, null, of the wrong type, NaN or infinite, so a record read from an
older or partial snapshot has defaults rather than raising, and the code that shows a record
reads typed attributes without guarding them. Every key a record does not type is kept, as it
came, in its `extra`, and written back: the JSON shape stays the same (docs/status.md).

Pure: no I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import field, fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def num(value: Any) -> float | None:
    """A finite JSON number as a float (None: absent, null, NaN, inf or not a number; nor a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def number(value: Any) -> float | None:
    """A finite JSON number as it came (an int stays an int, so the JSON written back is the
    same); None where `num` would answer None."""
    return value if num(value) is not None else None


def count(value: Any) -> int:
    """A JSON count as an int (a whole float too); 0 where it is absent or not a finite number."""
    number = num(value)
    return int(number) if number is not None else 0


def opt_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def opt_text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def flag(value: Any) -> bool:
    return value if isinstance(value, bool) else False


def ident(value: Any) -> str | int | None:
    """An id that a source writes as a string or a number (a scheduler's job id)."""
    return value if isinstance(value, (str, int)) and not isinstance(value, bool) else None


def texts(value: Any) -> tuple[str, ...]:
    """A list of strings (warnings, risks); other entries are left out."""
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


def numbers(value: Any) -> tuple[int | float, ...]:
    """A list of finite numbers as they came (ints stay ints); other entries are left out."""
    return tuple(v for v in value if num(v) is not None) if isinstance(value, list) else ()


def opt_numbers(value: Any) -> tuple[int | float, ...] | None:
    """`numbers`, or None where the value is not a list (a shard that owns no known fragments)."""
    return numbers(value) if isinstance(value, list) else None


def counts_by(value: Any) -> Mapping[str, float] | None:
    """An object of numbers by name (a counter per reason, tokens per learner); None if not one."""
    if not isinstance(value, Mapping):
        return None
    return {str(k): v for k, v in value.items() if num(v) is not None}


def rows(value: Any) -> list[Mapping[str, Any]]:
    """The objects of a JSON list (a missing list or stray entries are skipped)."""
    return [r for r in value if isinstance(r, Mapping)] if isinstance(value, list) else []


def records(cls: type[T]) -> Callable[[Any], tuple[T, ...]]:
    """The reader of a list of nested records."""
    return lambda value: tuple(read_record(cls, r) for r in rows(value))


def nested(cls: type, optional: bool = False) -> dict[str, Any]:
    """The metadata of a field holding a nested record, for `field(metadata=...)` (`optional`:
    None where the JSON has no object there)."""

    def reader(value: Any) -> Any:
        return None if optional and not isinstance(value, Mapping) else read_record(cls, value)

    return {"read": reader, "key": "", "sparse": optional}


def as_(reader: Callable[[Any], Any], key: str = "", sparse: bool = False) -> Any:
    """A typed field: how its JSON value is read, its JSON key where it differs from its name, and
    whether its JSON leaves it out while it is None (`sparse`: a figure only some sources give)."""
    return field(default_factory=lambda: reader(None), metadata={"read": reader, "key": key, "sparse": sparse})


def _key(f: Any) -> str:
    return str(f.metadata.get("key") or f.name)


_FIELDS: dict[type, tuple[Any, ...]] = {}


def _typed(cls: type) -> tuple[Any, ...]:
    """The typed fields of a record class (found once per class: a frame reads thousands of rows)."""
    if cls not in _FIELDS:
        _FIELDS[cls] = tuple(f for f in fields(cls) if "read" in f.metadata)
    return _FIELDS[cls]


def read_record(cls: type[T], data: Any) -> T:
    """An instance of the record `cls` from a JSON object: each typed field read by its reader,
    every other key kept in `extra` (a non-object reads as all defaults)."""
    d: Mapping[str, Any] = data if isinstance(data, Mapping) else {}
    typed = _typed(cls)
    names = {_key(f) for f in typed}
    values = {f.name: f.metadata["read"](d.get(_key(f))) for f in typed}
    values["extra"] = {k: v for k, v in d.items() if k not in names}
    return cls(**values)


def to_json(value: Any) -> Any:
    """A record (its `extra` keys, then its typed fields but a sparse one that is None), a tuple
    or a plain value as JSON."""
    if is_dataclass(value) and not isinstance(value, type) and hasattr(value, "extra"):
        out = dict(value.extra)
        for f in _typed(type(value)):
            if not (f.metadata["sparse"] and getattr(value, f.name) is None):
                out[_key(f)] = to_json(getattr(value, f.name))
        return out
    if isinstance(value, tuple):
        return [to_json(v) for v in value]
    if isinstance(value, Mapping):
        return dict(value)
    return value
