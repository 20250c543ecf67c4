"""CLI: `dldctl chaos ...` — break a live run on purpose, safely and reproducibly.

`--json`: `kill`, `pause`, `slow`, `partition`, `corrupt` and `heal` print one object; `monkey` and `run`
print JSON lines, one per fault as it happens, then a summary (shapes: dldctl/chaos/records.py,
docs/chaos.md). Progress goes to stderr then. The quorum guard asks only on a terminal.
"""

from __future__ import annotations

import random
import sys
import time

# stdlib since 3.11; mypy checks as 3.10 (pyproject's python_version), which has none
import tomllib
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from dldctl import rundir, shards
from dldctl.chaos import corruption, records, runner, verdict
from dldctl.chaos.inject import Chaos, Confirm
from dldctl.chaos.plan import ACTIONS, Experiment, PlanError, monkey_schedule, parse_experiment, seconds
from dldctl.chaos.records import Injection
from dldctl.commands import complete
from dldctl.commands.options import App, LiveRunOpt, output_console
from dldctl.errors import ChaosError, ConfigError, OperationError, UsageError
from dldctl.faults.linkcap import LinkCapError
from syncer.common import strictjson

app = App(
    help="Break a live run on purpose: kill, pause, slow, partition, corrupt, a monkey, experiments.",
    no_args_is_help=True,
)
console = output_console()
err_console = output_console(stderr=True)  # what a human reads while stdout carries JSON
ForceOpt = typer.Option(False, "--force", help="Do it even if it leaves fewer live learners than the quorum.")
JsonOpt = typer.Option(False, "--json", help="Print what was done as one JSON object (messages go to stderr).")
EXAMPLE = resources.files("dldctl") / "examples" / "chaos-experiment.toml"  # package data: in the wheel
LinesOpt = typer.Option(
    False, "--json", help="Print JSON lines: one per fault as it happens, then a summary (messages go to stderr)."
)


def _chaos(run: str | None) -> Chaos:
    return Chaos(rundir.resolve(run))


def _confirm(question: str) -> bool:
    return typer.confirm(question, default=False, err=True)  # on stderr: stdout may carry JSON


def _confirmer() -> Confirm | None:
    """Ask on a terminal only; without one (a script, a pipe, CI) the guard refuses, naming --force."""
    return _confirm if sys.stdin.isatty() else None


def _out(json_out: bool) -> Console:
    return err_console if json_out else console


def _emit(record: dict[str, Any]) -> None:
    """One JSON document (or JSON line) on stdout, at once: a script reads it as it happens."""
    print(strictjson.dumps(record), flush=True)


@app.command()
def kill(
    target: str = typer.Argument(
        ..., help="learner-N, or syncer / syncer-N (a shard of a sharded syncer)", autocompletion=complete.proc_targets
    ),
    signal: str = typer.Option("KILL", "--signal", metavar="KILL|TERM", help="The signal to send."),
    down_for: str | None = typer.Option(
        None,
        "--down-for",
        help="How long until the supervisor brings it back, e.g. 30s or 2m (default: its restart delay).",
    ),
    force: bool = ForceOpt,
    run: str | None = LiveRunOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Signal a learner's (or a syncer shard's) process group; the supervisor restarts it.

    Example: dldctl chaos kill learner-2 --down-for 30s
    """
    if signal.upper() not in ("KILL", "TERM"):
        raise UsageError(f"--signal {signal!r}: use KILL or TERM")
    hold = None if down_for is None else _seconds("--down-for", down_for)
    _inject(run, "kill", target, force, json_out, lambda chaos: chaos.kill(target, signal, hold), "killed")


def _inject(
    run: str | None,
    action: str,
    target: str,
    force: bool,
    json_out: bool,
    do: Callable[[Chaos], Injection],
    said: str,
    undone: bool = False,
) -> None:
    """The quorum guard, then `do`, then what was done: its JSON or one line (`said TARGET: ...`)."""
    chaos = _chaos(run)
    try:
        chaos.guard(action, target, force, _confirmer())
        done = do(chaos)
    finally:
        chaos.close()
    if json_out:
        _emit(records.injected(chaos.run.name, done))
    else:
        later = " (undone automatically; `dldctl chaos heal` ends it now)" if undone else ""
        console.print(f"[red]{said} {target}[/]: {done.detail}{later}")


@app.command()
def preempt(
    target: str = typer.Argument(
        ..., help="learner-N (a learner that runs as a scheduler's job)", autocompletion=complete.learner_ids
    ),
    down_for: str | None = typer.Option(
        None, "--down-for", help="How long until the supervisor submits its replacement (default: its restart delay)."
    ),
    force: bool = ForceOpt,
    run: str | None = LiveRunOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Cancel a learner's Slurm job as a preemption would; the supervisor submits a new one.

    Example: dldctl chaos preempt learner-3
    """
    hold = None if down_for is None else _seconds("--down-for", down_for)
    _inject(run, "preempt", target, force, json_out, lambda chaos: chaos.preempt(target, hold), "preempted")


