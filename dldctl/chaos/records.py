"""What `dldctl chaos ... --json` prints, built from pure data (the shapes: docs/chaos.md#--json).

Every object carries `"schema": "dldctl.chaos/1"` and the run's name. `kill`, `pause`, `slow`,
`partition`, `corrupt` print one `Injection`; `heal` one list of what it undid. `monkey` and `run` print
JSON lines as they go: a `"record": "fault"` line per fault of the plan (injected or not), then
one `"record": "summary"` line (the monkey's counts; an experiment's verdict and its report).
No I/O and no clock here: the times come in as arguments.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from dldctl.chaos import corruption
from dldctl.chaos.plan import Experiment, Fault, Result

SCHEMA = "dldctl.chaos/1"


@dataclass(frozen=True)
class Injection:
    """One fault as it was injected: where it hit, and when it ends.

    `duration_s`: a kill's hold (the least time it stays down), else how long the fault lasts;
    `until`: when that ends (unix s): a killed target is restarted then at the earliest, a pause,
    slow, partition or corruption is undone then (by the supervisor, or by the learner itself)."""

    action: str
    target: str
    host: str
    pid: int
    t: float
    duration_s: float
    until: float
    detail: str
    signal: str | None = None  # kill
    factor: float | None = None  # slow; corrupt: scale's multiplier, bitflip's count
    fault_id: str | None = None  # pause, slow, partition, link, corrupt: its id in state.json's `faults`
    rate: str | None = None  # link: the cap
    mode: str | None = None  # corrupt: nan, scale, signflip, noise or bitflip

    def to_dict(self) -> dict[str, Any]:
        """Its fields; `mode` only for a corruption (the other actions' documents are as they were)."""
        out = asdict(self)
        if out["mode"] is None:
            del out["mode"]
        return out


def injected(run: str, injection: Injection) -> dict[str, Any]:
    """The document of `chaos kill|pause|slow|partition|corrupt --json`."""
    return {"schema": SCHEMA, "run": run, **injection.to_dict()}


def planned(fault: Fault) -> dict[str, Any]:
    """A fault of a monkey's schedule or an experiment's plan, not yet injected."""
    return {
        "at": fault.at,
        "action": fault.action,
        "target": fault.target,
        "duration_s": fault.duration,
        "signal": fault.signal if fault.action == "kill" else None,
        "factor": fault.factor if fault.action == "slow" or fault.mode in corruption.DEFAULT_FACTOR else None,
        "rate": fault.rate if fault.action == "link" else None,
        **({"mode": fault.mode} if fault.mode else {}),
    }


def fault_line(run: str, fault: Fault, injection: Injection | None, error: str | None, now: float) -> dict[str, Any]:
    """One JSON line of `monkey`/`run`: the injection's keys, plus `at` (seconds after the start),
    `injected` and `error` (why not); a fault that was not injected has nulls where it would have hit."""
    if injection is not None:
        body = injection.to_dict()
    else:
        body = {
            **dict.fromkeys(f.name for f in fields(Injection) if f.name != "mode"),  # planned() has a mode
            **{k: v for k, v in planned(fault).items() if k != "at"},
            "t": now,
        }
    head = {"schema": SCHEMA, "run": run, "record": "fault", "at": fault.at, "injected": injection is not None}
    return {**head, "error": error, **body}


def healed(entries: list[str]) -> list[dict[str, str]]:
    """`Chaos.heal`'s "pause learner-3" / "hold learner-2" as {"kind", "target"} objects."""
    return [dict(zip(("kind", "target"), entry.split(" ", 1), strict=True)) for entry in entries]


def heal(run: str, target: str | None, entries: list[str], now: float) -> dict[str, Any]:
    """The document of `chaos heal --json`: what was undone (an empty list: nothing to heal)."""
    return {"schema": SCHEMA, "run": run, "action": "heal", "target": target, "healed": healed(entries), "t": now}


def monkey_summary(
    run: str, schedule: list[Fault], options: dict[str, Any], injected_count: int, healed_entries: list[str] | None
) -> dict[str, Any]:
    """The monkey's last line: its options (`seed`, `mtbf_s`, `duration_s`, `dry_run`), the
    schedule, how many faults it injected; `interrupted` with what it healed then."""
    return {
        "schema": SCHEMA,
        "run": run,
        "record": "summary",
        "action": "monkey",
        **options,
        "planned": len(schedule),
        "injected": injected_count,
        "interrupted": healed_entries is not None,
        "healed": healed(healed_entries or []),
        "schedule": [planned(f) for f in schedule],
    }


def experiment_plan(exp: Experiment) -> dict[str, Any]:
    """What `chaos run --dry-run` prints as text: the duration, the faults and the checks."""
    return {
        "duration_s": exp.duration,
        "sample_every_s": exp.sample_every,
        "faults": [planned(f) for f in exp.faults],
        "steady": [c.text for c in exp.steady],
        "aborts": [c.text for c in exp.aborts],
        "heal_on_abort": exp.heal_on_abort,
    }


def experiment_summary(run: str | None, exp: Experiment, result: Result | None) -> dict[str, Any]:
    """An experiment's last line: its plan and, unless it was a dry run (`result` None), the
    verdict (`passed`, `reasons`, `aborted`), the per-fault report and the report files."""
    return {
        "schema": SCHEMA,
        "run": run,
        "record": "summary",
        "action": "run",
        "experiment": exp.name,
        "file": exp.path,
        "dry_run": result is None,
        "plan": experiment_plan(exp),
        "passed": None if result is None else result.passed,
        "reasons": [] if result is None else list(result.reasons),
        "aborted": None if result is None else result.aborted,
        "faults": [] if result is None else [r.to_dict() for r in result.faults],
        "files": [] if result is None else list(result.files),
    }
