"""Run settings shared by the syncer, the learners and the operator (a leaf: stdlib only).

`RunSettings` is the `[run]` table of an inventory and the `run` section of a resolved
configuration (the whole file: syncer/common/resolved.py). Each field's type and rule say what
it may hold (syncer/common/typedcodec.py checks them: `from_mapping` the types, `validate` the
rules); `validate` adds the few rules that relate two fields. Callers add the file name to the error.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

# SettingsError, from_mapping and suggest re-exported: the settings' error, strict reader and "did you mean"
from syncer.common.typedcodec import SettingsError as SettingsError
from syncer.common.typedcodec import check_fields, checked, to_mapping
from syncer.common.typedcodec import from_mapping as from_mapping
from syncer.common.typedcodec import suggest as suggest

Compression = Literal["int4", "int8", "bf16", "none", "2bit", "topk"]  # the last two: thin links, docs/tuning.md
HostCompression = Literal["", "int4", "int8", "bf16", "none", "2bit", "topk"]  # "": the run's
RoundClock = Literal["syncer", "learner"]
Precision = Literal["auto", "bf16", "fp32"]
Merge = Literal["rda", "mean"]
NoCheckpoint = Literal["refuse", "from-learner"]  # refuse to start a new global model, or start one
Link = Literal["default", "thin"]
COMPRESSIONS: tuple[str, ...] = typing.get_args(Compression)
ROUND_CLOCKS: tuple[str, ...] = typing.get_args(RoundClock)
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)
MERGES: tuple[str, ...] = typing.get_args(Merge)
NO_CHECKPOINT: tuple[str, ...] = typing.get_args(NoCheckpoint)
# `link = "thin"`: the keys it sets where [run] does not (measured on gpt-tiny at H = 32, docs/tuning.md):
# topk with error feedback, 1,894x fewer bytes a token than data-parallel at +4.7%, merged by plain averaging
# (Nesterov's outer step on sparse pushes: +16.4%)
LINK_PRESETS: dict[str, dict[str, Any]] = {"thin": {"compression": "topk", "outer_lr": 1.0, "outer_momentum": 0.0}}

_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_NAME_IS = "a name of 1-64 letters, digits, '_', '.' or '-' starting with a letter or digit"
_SHARDS_FIX = 'ledger (the default) lets the syncer hand out the data; "shards" samples a fixed shard per learner'


@dataclass(frozen=True)
class RunSettings:
    """What the learners train and how the syncer merges; every field has a safe default."""

    name: str = checked(
        "dldctl", pattern=_NAME, allowed=_NAME_IS, fix='it names the run directory, e.g. name = "exp-1"'
    )
    model: str = "gpt-small"  # gpt-tiny | gpt-small | gpt-medium | gpt2-124m | pkg.mod:factory | hf:DIR
    data: str = "builtin"  # builtin | token files (.bin/.u16/.u32 + .json) | a directory of them | text (docs/data.md)
    tokenizer: str = ""  # a tokenizer.json that text data is tokenized with ("" = bytes; hf: the model dir's)
    # ledger: the syncer hands out work units (docs/data.md) | shards: random windows of a fixed shard
    data_order: Literal["ledger", "shards"] = checked("ledger", fix=_SHARDS_FIX)
    # sequences per work unit (0 = one fragment's sync period: batch_size * H / fragments)
    unit_sequences: int = checked(0, ge=0, note="0 = automatic")
    seed: int = 0
    # a model file a new run starts from ("" = from the seed; a resumed run: its checkpoint)
    init_from: str = checked(
        "",
        nonblank=True,
        fix='name a model file, e.g. init_from = "final_model.pt", or leave the key out to start from the seed',
    )
    # the user's code directory, shipped to every host and first on every process's import path
    workdir: str = checked(
        "",
        nonblank=True,
        fix='name the directory your model\'s package lives in, e.g. workdir = "."; or leave the key out',
    )
    workdir_max_mb: float = checked(100.0, gt=0)  # a larger workdir is refused (exclude files with .dldctlignore)
    steps: int = 0  # inner steps per learner; 0 = until `dldctl down` (steps and duration: validate)
    duration: float = 0.0  # seconds; 0 = until `dldctl down`
    # inner optimizer (AdamW)
    seq_len: int = checked(128, ge=1)
    batch_size: int = checked(16, ge=1)  # default per learner; a host may override it
    lr: float = checked(3e-3, gt=0)
    warmup: int = 50
    lr_schedule: Literal["constant", "cosine"] = "constant"  # cosine: to 10% of lr at `steps`; needs steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    precision: Precision = "auto"  # auto (bf16 on a GPU that has it, fp32 elsewhere): autocast of the forward
    # torch.compile the model: true | false | "auto" (on for CUDA, off on the CPU)
    compile: bool | Literal["auto"] = checked("auto", fix='compile = "auto" compiles on CUDA only')
    tf32: bool = True  # TF32 matmuls and convolutions on CUDA (no effect on the CPU)
    eval_every: int = checked(50, ge=1)
    eval_batches: int = checked(4, ge=1)
    # Decoupled DiLoCo
    H: int = checked(64, ge=1)  # inner steps between two syncs of one fragment
    fragments: int = checked(4, ge=1)  # P; one fragment leaves every H/P steps
    tau: int = checked(2, ge=0)  # overlap: a reply may be applied up to tau steps late
    round_clock: RoundClock = "syncer"  # syncer: it calls each fragment's round for the whole fleet; learner: own
    quorum: int = checked(1, ge=1)  # K: minimum distinct learners to close a round
    grace_gamma: float = checked(0.5, ge=0, lt=1)  # safety factor of the adaptive grace window
    link: Link = "default"  # "thin": a preset for links of a few Mbit/s a site (LINK_PRESETS; its keys set here win)
    compression: Compression = "int4"
    zstd: bool = True  # zstd-compress the quantized payloads both ways; false: ~8-20% more bytes, less CPU
    block: int = checked(128, ge=8, multiple_of=2, allowed="an even number >= 8")  # values per absmax block
    topk_keep: int = checked(64, ge=4, le=4096, multiple_of=4, allowed="a multiple of 4 in 4..4096")  # topk: of 4,096
    merge: Merge = "rda"
    # outer Nesterov SGD: best or level in every measured cell (H 16/32/64, cosine and constant
    # learning rate) against plain averaging (1, 0) and DiLoCo's (0.7, 0.9); docs/tuning.md
    outer_lr: float = checked(0.6, gt=0)
    outer_momentum: float = checked(0.8, ge=0, lt=1)
    alpha: float = checked(0.0, ge=0, lt=1)  # 0 = overwrite the local fragment with the global one
    rebase: bool = True  # apply a reply on top of the work done since the push (none lost)
    checksum_every: int = checked(8, ge=1)  # updates carry the fragment's crc32 every N versions (1 = always)
    robust_clip: float = checked(10.0, ge=0, note="0 = off")  # >0: clip each contribution's norm to this x median
    # reject a contribution whose norm is this x the fragment's recent median (0 = off)
    judge_size: float = checked(16.0, ge=2, also=((0, "off"),))
    # direction judged beyond this many sigmas of noise's cosine (0 = off; syncer/judge.py)
    judge_agree: float = checked(3.0, ge=0, le=100, allowed="0 (off) to 100 sigmas")
    # rejections among a learner's last 8 contributions that quarantine it (0 = never)
    quarantine_strikes: int = checked(3, ge=0, le=8, allowed="0 (never) to 8")
    quarantine_s: float = checked(30.0, gt=0, unit="seconds")  # the first; each next one of a learner twice as long
    fleet_scale: bool = True  # a round's share of the period's tokens (learner clock); finished learners stay in
    # score the global model every this many outer steps (0 = off)
    global_eval_every: int = checked(32, ge=0, unit="outer steps", note="0 = off")
    # roll back a score this far above the recent best (0 = off)
    quality_guard: float = checked(0.1, ge=0, le=10, allowed="a relative rise between 0 (off) and 10")
    # a contribution counts for at most this many of its sync periods (0 = off)
    max_backlog: float = checked(2.0, ge=1, also=((0, "off"),), unit="sync periods")
    # of a capped contribution's rest, this many periods wait for the next rounds (-1 = all)
    max_carry: float = checked(2.0, ge=0, also=((-1, "carry all"),), unit="sync periods")
    overlap: bool = True  # False: a learner waits for each merge (synchronous DiLoCo)
    max_lag: int = checked(0, ge=0, note="0 = never wait")  # >0: wait for a reply this many steps late
    # operations
    checkpoint_every: int = checked(20, ge=1)  # merges between syncer checkpoints
    # also checkpoint this often when anything merged since the last (0: never)
    checkpoint_s: float = checked(30.0, ge=0, note="0 = by checkpoint_every only")
    keep_checkpoints: int = checked(3, ge=1)
    # metrics.jsonl, events.jsonl, process logs: rotated to NAME.1 past this (0 = never)
    max_log_mb: float = checked(
        1024.0,
        ge=0,
        note="0 = never rotate",
        fix="each log keeps at most this much plus one rotated segment, e.g. max_log_mb = 1024",
    )
    on_no_checkpoint: NoCheckpoint = "refuse"  # from-learner: a run that had merged finds no valid checkpoint
    heartbeat_s: float = checked(0.5, gt=0)
    liveness_s: float = checked(3.0, gt=0)  # a learner silent this long is not live
    state_chunk_mb: float = checked(4.0, gt=0)
    max_queue: int = checked(256, ge=1)  # pushes queued at the syncer before the oldest is dropped
    # a learner keeps its sent pushes until a syncer checkpoint holds them (0 = off)
    keep_pushes_mb: float = checked(
        1024.0,
        ge=0,
        note="0 = off",
        fix="a learner sends what a restarted syncer lost again from this much memory, e.g. keep_pushes_mb = 1024",
    )
    max_message_mb: float = checked(512.0, gt=0)  # larger messages are refused by the socket itself
    restart_delay_s: float = checked(2.0, ge=0)
    restart_backoff_max_s: float = 60.0
    warm_spares: bool = True  # keep one pre-started learner per host to replace the next that dies
    insecure: bool = False  # no CURVE: only for debugging on a trusted network

    def validate(self) -> None:
        """Each field's rule (its declaration), then the rules that relate two fields; no
        knowledge of the fleet or the model is needed."""
        check_fields(self)
        _check(
            self.H % self.fragments == 0,
            "H",
            f"H={self.H} must be a multiple of fragments={self.fragments}",
            "so one fragment leaves every H/fragments steps, "
            f"e.g. H = {self.fragments * max(1, round(self.H / self.fragments))}",
        )
        _check(
            self.lr_schedule != "cosine" or self.steps > 0,
            "lr_schedule",
            "cosine decays over the step budget, but steps = 0 (no budget)",
            "set steps, e.g. steps = 5000",
        )
        _check(
            not (self.rebase and self.alpha > 0),
            "rebase",
            "rebase (on by default) cannot be combined with alpha > 0",
            "to mix with alpha, also set rebase = false",
        )
        _check(
            self.compression != "2bit" or self.block % 4 == 0,
            "block",
            f"2bit packs four codes a byte, but block = {self.block}",
            "use a multiple of 4, e.g. block = 128",
        )
        _check(self.liveness_s > self.heartbeat_s, "liveness_s", "must be longer than heartbeat_s")
        _check(
            self.state_chunk_mb * 2 <= self.max_message_mb, "state_chunk_mb", "must be at most half of max_message_mb"
        )
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
        if self.compression == "topk" and (self.outer_lr, self.outer_momentum) != (1.0, 0.0):
            out.append(
                f'compression = "topk" with outer_lr = {self.outer_lr:g}, outer_momentum = {self.outer_momentum:g}: '
                "the outer step on sparse pushes cost +16.4% loss against data-parallel, plain averaging "
                '(outer_lr = 1, outer_momentum = 0; link = "thin" sets it) +4.7%'
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
        return to_mapping(self)


def _check(ok: bool, key: str, problem: str, fix: str | None = None) -> None:
    if not ok:
        raise SettingsError(key, problem, fix)


def run_from_mapping(data: Any) -> RunSettings:
    """RunSettings from an inventory's `[run]` table (unvalidated), its `link` preset's keys filled in
    where the table does not set them; anything not a table goes to the strict reader, which names
    what is wrong. A resolved configuration holds every key already (`settings_from_dict`)."""
    if isinstance(data, Mapping) and isinstance(data.get("link"), str):
        data = {**LINK_PRESETS.get(data["link"], {}), **data}
    return from_mapping(RunSettings, data, "run")


def settings_from_dict(data: Mapping[str, Any]) -> RunSettings:
    """A validated RunSettings from a resolved configuration's `run` section."""
    settings = from_mapping(RunSettings, data, "run")
    settings.validate()
    return settings
