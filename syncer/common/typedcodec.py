"""One codec for the frozen settings dataclasses, driven by their fields' types and metadata
(a leaf: stdlib only; pure, no I/O).

    from_mapping(cls, data, table)  a plain dict (TOML, JSON) -> `cls`: unknown keys refused with a
                                    "did you mean", each value checked against its annotation (int,
                                    float (ints widened), bool, str, Literal, an Enum (by value),
                                    optional, tuple/list, dict/Mapping, a nested dataclass, also
                                    inside a dict: `procs['learner-0'].kind`), required fields present
    check_fields(obj, path)         each field's value against its `checked(...)` rule: bounds,
                                    Literal choices, a pattern, a multiple; nested dataclasses too
    to_mapping(obj)                 back to a plain, JSON-ready dict (tuples as lists, enums as
                                    their values); a field marked `omit_default` is left out while
                                    it holds its default

A field's rule may also say how it is stored: `key` (its name in the file, where that differs from
the attribute's) and `transient` (never written, and not a key the file may hold).

A field's rule is declared where the field is (`H: int = checked(64, ge=1)`), so a new setting
needs no new check written by hand; rules that relate two fields stay explicit in their class.
Every failure is a `SettingsError` whose message is one line: `[key.path] problem (fix)`, e.g.
`[run.quorum] must be >= 1, got 0` or `[run.merge] 'avg' is not one of rda, mean (set merge = 'rda')`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar

T = TypeVar("T")
RULE = "rule"  # the metadata key a `checked` field's Rule sits under


class SettingsError(ValueError):
    """A settings value is wrong: `key` names it, `fix` says what to do."""

    def __init__(self, key: str | None, problem: str, fix: str | None = None) -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        where = f"[{key}] " if key else ""
        super().__init__(f"{where}{problem}" + (f" ({fix})" if fix else ""))


@dataclass(frozen=True)
class Rule:
    """What a field's value may be beyond its type. `also`: values allowed outside the bounds,
    each with its meaning (`((0, "off"),)`); `allowed`: how to say what is allowed where the
    bounds or the pattern do not say it well; `note`: what a special value means, shown in
    parentheses; `nonblank`: a non-empty string must not be only spaces. How it is stored:
    `key`, its name in the file where that is not the field's; `transient`, never stored."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    also: tuple[tuple[Any, str], ...] = ()
    multiple_of: int | None = None
    pattern: str | None = None
    nonblank: bool = False
    allowed: str = ""
    unit: str = ""
    note: str = ""
    fix: str | None = None
    omit_default: bool = False
    key: str | None = None
    transient: bool = False


NO_RULE = Rule()


def _rule(f: dataclasses.Field[Any]) -> Rule:
    """A field's Rule (the empty one where it has none)."""
    rule: Rule = f.metadata.get(RULE, NO_RULE)
    return rule


_STORED: dict[type, dict[str, dataclasses.Field[Any]]] = {}
_HINTS: dict[type, dict[str, Any]] = {}


