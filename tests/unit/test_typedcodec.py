"""The typed codec (syncer/common/typedcodec.py): a dict to a dataclass and back, each value checked
by its annotation and its field's rule, every failure one line naming the key path, the bad value
and what is allowed."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from syncer.common.typedcodec import SettingsError, check_fields, checked, from_mapping, meta, to_mapping

Mode = Literal["fast", "slow"]


@dataclass(frozen=True)
class Inner:
    """A nested table."""

    size: int = checked(2, ge=1)
    mode: Mode = "fast"


@dataclass(frozen=True)
class Outer:
    """A table with every kind of field the codec reads."""

    name: str = checked("a", pattern=r"[a-z]+", allowed="a lowercase word", fix='e.g. name = "abc"')
    path: str = checked("", nonblank=True)
    ratio: float = checked(0.5, ge=0, lt=1)
    count: int = checked(4, gt=0, unit="items", note="per round")
    level: float = checked(2.0, ge=1, also=((0, "off"), (-1, "all")))
    block: int = checked(8, ge=8, multiple_of=2, allowed="an even number >= 8")
    auto: bool | Literal["auto"] = "auto"
    maybe: str | None = checked(None, omit_default=True)
    sizes: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict, metadata=meta(omit_default=True))
    inner: Inner = Inner()
    items: tuple[Inner, ...] = ()
    extra: Inner | None = None


def _refused(cls: type, data: dict[str, Any], table: str = "t") -> SettingsError:
    with pytest.raises(SettingsError) as info:
        check_fields(from_mapping(cls, data, table), table)
    assert "\n" not in str(info.value)
    return info.value


def test_a_dict_round_trips_through_the_dataclass() -> None:
    data = {"name": "xy", "ratio": 0, "sizes": [1, 2], "env": {"A": "1"}, "inner": {"size": 3}}
    data |= {"items": [{"mode": "slow"}], "maybe": "m", "auto": False}
    value = from_mapping(Outer, data, "t")
    check_fields(value, "t")
    assert value.ratio == 0.0 and type(value.ratio) is float  # an int widened to the float it stands for
    assert value.sizes == (1, 2) and value.inner == Inner(3) and value.items == (Inner(mode="slow"),)
    again = json.loads(json.dumps(to_mapping(value)))
    assert (
        from_mapping(Outer, again) == value
        and again["sizes"] == [1, 2]
        and again["inner"] == {"size": 3, "mode": "fast"}
    )


def test_a_field_holding_its_default_is_left_out_only_where_marked() -> None:
    out = to_mapping(Outer())
    assert "maybe" not in out and "env" not in out and out["path"] == "" and out["items"] == []
    assert to_mapping(Outer(maybe="x", env={"A": "b"}))["maybe"] == "x"


@pytest.mark.parametrize(
    ("data", "line"),
    [
        ({"ratio": 1.0}, "[t.ratio] must be in [0, 1), got 1.0"),
        ({"ratio": -0.5}, "[t.ratio] must be in [0, 1), got -0.5"),
        ({"count": 0}, "[t.count] must be > 0 items (per round), got 0"),
        ({"level": 0.5}, "[t.level] must be 0 (off) or -1 (all) or >= 1, got 0.5"),
        ({"block": 9}, "[t.block] must be an even number >= 8, got 9"),
        ({"block": 6}, "[t.block] must be an even number >= 8, got 6"),
        ({"name": "A b"}, "[t.name] 'A b' is not a lowercase word (e.g. name = \"abc\")"),
        ({"path": "  "}, "[t.path] is blank"),
        ({"auto": "yes"}, "[t.auto] 'yes' is not one of true, false, auto (set auto = 'auto')"),
        ({"inner": {"mode": "warp"}}, "[t.inner.mode] 'warp' is not one of fast, slow (set mode = 'fast')"),
        ({"items": [{}, {"size": 0}]}, "[t.items[1].size] must be >= 1, got 0"),
    ],
)
def test_a_value_outside_its_rule_is_one_line_naming_the_path_the_value_and_what_is_allowed(
    data: dict[str, Any], line: str
) -> None:
    assert str(_refused(Outer, data)) == line


def test_the_values_a_rule_allows() -> None:
    for data in ({"level": 0}, {"level": -1}, {"level": 1}, {"block": 8}, {"path": ""}, {"auto": True}):
        check_fields(from_mapping(Outer, data))
    assert from_mapping(Outer, {"extra": None}).extra is None  # an optional table may be null
    assert from_mapping(Outer, {"extra": {"size": 5}}).extra == Inner(5)


@pytest.mark.parametrize(
    ("data", "line"),
    [
        ({"count": "4"}, "[t.count] must be int, got str '4' (write count as int, e.g. count = 4)"),
        ({"count": True}, "[t.count] must be int, got bool True (write count as int, e.g. count = 4)"),
        ({"ratio": "0.5"}, "[t.ratio] must be float, got str '0.5' (write ratio as float, e.g. ratio = 0.5)"),
        ({"auto": 1}, '[t.auto] must be bool | str, got int 1 (write auto as bool | str, e.g. auto = "auto")'),
        ({"maybe": 3}, "[t.maybe] must be str | None, got int 3 (write maybe as str | None)"),
        ({"sizes": [1, "2"]}, "[t.sizes] must be list[int], got list [1, '2'] (write sizes as list[int])"),
        ({"env": {"A": 1}}, "[t.env] must be dict[str, str], got dict {'A': 1} (write env as dict[str, str])"),
        ({"inner": [1]}, "[t.inner] must be a table, got list"),
        ({"items": {}}, "[t.items] must be list[table], got dict {} (write items as list[table])"),
        ({"inner": {"sise": 1}}, "[t.inner.sise] unknown key (did you mean 'size'?)"),
        ({"zzzz": 1}, "[t.zzzz] unknown key (known keys: name, path, ratio, count, level, block, auto, maybe, "),
    ],
)
def test_a_wrong_type_or_key_is_one_line_naming_the_path_and_the_type(data: dict[str, Any], line: str) -> None:
    assert str(_refused(Outer, data)).startswith(line)


@dataclass(frozen=True)
class Required:
    """A table with a key that has no default."""

    id: str
    rest: int = 0


def test_a_missing_required_key_is_named() -> None:
    assert str(_refused(Required, {"rest": 1})) == "[t.id] is required (add id = ... to [t])"
    assert str(_refused(Required, {}, "")) == "[id] is required"


class Color(enum.StrEnum):
    """An enum field: stored as its value."""

    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Job:
    """A record whose id is stored as "id" and whose name is never stored."""

    job_id: int = field(metadata=meta(key="id"))
    color: Color = Color.RED
    name: str = checked("", transient=True)


@dataclass(frozen=True)
class Book:
    """Mappings of records, by name."""

    jobs: Mapping[str, Job] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


def test_an_enum_is_stored_as_its_value_and_read_back_as_the_member() -> None:
    job = from_mapping(Job, {"id": 3, "color": "blue"})
    assert job.color is Color.BLUE and to_mapping(job) == {"id": 3, "color": "blue"}
    assert type(to_mapping(job)["color"]) is str
    assert str(_refused(Job, {"id": 3, "color": "green"})) == "[t.color] 'green' is not one of red, blue"


def test_a_field_stored_under_another_key_and_one_never_stored() -> None:
    job = Job(7, name="squeue's")
    assert to_mapping(job) == {"id": 7, "color": "red"}  # under its key; the transient name left out
    assert from_mapping(Job, to_mapping(job)) == Job(7)
    assert str(_refused(Job, {})) == "[t.id] is required (add id = ... to [t])"
    assert str(_refused(Job, {"job_id": 7})).startswith("[t.job_id] unknown key (known keys: id, color)")
    assert str(_refused(Job, {"id": 7, "name": "x"})).startswith("[t.name] unknown key")
    assert str(_refused(Job, {"id": "7"})) == "[t.id] must be int, got str '7' (write id as int)"


def test_a_mapping_of_records_round_trips_and_names_the_entry_at_fault() -> None:
    book = from_mapping(Book, {"jobs": {"a": {"id": 1}, "b": {"id": 2, "color": "blue"}}, "counts": {"x": 1}})
    assert book.jobs == {"a": Job(1), "b": Job(2, Color.BLUE)} and book.counts == {"x": 1}
    assert from_mapping(Book, json.loads(json.dumps(to_mapping(book)))) == book
    assert (
        str(_refused(Book, {"jobs": {"a": {"id": 1}, "b": {}}}))
        == "[t.jobs['b'].id] is required (add id = ... to [t.jobs['b']])"
    )
    assert (
        str(_refused(Book, {"jobs": {"a": {"id": 1, "color": 5}}})) == "[t.jobs['a'].color] 5 is not one of red, blue"
    )
    assert str(_refused(Book, {"jobs": {"a": 1}})) == "[t.jobs['a']] must be a table, got int"
    assert (
        str(_refused(Book, {"jobs": [1]}))
        == "[t.jobs] must be dict[str, table], got list [1] (write jobs as dict[str, table])"
    )
    assert str(_refused(Book, {"counts": {"x": True}})).startswith("[t.counts] must be dict[str, int], got dict")


@dataclass(frozen=True)
class Shelf:
    """A mapping of checked records: check_fields reaches into it."""

    items: Mapping[str, Inner] = field(default_factory=dict)


def test_check_fields_reaches_records_inside_a_mapping() -> None:
    assert str(_refused(Shelf, {"items": {"x": {"size": 0}}})) == "[t.items['x'].size] must be >= 1, got 0"