def _seconds(flag: str, text: str, positive: bool = False) -> float:
    """A duration flag ("30", "30s", "5m", "800ms") in seconds, or a one-line usage error naming it."""
    try:
        value = seconds(text, flag)
    except PlanError as exc:
        raise UsageError(str(exc)) from None
    if positive and value <= 0:
        raise UsageError(f"{flag}: must be longer than 0 s, got {text!r}")
    return value


def _timed(
    action: str, target: str, duration: str, factor: float, force: bool, run: str | None, json_out: bool
) -> None:
    span = _seconds("--duration", duration, positive=True)
    if action == "slow" and factor <= 1.0:
        raise UsageError(f"--factor: must be > 1 (how many times slower), got {factor:g}")
    _inject(run, action, target, force, json_out, lambda chaos: chaos.fault(action, target, span, factor), action, True)


@app.command()
def pause(
    target: str = typer.Argument(..., help="learner-N", autocompletion=complete.learner_ids),
    duration: str = typer.Option(..., "--duration", help="How long, e.g. 20s or 2m."),
    force: bool = ForceOpt,
    run: str | None = LiveRunOpt,
    json_out: bool = JsonOpt,
) -> None:
    """SIGSTOP a learner (a hung straggler), SIGCONT after --duration.

    Example: dldctl chaos pause learner-1 --duration 20s
    """
    _timed("pause", target, duration, 1.0, force, run, json_out)


