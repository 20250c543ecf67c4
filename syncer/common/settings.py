"""Run settings shared by the syncer, the learners and the operator (a leaf: stdlib only).

`RunSettings` is the `[run]` table of an inventory and the `run` section of a resolved
configuration (the whole file: syncer/common/resolved.py). `from_mapping` turns a plain dict
into any frozen settings dataclass, rejecting unknown keys (with a "did you mean") and wrong
types; callers add the file name to the error.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

T = TypeVar("T")

COMPRESSIONS = ("int4", "int8", "bf16", "none")
ROUND_CLOCKS = ("syncer", "learner")
PRECISIONS = ("auto", "bf16", "fp32")
MERGES = ("rda", "mean")
NO_CHECKPOINT = ("refuse", "from-learner")  # on_no_checkpoint: refuse to start a new global model, or start one


class SettingsError(ValueError):
    """A settings value is wrong: `key` names it, `fix` says what to do."""

    def __init__(self, key: str | None, problem: str, fix: str | None = None) -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        where = f"[{key}] " if key else ""
        super().__init__(f"{where}{problem}" + (f" ({fix})" if fix else ""))


@dataclass(frozen=True)
class RunSettings:
    """What the learners train and how the syncer merges; every field has a safe default."""

    name: str = "dldctl"
    model: str = "gpt-small"  # gpt-tiny | gpt-small | gpt-medium | gpt2-124m | pkg.mod:factory | hf:DIR
    data: str = "builtin"  # builtin | token files (.bin/.u16/.u32 + .json) | a directory of them | text (docs/data.md)
    tokenizer: str = ""  # a tokenizer.json that text data is tokenized with ("" = bytes; hf: the model dir's)
    data_order: str = (
        "ledger"  # ledger: the syncer hands out work units (docs/data.md) | shards: random windows of a fixed shard
    )
    unit_sequences: int = 0  # sequences per work unit (0 = one fragment's sync period: batch_size * H / fragments)
    seed: int = 0
    init_from: str = ""  # a model file a new run starts from ("" = from the seed; a resumed run: its checkpoint)
    workdir: str = ""  # the user's code directory, shipped to every host and first on every process's import path
    workdir_max_mb: float = 100.0  # a larger workdir is refused (exclude files with .dldctlignore)
    steps: int = 0  # inner steps per learner; 0 = until `dldctl down`
    duration: float = 0.0  # seconds; 0 = until `dldctl down`
    # inner optimizer (AdamW)
    seq_len: int = 128
    batch_size: int = 16  # default per learner; a host may override it
    lr: float = 3e-3
    warmup: int = 50
    lr_schedule: str = "constant"  # constant | cosine (to 10% of lr at `steps`; needs steps)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    precision: str = "auto"  # auto (bf16 on a GPU that has it, fp32 elsewhere) | bf16 | fp32: autocast of the forward
    compile: bool | str = "auto"  # torch.compile the model: true | false | "auto" (on for CUDA, off on the CPU)
    tf32: bool = True  # TF32 matmuls and convolutions on CUDA (no effect on the CPU)
    eval_every: int = 50
    eval_batches: int = 4
    # Decoupled DiLoCo
    H: int = 64  # inner steps between two syncs of one fragment
    fragments: int = 4  # P; one fragment leaves every H/P steps
    tau: int = 2  # overlap: a reply may be applied up to tau steps late
    round_clock: str = "syncer"  # syncer: it calls each fragment's round for the whole fleet; learner: own steps
    quorum: int = 1  # K: minimum distinct learners to close a round
    grace_gamma: float = 0.5  # safety factor of the adaptive grace window
    compression: str = "int4"  # int4 | int8 | bf16 | none
    zstd: bool = True  # zstd-compress the quantized payloads both ways; false: ~8-20% more bytes, less CPU
    block: int = 128  # values per absmax quantization block
    merge: str = "rda"  # rda | mean
    # outer Nesterov SGD: best or level in every measured cell (H 16/32/64, cosine and constant
    # learning rate) against plain averaging (1, 0) and DiLoCo's (0.7, 0.9); docs/tuning.md
    outer_lr: float = 0.6
    outer_momentum: float = 0.8
    alpha: float = 0.0  # 0 = overwrite the local fragment with the global one
    rebase: bool = True  # apply a reply on top of the work done since the push (none lost)
    checksum_every: int = 8  # updates carry the fragment's crc32 every N versions (1 = always)
    robust_clip: float = 10.0  # >0: clip each contribution's norm to this x median (0 = off)
    judge_size: float = 16.0  # reject a contribution whose norm is this x the fragment's recent median (0 = off)
    judge_agree: float = 3.0  # direction judged beyond this many sigmas of noise's cosine (0 = off; syncer/judge.py)
    quarantine_strikes: int = 3  # rejections among a learner's last 8 contributions that quarantine it (0 = never)
    quarantine_s: float = 30.0  # the first quarantine; each next one of the same learner twice as long
    fleet_scale: bool = True  # a round's share of the period's tokens (learner clock); finished learners stay in
    global_eval_every: int = 32  # score the global model every this many outer steps (0 = off)
    quality_guard: float = 0.1  # roll back a score this far above the recent best (0 = off)
    max_backlog: float = 2.0  # a contribution counts for at most this many of its sync periods (0 = off)
    max_carry: float = 2.0  # of a capped contribution's rest, this many periods wait for the next rounds (-1 = all)
    overlap: bool = True  # False: a learner waits for each merge (synchronous DiLoCo)
    max_lag: int = 0  # >0: a learner waits for a reply this many steps late (at most liveness_s)
    # operations
    checkpoint_every: int = 20  # merges between syncer checkpoints
    checkpoint_s: float = 30.0  # also checkpoint this often when anything merged since the last (0: never)
    keep_checkpoints: int = 3
    max_log_mb: float = 1024.0  # metrics.jsonl, events.jsonl, process logs: rotated to NAME.1 past this (0 = never)
    on_no_checkpoint: str = "refuse"  # refuse | from-learner: a run that had merged finds no valid checkpoint
    heartbeat_s: float = 0.5
    liveness_s: float = 3.0  # a learner silent this long is not live
    state_chunk_mb: float = 4.0
    max_queue: int = 256  # pushes queued at the syncer before the oldest is dropped
    keep_pushes_mb: float = 1024.0  # a learner keeps its sent pushes until a syncer checkpoint holds them (0 = off)
    max_message_mb: float = 512.0  # larger messages are refused by the socket itself
    restart_delay_s: float = 2.0
    restart_backoff_max_s: float = 60.0
    warm_spares: bool = True  # keep one pre-started learner per host to replace the next that dies
    insecure: bool = False  # no CURVE: only for debugging on a trusted network

    def validate(self) -> None:
        """Cross-field and range rules that need no knowledge of the fleet or the model."""
        _check(
            re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.name) is not None,
            "name",
            f"must be 1-64 letters, digits, '_', '.' or '-' starting with a letter or digit, got {self.name!r}",
            'it names the run directory, e.g. name = "exp-1"',
        )
        _check(
            self.init_from == "" or self.init_from.strip() != "",
            "init_from",
            "is blank",
            'name a model file, e.g. init_from = "final_model.pt", or leave the key out to start from the seed',
        )
        _check(
            self.workdir == "" or self.workdir.strip() != "",
            "workdir",
            "is blank",
            'name the directory your model\'s package lives in, e.g. workdir = "."; or leave the key out',
        )
        _check(self.workdir_max_mb > 0, "workdir_max_mb", f"must be > 0, got {self.workdir_max_mb}")
        _check(self.H >= 1, "H", f"must be >= 1, got {self.H}")
        _check(
            self.data_order in ("ledger", "shards"),
            "data_order",
            f'must be "ledger" or "shards", got {self.data_order!r}',
            'ledger (the default) lets the syncer hand out the data; "shards" samples a fixed shard per learner',
        )
        _check(self.unit_sequences >= 0, "unit_sequences", f"must be >= 0 (0 = automatic), got {self.unit_sequences}")
        _check(self.fragments >= 1, "fragments", f"must be >= 1, got {self.fragments}")
        _check(
            self.H % self.fragments == 0,
            "H",
            f"H={self.H} must be a multiple of fragments={self.fragments}",
            "so one fragment leaves every H/fragments steps, "
            f"e.g. H = {self.fragments * max(1, round(self.H / self.fragments))}",
        )
        _check(self.tau >= 0, "tau", f"must be >= 0, got {self.tau}")
        _check(self.max_lag >= 0, "max_lag", f"must be >= 0 (0 = never wait), got {self.max_lag}")
        _check(self.quorum >= 1, "quorum", f"must be >= 1, got {self.quorum}")
        _check(0.0 <= self.grace_gamma < 1.0, "grace_gamma", f"must be in [0, 1), got {self.grace_gamma}")
        _one_of(self.round_clock, ROUND_CLOCKS, "round_clock")
        _check(
            self.max_backlog == 0 or self.max_backlog >= 1,
            "max_backlog",
            f"must be 0 (off) or >= 1 sync period, got {self.max_backlog}",
        )
        _check(
            self.max_carry == -1 or self.max_carry >= 0,
            "max_carry",
            f"must be >= 0 sync periods or -1 (carry all), got {self.max_carry}",
        )
        _one_of(self.compression, COMPRESSIONS, "compression")
        _one_of(self.precision, PRECISIONS, "precision")
        _check(
            self.compile in (True, False, "auto"),
            "compile",
            f'must be true, false or "auto", got {self.compile!r}',
            'compile = "auto" compiles on CUDA only',
        )
        _one_of(self.merge, MERGES, "merge")
        _one_of(self.on_no_checkpoint, NO_CHECKPOINT, "on_no_checkpoint")
        _one_of(self.lr_schedule, ("constant", "cosine"), "lr_schedule")
        _check(
            self.lr_schedule != "cosine" or self.steps > 0,
            "lr_schedule",
            "cosine decays over the step budget, but steps = 0 (no budget)",
            "set steps, e.g. steps = 5000",
        )
        _check(self.block >= 8 and self.block % 2 == 0, "block", f"must be an even number >= 8, got {self.block}")
        _check(self.outer_lr > 0, "outer_lr", f"must be > 0, got {self.outer_lr}")
        _check(0.0 <= self.outer_momentum < 1.0, "outer_momentum", f"must be in [0, 1), got {self.outer_momentum}")
        _check(0.0 <= self.alpha < 1.0, "alpha", f"must be in [0, 1), got {self.alpha}")
        _check(
            not (self.rebase and self.alpha > 0),
            "rebase",
            "rebase (on by default) cannot be combined with alpha > 0",
            "to mix with alpha, also set rebase = false",
        )
        _check(
            self.global_eval_every >= 0,
            "global_eval_every",
            f"must be >= 0 outer steps (0 = off), got {self.global_eval_every}",
        )
        _check(
            0 <= self.quality_guard <= 10,
            "quality_guard",
            f"must be a relative rise between 0 (off) and 10, got {self.quality_guard}",
        )
        _check(self.robust_clip >= 0, "robust_clip", f"must be >= 0 (0 = off), got {self.robust_clip}")
        size, strikes = self.judge_size, self.quarantine_strikes
        _check(size == 0 or size >= 2, "judge_size", f"must be 0 (off) or >= 2, got {size}")
        _check(0 <= self.judge_agree <= 100, "judge_agree", f"must be 0 (off) to 100 sigmas, got {self.judge_agree}")
        _check(0 <= strikes <= 8, "quarantine_strikes", f"must be 0 (never) to 8, got {strikes}")
        _check(self.quarantine_s > 0, "quarantine_s", f"must be > 0 seconds, got {self.quarantine_s}")
        for key in (
            "seq_len",
            "batch_size",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
            "keep_checkpoints",
            "max_queue",
            "checksum_every",
        ):
            _check(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("lr", "heartbeat_s", "liveness_s", "state_chunk_mb", "max_message_mb"):
            _check(getattr(self, key) > 0, key, f"must be > 0, got {getattr(self, key)}")
        _check(
            self.checkpoint_s >= 0,
            "checkpoint_s",
            f"must be >= 0 (0 = by checkpoint_every only), got {self.checkpoint_s}",
        )
        _check(self.liveness_s > self.heartbeat_s, "liveness_s", "must be longer than heartbeat_s")
        _check(
            self.state_chunk_mb * 2 <= self.max_message_mb, "state_chunk_mb", "must be at most half of max_message_mb"
        )
        _check(
            self.max_log_mb >= 0,
            "max_log_mb",
            f"must be >= 0 (0 = never rotate), got {self.max_log_mb}",
            "each log keeps at most this much plus one rotated segment, e.g. max_log_mb = 1024",
        )
        _check(
            self.keep_pushes_mb >= 0,
            "keep_pushes_mb",
            f"must be >= 0 (0 = off), got {self.keep_pushes_mb}",
            "a learner sends what a restarted syncer lost again from this much memory, e.g. keep_pushes_mb = 1024",
        )
        _check(self.restart_delay_s >= 0, "restart_delay_s", f"must be >= 0, got {self.restart_delay_s}")
        _check(
            self.restart_backoff_max_s >= self.restart_delay_s, "restart_backoff_max_s", "must be >= restart_delay_s"
        )
        _check(self.steps >= 0 and self.duration >= 0, "steps", "steps and duration must be >= 0 (0 = unlimited)")

    @property
    def syncer_clock(self) -> bool:
        """Whether the syncer calls the rounds (round_clock = "syncer" with overlap; the
        synchronous mode, overlap = false, always runs on each learner's own step counter)."""
        return self.round_clock == "syncer" and self.overlap

    @property
    def lockstep(self) -> bool:
        """Whether learners push on their own counters and wait on the fleet's fragment order
        (overlap = false, or `max_lag` on the learners' clocks): a rejoining learner must then
        take up that order (`OuterState.lockstep_phase`) and the syncer withdraw its previous
        incarnation's unmerged pushes (`rounds.withdraw`)."""
        return not self.syncer_clock and (not self.overlap or self.max_lag > 0)

    @property
    def max_log_bytes(self) -> int:
        """`max_log_mb` in bytes (0 = never rotate)."""
        return int(self.max_log_mb * (1 << 20))

    def risks(self, learners: int = 0) -> list[str]:
        """Accepted combinations that are known to hurt the global model (measured, docs/tuning.md):
        `up --dry-run` and `up` print them and `dldctl status` shows them. `learners`: the fleet size,
        where known."""
        out = []
        if self.overlap and self.round_clock == "learner" and self.outer_momentum >= 0.5 and self.H <= 32:
            out.append(
                f'outer_momentum = {self.outer_momentum:g} at H = {self.H} with round_clock = "learner" and the '
                "overlap: Nesterov momentum diverged on gpt-tiny at H <= 32 on the learners' clocks; "
                "outer_momentum = 0 did not"
            )
        if self.overlap and self.round_clock == "learner" and self.quorum < max(2, learners):
            out.append(
                'round_clock = "learner" with fleet_scale = false and a quorum below the fleet: nearly '
                "every push is a round of its own, applied at full size (diverged to 41.7 in our runs)"
                if not self.fleet_scale
                else 'round_clock = "learner" with a quorum below the fleet: nearly every push is a round of '
                "its own (1.09 contributors per round, eval 2.71 against 1.70 for the syncer's clock at H = 64)"
            )
        if not self.overlap and self.quorum < max(2, learners):
            out.append(
                f"overlap = false with quorum = {self.quorum}, below the fleet: each learner syncs on its own step "
                "counter and nearly every push is a round of its own (1.13 contributors per round, eval 2.62 "
                "against 1.72 at H = 64); synchronous DiLoCo is overlap = false with quorum = the fleet size"
            )
        if self.max_backlog == 0:
            out.append(
                "max_backlog = 0: a syncer outage's or a partition's backlog is merged as one outer step "
                "(a 30 s outage took the global model from 2.70 to 16.4)"
            )
        if self.global_eval_every == 0 or self.quality_guard == 0:
            out.append(
                "the global model is not scored or not guarded (global_eval_every / quality_guard = 0): "
                "damage to it shows nowhere"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return dataclasses.asdict(self)


def _check(ok: bool, key: str, problem: str, fix: str | None = None) -> None:
    if not ok:
        raise SettingsError(key, problem, fix)


def _one_of(value: str, allowed: tuple[str, ...], key: str) -> None:
    _check(value in allowed, key, f"{value!r} is not one of {', '.join(allowed)}", f"set {key} = {allowed[0]!r}")


def suggest(name: str, candidates: list[str]) -> str | None:
    """The closest known name to a misspelled one, if any is close."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in candidates}
        return lowered.get(name.lower())
    return close[0]


def _type_ok(value: Any, hint: Any) -> tuple[bool, Any]:
    """Whether `value` fits the annotation `hint`; ints are accepted (and widened) for floats."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(hint):
            ok, coerced = _type_ok(value, arm)
            if ok:
                return True, coerced
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return False, value
        (arm, *_rest) = typing.get_args(hint) or (Any,)
        items = [_type_ok(v, arm) for v in value]
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    if origin is dict or hint is dict:
        return isinstance(value, dict), dict(value) if isinstance(value, dict) else value
    if hint is Any:
        return True, value
    return isinstance(value, hint), value


def _type_name(hint: Any) -> str:
    if isinstance(hint, type) and hint in (int, float, str, bool):
        return hint.__name__
    return str(hint).replace("typing.", "")


def from_mapping(cls: type[T], data: Mapping[str, Any], table: str = "") -> T:
    """Build the frozen dataclass `cls` from `data`, strictly: unknown keys and wrong types fail."""
    if not isinstance(data, Mapping):
        raise SettingsError(table or None, f"must be a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    prefix = f"{table}." if table else ""
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            close = suggest(key, known)
            fix = f"did you mean {close!r}?" if close else f"known keys: {', '.join(known)}"
            raise SettingsError(f"{prefix}{key}", "unknown key", fix)
        ok, coerced = _type_ok(value, hints[key])
        if not ok:
            raise SettingsError(
                f"{prefix}{key}",
                f"must be {_type_name(hints[key])}, got {type(value).__name__} {value!r}",
                _type_fix(cls, key, _type_name(hints[key])),
            )
        values[key] = coerced
    missing = [f.name for f in fields(cls) if f.name not in values and _required(f)]  # type: ignore[arg-type]
    if missing:
        raise SettingsError(
            f"{prefix}{missing[0]}", "is required", f"add {missing[0]} = ... to [{table or 'the table'}]"
        )
    return cls(**values)


def _type_fix(cls: type, key: str, kind: str) -> str:
    """How to write `key` right: its type, with the default as an example where there is one."""
    default = next((f.default for f in fields(cls) if f.name == key), dataclasses.MISSING)
    if default is dataclasses.MISSING or isinstance(default, (tuple, list, dict)):
        return f"write {key} as {kind}"
    example = json.dumps(default)  # TOML and JSON agree on strings, numbers and booleans
    return f"write {key} as {kind}, e.g. {key} = {example}"


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def settings_from_dict(data: Mapping[str, Any]) -> RunSettings:
    """A validated RunSettings from a resolved configuration's `run` section."""
    settings = from_mapping(RunSettings, data, "run")
    settings.validate()
    return settings
