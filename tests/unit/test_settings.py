"""Run settings: strict `from_mapping` (unknown keys, types, widening) and `RunSettings.validate`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from syncer.common.settings import (
    COMPRESSIONS,
    MERGES,
    RunSettings,
    SettingsError,
    from_mapping,
    settings_from_dict,
    suggest,
)


@dataclass(frozen=True)
class _Table:
    """A small table exercising the type rules that RunSettings does not use."""

    required: str
    maybe: int | None = None
    sizes: tuple[int, ...] = ()
    env: dict = field(default_factory=dict)
    ratio: float = 1.0


# -- from_mapping ------------------------------------------------------------------------------


def test_defaults_are_valid_and_from_empty_mapping_equals_defaults() -> None:
    RunSettings().validate()
    assert from_mapping(RunSettings, {}) == RunSettings()
    assert settings_from_dict({}) == RunSettings()


def test_known_keys_are_taken() -> None:
    s = from_mapping(RunSettings, {"H": 32, "fragments": 8, "compression": "int8", "merge": "mean"})
    assert (s.H, s.fragments, s.compression, s.merge) == (32, 8, "int8", "mean")


def test_unknown_key_suggests_the_close_one() -> None:
    with pytest.raises(SettingsError) as info:
        from_mapping(RunSettings, {"quorom": 2}, "run")
    err = info.value
    assert err.key == "run.quorom"
    assert err.problem == "unknown key"
    assert err.fix == "did you mean 'quorum'?"
    assert "[run.quorom]" in str(err) and "did you mean 'quorum'?" in str(err)


def test_unknown_key_case_only_difference_is_suggested() -> None:
    with pytest.raises(SettingsError) as info:
        from_mapping(RunSettings, {"h": 64})
    assert info.value.key == "h"
    assert info.value.fix == "did you mean 'H'?"


def test_unknown_key_far_from_everything_lists_known_keys() -> None:
    with pytest.raises(SettingsError) as info:
        from_mapping(RunSettings, {"zzzzzzzz": 1})
    assert info.value.fix is not None and info.value.fix.startswith("known keys: ")
    assert "quorum" in info.value.fix


def test_suggest() -> None:
    assert suggest("fragmnets", ["fragments", "H"]) == "fragments"
    assert suggest("QUORUM", ["quorum"]) == "quorum"
    assert suggest("xyz", ["quorum"]) is None


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("H", "64"),  # str for int
        ("H", 64.0),  # float for int
        ("H", True),  # bool is not an int here
        ("quorum", False),
        ("outer_lr", "0.7"),  # str for float
        ("outer_lr", True),  # bool is not a float either
        ("fleet_scale", 1),  # int for bool
        ("compression", 4),  # int for str
        ("name", None),  # None where not Optional
        ("insecure", "yes"),
    ],
)
def test_wrong_types_are_rejected_with_key_and_type(key: str, value: object) -> None:
    with pytest.raises(SettingsError) as info:
        from_mapping(RunSettings, {key: value}, "run")
    assert info.value.key == f"run.{key}"
    assert info.value.problem.startswith("must be ")
    assert type(value).__name__ in info.value.problem


def test_int_is_accepted_and_widened_for_float() -> None:
    s = from_mapping(RunSettings, {"outer_lr": 1, "duration": 30, "grace_gamma": 0})
    assert s.outer_lr == 1.0 and type(s.outer_lr) is float
    assert type(s.duration) is float and s.duration == 30.0
    assert type(s.grace_gamma) is float


def test_not_a_mapping() -> None:
    with pytest.raises(SettingsError) as info:
        from_mapping(RunSettings, [("H", 4)], "run")  # type: ignore[arg-type]
    assert info.value.key == "run"
    assert "must be a table" in info.value.problem


def test_required_field_missing() -> None:
    with pytest.raises(SettingsError) as info:
        from_mapping(_Table, {}, "t")
    assert info.value.key == "t.required"
    assert info.value.problem == "is required"


def test_optional_tuple_dict_arms() -> None:
    t = from_mapping(_Table, {"required": "x", "maybe": None, "sizes": [1, 2, 3], "env": {"A": "1"}, "ratio": 2})
    assert t == _Table("x", None, (1, 2, 3), {"A": "1"}, 2.0)
    assert isinstance(t.sizes, tuple)
    assert from_mapping(_Table, {"required": "x", "maybe": 5}).maybe == 5
    for bad in ({"maybe": "5"}, {"maybe": True}, {"sizes": [1, "2"]}, {"sizes": 3}, {"env": []}):
        with pytest.raises(SettingsError):
            from_mapping(_Table, {"required": "x", **bad})


def test_result_is_frozen() -> None:
    s = from_mapping(RunSettings, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.H = 3  # type: ignore[misc]


# -- validate ----------------------------------------------------------------------------------


def _invalid(**changes: object) -> SettingsError:
    with pytest.raises(SettingsError) as info:
        dataclasses.replace(RunSettings(), **changes).validate()
    return info.value


def test_H_must_be_a_multiple_of_fragments_and_fix_proposes_one() -> None:
    err = _invalid(H=10, fragments=4)
    assert err.key == "H"
    assert "multiple of fragments=4" in err.problem
    assert err.fix is not None and "H = 8" in err.fix  # 4 * round(10 / 4) = 4 * 2
    dataclasses.replace(RunSettings(), H=12, fragments=4).validate()
    dataclasses.replace(RunSettings(), H=5, fragments=5).validate()


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"H": 0}, "H"),
        ({"fragments": 0}, "fragments"),
        ({"tau": -1}, "tau"),
        ({"max_lag": -1}, "max_lag"),
        ({"quorum": 0}, "quorum"),
        ({"quorum": -3}, "quorum"),
        ({"grace_gamma": 1.0}, "grace_gamma"),
        ({"grace_gamma": -0.1}, "grace_gamma"),
        ({"compression": "int2"}, "compression"),
        ({"compression": "INT4"}, "compression"),
        ({"merge": "median"}, "merge"),
        ({"block": 7}, "block"),
        ({"block": 9}, "block"),
        ({"block": 6}, "block"),
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"outer_momentum": -0.5}, "outer_momentum"),
        ({"alpha": 1.0}, "alpha"),
        ({"alpha": -0.1}, "alpha"),
        ({"robust_clip": -1.0}, "robust_clip"),
        ({"max_carry": -0.5}, "max_carry"),
        ({"max_carry": -2.0}, "max_carry"),
        ({"seq_len": 0}, "seq_len"),
        ({"init_from": "  "}, "init_from"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_queue": 0}, "max_queue"),
        ({"keep_checkpoints": 0}, "keep_checkpoints"),
        ({"checkpoint_every": 0}, "checkpoint_every"),
        ({"checkpoint_s": -1.0}, "checkpoint_s"),
        ({"lr": 0.0}, "lr"),
        ({"state_chunk_mb": 0.0}, "state_chunk_mb"),
        ({"heartbeat_s": 0.0}, "heartbeat_s"),
        ({"liveness_s": 0.5, "heartbeat_s": 0.5}, "liveness_s"),
        ({"steps": -1}, "steps"),
        ({"duration": -1.0}, "steps"),
    ],
)
def test_validate_rejects(changes: dict, key: str) -> None:
    assert _invalid(**changes).key == key


def test_one_of_lists_allowed_values_and_proposes_the_default_name() -> None:
    err = _invalid(compression="zip")
    assert all(c in err.problem for c in COMPRESSIONS)
    assert err.fix == "set compression = 'int4'"
    err = _invalid(merge="avg")
    assert all(m in err.problem for m in MERGES)


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("merge", MERGES)
def test_every_compression_and_merge_name_is_valid(compression: str, merge: str) -> None:
    dataclasses.replace(RunSettings(), compression=compression, merge=merge).validate()


def test_edge_values_that_are_valid() -> None:
    dataclasses.replace(
        RunSettings(),
        quorum=1,
        tau=0,
        grace_gamma=0.0,
        alpha=0.0,
        block=8,
        outer_momentum=0.0,
        robust_clip=0.0,
        steps=0,
        duration=0.0,
    ).validate()


def test_settings_from_dict_validates() -> None:
    with pytest.raises(SettingsError) as info:
        settings_from_dict({"H": 10, "fragments": 4})
    assert info.value.key == "H"
    with pytest.raises(SettingsError) as info:
        settings_from_dict({"fragmets": 4})
    assert info.value.key == "run.fragmets" and info.value.fix == "did you mean 'fragments'?"


def test_to_dict_round_trips() -> None:
    s = RunSettings(H=16, fragments=2, quorum=3)
    assert settings_from_dict(s.to_dict()) == s


def test_risky_combinations_are_named_and_the_defaults_have_none() -> None:
    from syncer.common.settings import RunSettings as RS

    assert RS().risks(4) == [] and RS(H=16).risks(4) == []  # the default Nesterov on the syncer's clock
    assert any("Nesterov" in r for r in RS(round_clock="learner", quorum=4, H=16).risks(4))
    assert RS(round_clock="learner", quorum=4, outer_momentum=0.0, H=16).risks(4) == []
    assert RS(round_clock="learner", quorum=4, H=64).risks(4) == []
    assert any("fleet_scale" in r for r in RS(round_clock="learner", fleet_scale=False).risks(4))
    assert any("round of its own" in r for r in RS(round_clock="learner").risks(4))
    assert RS(round_clock="learner", quorum=4).risks(4) == []  # every round waits for the fleet
    assert any("max_backlog" in r for r in RS(max_backlog=0).risks(4))
    assert any("overlap = false" in r for r in RS(overlap=False, quorum=2).risks(4))
    assert RS(overlap=False, quorum=4).risks(4) == []  # synchronous DiLoCo, the baseline
    assert any("not scored" in r for r in RS(quality_guard=0).risks(4))
    assert any("plain averaging" in r for r in RS(compression="topk").risks(4))
    assert RS(compression="topk", outer_lr=1.0, outer_momentum=0.0).risks(4) == []