@app.command()
def slow(
    target: str = typer.Argument(..., help="learner-N", autocompletion=complete.learner_ids),
    factor: float = typer.Option(..., "--factor", help="How many times slower."),
    duration: str = typer.Option(..., "--duration", help="How long, e.g. 20s or 2m."),
    run: str | None = LiveRunOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Make a learner run F times slower for a while.

    Example: dldctl chaos slow learner-3 --factor 4 --duration 1m
    """
    _timed("slow", target, duration, factor, True, run, json_out)


@app.command()
def partition(
    target: str = typer.Argument(..., help="learner-N", autocompletion=complete.learner_ids),
    duration: str = typer.Option(..., "--duration", help="How long, e.g. 20s or 2m."),
    force: bool = ForceOpt,
    run: str | None = LiveRunOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Cut a learner off from the syncer both ways; it keeps training and reconnects after.

    Example: dldctl chaos partition learner-0 --duration 30s
    """
    _timed("partition", target, duration, 1.0, force, run, json_out)


@app.command()
def corrupt(
    target: str = typer.Argument(..., help="learner-N", autocompletion=complete.learner_ids),
    mode: str = typer.Option(
        ..., "--mode", metavar="|".join(corruption.MODES), help="How it goes bad (docs/chaos.md)."
    ),
    factor: float | None = typer.Option(
        None,
        "--factor",
        help="scale: the weights' multiplier (default 1e6); bitflip: values flipped per push (default 4).",
    ),
    duration: str = typer.Option(..., "--duration", help="How long, e.g. 20s or 2m."),
    run: str | None = LiveRunOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Make a learner go bad while it keeps running: NaN or scaled weights, or corrupted pushes.

    nan and scale damage its weights; signflip, noise and bitflip only what it pushes (silent data
    corruption). For testing the syncer's defences; the learner stays in the quorum.

    Example: dldctl chaos corrupt learner-1 --mode signflip --duration 30s
    """
    span = _seconds("--duration", duration, positive=True)
    used = corruption.checked(mode, factor)  # refused before any run is looked for
    _inject(
        run,
        "corrupt",
        target,
        True,
        json_out,
        lambda chaos: chaos.fault("corrupt", target, span, used, mode),
        "corrupt",
        True,
    )


@app.command()
def link(
    target: str = typer.Argument(..., help="learner-N", autocompletion=complete.learner_ids),
    rate: str = typer.Option(..., "--rate", help="The cap, in tc's units: 1mbit, 500kbit, 1gbit."),
    duration: str = typer.Option(..., "--duration", help="How long, e.g. 60s or 5m."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Check both hosts and print the tc commands; change nothing."
    ),
    force: bool = ForceOpt,
    run: str | None = LiveRunOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Cap the bandwidth between a learner and the syncer (tc, both ways), then restore it.

    Needs root and tc on the learner's host and on the syncer's. Only that learner's traffic to and
    from the syncer is touched.

    Example: dldctl chaos link learner-2 --rate 1mbit --duration 60s
    """
    span = _seconds("--duration", duration, positive=True)
    if dry_run:
        chaos = _chaos(run)
        try:
            _link_dry_run(chaos, [target], rate)
        finally:
            chaos.close()
        return
    _inject(run, "link", target, force, json_out, lambda chaos: chaos.link(target, rate, span), "link", True)


def _link_dry_run(chaos: Chaos, targets: list[str], rate: str) -> None:
    """Each target's tc commands, or the refusal naming the host and why (exit 1 if any)."""
    refused = []
    for target in targets:
        try:
            for line in chaos.link_plan(target, rate):
                err_console.print(f"would run on {escape(line)}", highlight=False)
        except (LinkCapError, ChaosError) as exc:
            refused.append(f"{target}: {exc}")
    if refused:
        raise ChaosError(f"cannot cap the link of {'; '.join(refused)}")


@app.command()
def heal(
    target: str | None = typer.Argument(
        None, help="Only this learner (default: with --all, everything).", autocompletion=complete.learner_ids
    ),
    all_: bool = typer.Option(False, "--all", help="Undo every active fault and kill hold."),
    run: str | None = LiveRunOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Undo active faults now (idempotent).

    Example: dldctl chaos heal --all
    """
    if not all_ and target is None:
        raise UsageError("name a learner to heal, or pass --all")
    chaos = _chaos(run)
    try:
        done = chaos.heal(None if all_ else target)
    finally:
        chaos.close()
    if json_out:
        _emit(records.heal(chaos.run.name, None if all_ else target, done, time.time()))
    else:
        console.print(f"healed: {', '.join(done)}" if done else "nothing to heal")


def _targets(chaos: Chaos, targets: str | None) -> list[str]:
    """The monkey's targets: every live learner by default; named, learners and syncer shards
    (`syncer`, `syncer-N`: killed only), each as its process is named."""
    state = chaos.run.read_state()
    learners = sorted(state.learners(live=True))
    if not targets:
        return learners
    chosen = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in learners and shards.shard_of(t) is None]
    if unknown:
        hint = f"learners: {', '.join(learners)}; syncer targets: {shards.valid_targets(chaos.shards)}"
        raise UsageError(f"--targets: unknown {unknown[0]!r}", hint=hint)
    return [chaos.canonical(t) for t in chosen]


@app.command()
def monkey(
    mtbf: str = typer.Option(..., "--mtbf", help="Mean time between faults (exponential gaps), e.g. 30s."),
    duration: str = typer.Option(..., "--duration", help="How long to run, e.g. 10m."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same schedule."),
    targets: str | None = typer.Option(
        None, "--targets", help="Comma-separated learners and syncer shards (syncer, syncer-N) (default: all learners)."
    ),
    actions: str = typer.Option("kill", "--actions", help=f"Comma-separated, from {','.join(ACTIONS)}."),
    fault_duration: str = typer.Option(
        "10s", "--fault-duration", help="How long a pause/slow/partition/link/corrupt lasts (corrupt: a random mode)."
    ),
    link_rate: str = typer.Option("1mbit", "--link-rate", help="The cap of a link fault, e.g. 1mbit."),
    down_for: str = typer.Option("0", "--down-for", help="How long a killed learner stays down (0: restart delay)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the schedule, inject nothing."),
    force: bool = ForceOpt,
    run: str | None = LiveRunOpt,
    json_out: bool = LinesOpt,
) -> None:
    """A chaos monkey: Poisson-distributed faults, reproducible with --seed.

    Example: dldctl chaos monkey --mtbf 30s --duration 10m --seed 7 --actions kill,pause
    """
    mtbf_s, duration_s = _seconds("--mtbf", mtbf, positive=True), _seconds("--duration", duration)
    fault_s, down_s = _seconds("--fault-duration", fault_duration, positive=True), _seconds("--down-for", down_for)
    out = _out(json_out)
    chaos = _chaos(run)
    try:
        try:
            schedule = monkey_schedule(
                random.Random(seed),
                mtbf_s=mtbf_s,
                duration_s=duration_s,
                targets=_targets(chaos, targets),
                actions=[a.strip() for a in actions.split(",")],
                fault_s=fault_s,
                down_for_s=down_s,
                link_rate=link_rate,
            )
        except PlanError as exc:
            raise UsageError(str(exc)) from None
        out.print(f"monkey: {len(schedule)} faults over {duration_s:g} s (seed {seed})")
        options = {"seed": seed, "mtbf_s": mtbf_s, "duration_s": duration_s, "dry_run": dry_run}
        if dry_run:
            for fault in schedule:
                out.print(fault.describe())
            if any(f.action == "link" for f in schedule):
                _link_dry_run(chaos, sorted({f.target for f in schedule if f.action == "link"}), link_rate)
            outcome = runner.MonkeyOutcome()
        else:
            outcome = runner.monkey(chaos, schedule, out, force=force, emit=_emit if json_out else runner.drop)
    finally:
        chaos.close()
    if json_out:
        _emit(records.monkey_summary(chaos.run.name, schedule, options, outcome.injected, outcome.healed))
    elif not dry_run:
        console.print(f"monkey done: {outcome.injected} of {len(schedule)} faults injected")


def _experiment(path: Path) -> Experiment:
    try:
        return parse_experiment(tomllib.loads(path.read_text()), str(path))
    except FileNotFoundError:
        raise ConfigError(str(path), None, "no such file") from None
    except (tomllib.TOMLDecodeError, PlanError, KeyError, ValueError, TypeError) as exc:
        raise ConfigError(str(path), None, str(exc)) from None


@app.command("example")
def example() -> None:
    """Print an example experiment (kill, pause, partition; steady-state checks), to edit and run.

    Example: dldctl chaos example > experiment.toml
    """
    sys.stdout.write(EXAMPLE.read_text())


@app.command("run")
def run_experiment(
    experiment: Path = typer.Argument(..., help="Experiment TOML (`dldctl chaos example` prints a complete one)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan, inject nothing."),
    run: str | None = LiveRunOpt,
    json_out: bool = LinesOpt,
) -> None:
    """Run a declarative chaos experiment; ends with a verdict (exit 1 on fail) and a report.

    Example: dldctl chaos example > experiment.toml && dldctl chaos run experiment.toml
    """
    exp, out = _experiment(experiment), _out(json_out)
    out.print(f"experiment {exp.name}: {exp.duration:g} s, {len(exp.faults)} faults")
    for fault in exp.faults:
        out.print(f"  {fault.describe()}")
    for check in exp.steady:
        out.print(f"  steady state: {check.text}")
    for check in exp.aborts:
        out.print(f"  abort if: {check.text}")
    if dry_run:
        if json_out:
            _emit(records.experiment_summary(None, exp, None))
        linked = [f for f in exp.faults if f.action == "link"]
        if linked and (run is not None or any(r.live() for r in rundir.all_runs())):  # hosts to check
            chaos = _chaos(run)
            try:
                for fault in linked:
                    _link_dry_run(chaos, [fault.target], fault.rate)
            finally:
                chaos.close()
        return
    chaos = _chaos(run)
    try:
        result = runner.run_experiment(chaos, chaos.run, exp, out, emit=_emit if json_out else runner.drop)
    finally:
        chaos.close()
    if json_out:  # a failed verdict too: its summary, then the error line and exit 1
        _emit(records.experiment_summary(chaos.run.name, exp, result))
    else:
        console.print(verdict.markdown(exp, result))
    if not result.passed:
        raise OperationError(f"experiment {exp.name} failed: {'; '.join(result.reasons)}")