def _stored(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The fields of the dataclass `cls` the file holds, by their key in it (transient ones left
    out); computed once per class (a state file decodes many records), so never change the dict."""
    if cls not in _STORED:
        _STORED[cls] = {_rule(f).key or f.name: f for f in fields(cls) if not _rule(f).transient}
    return _STORED[cls]


def meta(**rule: Any) -> dict[str, Rule]:
    """Field metadata holding `Rule(**rule)`, for `field(default_factory=..., metadata=meta(...))`."""
    return {RULE: Rule(**rule)}


def checked(default: T, **rule: Any) -> T:
    """A field with `default` and the rule `Rule(**rule)`; typed as its default, so that
    `H: int = checked(64, ge=1)` reads (and type-checks) as `H: int = 64`."""
    return dataclasses.field(default=default, metadata=meta(**rule))


def suggest(name: str, candidates: list[str]) -> str | None:
    """The closest known name to a misspelled one, if any is close."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in candidates}
        return lowered.get(name.lower())
    return close[0]


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


# -- decoding: a dict to the dataclass, every value checked against its annotation ---------------
class _Mismatch(Exception):
    """A value that does not fit its annotation (turned into a SettingsError naming the key);
    `problem` says how, where "must be <type>" would not say it well."""

    def __init__(self, problem: str = "") -> None:
        super().__init__(problem)
        self.problem = problem


_SCALARS = (str, int, float, bool)


def _hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass, resolved once per class."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _decode(value: Any, hint: Any, path: str) -> Any:
    """`value` as `hint` says (ints widened to floats, lists to tuples); _Mismatch if it does not fit."""
    if type(value) is hint and hint in _SCALARS:
        return value  # the common case first: a state file has thousands of these
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None  # before a table's arm, which would call None not a table
        for arm in typing.get_args(hint):
            try:
                return _decode(value, arm, path)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is Literal:  # the choices are checked by check_fields, the type here
        return _decode(value, type(typing.get_args(hint)[0]), path)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return from_mapping(hint, value, path)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _decode_enum(value, hint)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        arm = (typing.get_args(hint) or (Any,))[0]
        return tuple(_decode(v, arm, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping) or hint is dict:
        return _decode_dict(value, hint, path)
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float) and isinstance(value, bool):
        raise _Mismatch
    if hint is type(None) and value is None:
        return value
    if hint is not type(None) and isinstance(value, hint):
        return value
    raise _Mismatch


def _decode_dict(value: Any, hint: Any, path: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise _Mismatch
    key_type, value_type = typing.get_args(hint) or (Any, Any)
    return {_decode(k, key_type, path): _decode(v, value_type, f"{path}[{k!r}]") for k, v in value.items()}


def _decode_enum(value: Any, hint: type[enum.Enum]) -> enum.Enum:
    """The member whose value `value` is (its JSON form is the value itself)."""
    try:
        return hint(value)
    except (ValueError, TypeError):
        names = ", ".join(str(m.value) for m in hint)
        raise _Mismatch(f"{value!r} is not one of {names}") from None


def _type_name(hint: Any) -> str:
    """How an annotation reads in a message: `int`, `int | None`, `list[int]`, `str`."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(arm) for arm in typing.get_args(hint))
    if origin is Literal:
        return type(typing.get_args(hint)[0]).__name__
    if origin in (tuple, list):
        return f"list[{_type_name((typing.get_args(hint) or (Any,))[0])}]"
    if origin in (dict, Mapping) and typing.get_args(hint):
        return "dict[{}, {}]".format(*(_type_name(arg) for arg in typing.get_args(hint)))
    if hint is type(None):
        return "None"
    if isinstance(hint, type) and not typing.get_args(hint):
        return "table" if dataclasses.is_dataclass(hint) else hint.__name__
    return str(hint).replace("typing.", "")


def from_mapping(cls: type[T], data: Mapping[str, Any], table: str = "") -> T:
    """Build the frozen dataclass `cls` from `data`, strictly: unknown keys and wrong types fail."""
    if not isinstance(data, Mapping):
        raise SettingsError(table or None, f"must be a table, got {type(data).__name__}")
    stored = _stored(cls)
    known = list(stored)
    values: dict[str, Any] = {}
    for key, value in data.items():
        path = _join(table, key)
        if key not in stored:
            close = suggest(key, known)
            raise SettingsError(path, "unknown key", f"did you mean {close!r}?" if close else _known(known))
        values[stored[key].name] = _field_value(cls, key, stored[key], value, path)
    missing = [key for key, f in stored.items() if f.name not in values and _required(f)]
    if missing:
        add = f"add {missing[0]} = ... to [{table}]" if table else None
        raise SettingsError(_join(table, missing[0]), "is required", add)
    return cls(**values)


def _field_value(cls: type, key: str, f: dataclasses.Field[Any], value: Any, path: str) -> Any:
    """`value` decoded by the annotation of the field stored under `key`; SettingsError if it does not fit."""
    hint = _hints(cls)[f.name]
    try:
        return _decode(value, hint, path)
    except _Mismatch as exc:
        if exc.problem:
            raise SettingsError(path, exc.problem) from None
        kind = _type_name(hint)
        raise SettingsError(
            path, f"must be {kind}, got {type(value).__name__} {value!r}", _type_fix(f, key, kind)
        ) from None


def _known(known: list[str]) -> str:
    return f"known keys: {', '.join(known)}"


def _type_fix(f: dataclasses.Field[Any], key: str, kind: str) -> str:
    """How to write `key` right: its type, with the default as an example where there is one."""
    default = f.default
    if default is dataclasses.MISSING or not isinstance(default, (str, int, float)):
        return f"write {key} as {kind}"
    example = json.dumps(default)  # TOML and JSON agree on strings, numbers and booleans
    return f"write {key} as {kind}, e.g. {key} = {example}"


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


# -- checking: each field's value against its rule --------------------------------------------
def check_fields(obj: Any, path: str = "") -> None:
    """Check every field of the dataclass `obj` against its Literal choices and its `checked`
    rule, and every nested dataclass (`path.field`, `path.field[i]`, `path.field['name']`) the same way."""
    hints = _hints(obj.__class__)
    for f in fields(obj):
        value, key = getattr(obj, f.name), _join(path, _rule(f).key or f.name)
        _check_choices(value, hints[f.name], key, f)
        rule = f.metadata.get(RULE)
        if rule is not None:
            _check_rule(value, rule, key)
        if dataclasses.is_dataclass(value):
            check_fields(value, key)
        for at, item in _members(value):
            if dataclasses.is_dataclass(item):
                check_fields(item, f"{key}[{at!r}]")


def _members(value: Any) -> Iterable[tuple[Any, Any]]:
    """A tuple's items by index, a mapping's by key; nothing for any other value."""
    if isinstance(value, Mapping):
        return value.items()
    return enumerate(value) if isinstance(value, tuple) else ()


def _choices(hint: Any) -> tuple[Any, ...]:
    """The values a Literal annotation allows (with `bool` in a union: True and False); () if none."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(hint)
        if any(typing.get_origin(arm) is Literal for arm in arms):
            return tuple(v for arm in arms for v in ((True, False) if arm is bool else _choices(arm)))
    return ()


def _check_choices(value: Any, hint: Any, key: str, f: dataclasses.Field[Any]) -> None:
    allowed = _choices(hint)
    if allowed and not any(value == a and type(value) is type(a) for a in allowed):
        names = ", ".join(json.dumps(a) if isinstance(a, bool) or a == "" else str(a) for a in allowed)
        rule = f.metadata.get(RULE)
        fix = rule.fix if rule is not None and rule.fix is not None else f"set {f.name} = {f.default!r}"
        raise SettingsError(key, f"{value!r} is not one of {names}", fix)


def _check_rule(value: Any, rule: Rule, key: str) -> None:
    if isinstance(value, str):
        _check_text(value, rule, key)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_number(value, rule, key)


def _check_text(value: str, rule: Rule, key: str) -> None:
    if rule.nonblank and value != "" and not value.strip():
        raise SettingsError(key, "is blank", rule.fix)
    if rule.pattern is not None and re.fullmatch(rule.pattern, value) is None:
        raise SettingsError(key, f"{value!r} is not {rule.allowed}", rule.fix)


def _check_number(value: float, rule: Rule, key: str) -> None:
    if any(value == special for special, _ in rule.also):
        return
    ok = (
        (rule.ge is None or value >= rule.ge)
        and (rule.gt is None or value > rule.gt)
        and (rule.le is None or value <= rule.le)
        and (rule.lt is None or value < rule.lt)
        and (rule.multiple_of is None or value % rule.multiple_of == 0)
    )
    if not ok:
        raise SettingsError(key, f"must be {_allowed(rule)}, got {value}", rule.fix)


def _allowed(rule: Rule) -> str:
    """What a number may be, e.g. `>= 1`, `in [0, 1)`, `0 (off) or >= 2 sync periods (0 = auto)`."""
    low = f"[{rule.ge:g}" if rule.ge is not None else f"({rule.gt:g}" if rule.gt is not None else ""
    high = f"{rule.le:g}]" if rule.le is not None else f"{rule.lt:g})" if rule.lt is not None else ""
    if rule.allowed or not (low or high):
        bounds = rule.allowed
    elif low and high:
        bounds = f"in {low}, {high}"
    elif low:
        bounds = f"{'>=' if low[0] == '[' else '>'} {low[1:]}"
    else:
        bounds = f"{'<=' if high[-1] == ']' else '<'} {high[:-1]}"
    specials = "".join(f"{special} ({meaning}) or " for special, meaning in rule.also)
    unit = f" {rule.unit}" if rule.unit else ""
    note = f" ({rule.note})" if rule.note else ""
    return f"{specials}{bounds}{unit}{note}"


# -- encoding: back to a plain dict -------------------------------------------------------------
def to_mapping(obj: Any) -> dict[str, Any]:
    """The dataclass `obj` as a plain, JSON-ready dict (the inverse of `from_mapping`), each field
    under its key; a field whose rule says `omit_default` is left out while it holds its default."""
    out: dict[str, Any] = {}
    for key, f in _stored(type(obj)).items():
        value = getattr(obj, f.name)
        if _rule(f).omit_default and value == _default(f):
            continue
        out[key] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_mapping(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    return value


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default
