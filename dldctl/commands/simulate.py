"""`dldctl simulate`: plan a fleet before buying it (goodput under failures, wide-area bandwidth).

A thin shell over the pure core in `dldctl/sim/`: parse flags (durations like "30m", counts like
"1.2M", sizes like "12B"), call the core, print a Rich table or JSON, draw the sweep plot. Every bad
value becomes one UsageError line naming the flag. The model and its defaults: docs/simulate.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from dldctl import extras
from dldctl.commands import simulate_calibrate, simulate_fromrun
from dldctl.commands import simulate_common as sc
from dldctl.commands.options import App
from dldctl.errors import OperationError, UsageError
from dldctl.sim import bandwidth as bw
from dldctl.sim import goodput as gp
from dldctl.sim.montecarlo import Summary, monte_carlo, sweep
from dldctl.units import (
    format_count,
    format_duration,
    parse_count,
    parse_count_list,
    parse_duration,
    parse_quantity,
    parse_sweep,
)

app = App(
    help="Plan at fleet scale: goodput under failures, and the wide-area bandwidth training needs.",
    no_args_is_help=True,
)

SCHEMA_GOODPUT = "dldctl.simulate.goodput/2"
SCHEMA_BANDWIDTH = "dldctl.simulate.bandwidth/1"
DEFAULT_LEARNERS = "8"
DEFAULT_SWEEP_LEARNERS = "1,2,4,8,16"
LINK_FLAGS = {
    "params": "--params",
    "step_time_s": "--step-time",
    "H": "--H",
    "fragments": "--fragments",
    "bits": "--bits",
    "compression": "--compression",
    "tau": "--tau",
    "sites": "--sites",
    "utilization": "--utilization",
    "dp_bits": "--dp-bits",
    "dp_overlap": "--dp-overlap",
}
_parse, _build, _stdout, _emit_json, _about = sc.parse, sc.build, sc.stdout, sc.emit_json, sc.about
LABELS, FLEET_FLAGS = sc.LABELS, sc.FLEET_FLAGS
app.command("calibrate")(simulate_calibrate.calibrate)


def _spread_cell(mean: float, p10: float, p90: float) -> str:
    """ "0.810  (0.807–0.813)": the mean, then the p10–p90 band dimmed."""
    return f"{mean:.3f}  [dim]({p10:.3f}–{p90:.3f})[/]"


def _row_label(s: Summary) -> str:
    """A table row's name: the strategy, and the learner count for DiLoCo."""
    return f"{LABELS[s.strategy]} M={s.learners}" if s.learners else LABELS[s.strategy]


def _single_table(fleet: gp.FleetParams, results: Sequence[Summary], seeds: int) -> Table:
    """One fleet: a row per strategy with goodput, uptime and failures."""
    every = fleet.mtbi_s / fleet.chips
    title = (
        f"{fleet.chips:,} chips, {fleet.learners} learners of ~{fleet.chips // fleet.learners:,}"
        f" chips: the fleet loses a chip every {_about(every)} on average "
        f"({format_duration(fleet.horizon_s)} simulated, {seeds} seeds; p10–p90 in brackets)"
    )
    table = Table(title=title, title_justify="left")
    for name in ("strategy", "goodput", "system uptime", "failures/run"):
        table.add_column(name, justify="left" if name == "strategy" else "right", no_wrap=True)
    for s in results:
        table.add_row(
            _row_label(s),
            _spread_cell(s.goodput.mean, s.goodput.p10, s.goodput.p90),
            _spread_cell(s.uptime.mean, s.uptime.p10, s.uptime.p90),
            f"{s.failures.mean:,.0f}",
        )
    return table


def _sweep_table(metric: str, results: Sequence[Summary], chips: Sequence[int], seeds: int) -> Table:
    """Strategies and learner counts as rows, chip counts as columns, one metric in the cells."""
    table = Table(title=f"{metric} (mean ± std over {seeds} seeds)", title_justify="left")
    table.add_column("strategy", no_wrap=True)
    for n in chips:
        table.add_column(f"{format_count(n)} chips", justify="right", no_wrap=True)
    rows: dict[str, dict[int, Summary]] = {}
    for s in results:
        rows.setdefault(_row_label(s), {})[s.chips] = s
    for label, cells in rows.items():
        spreads = [getattr(cells[n], metric.split()[-1]) for n in chips]
        table.add_row(label, *[f"{x.mean:.3f} [dim]±{x.std:.3f}[/]" for x in spreads])
    return table


def _write_plot(path: Path, results: Sequence[Summary], chips: Sequence[int]) -> None:
    """Goodput and uptime against chip count, one line per strategy row (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: dict[str, list[Summary]] = {}
    for s in results:
        rows.setdefault(_row_label(s), []).append(s)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharex=True)
    for ax, metric in zip(axes, ("goodput", "uptime")):
        for label, cells in rows.items():
            cells = sorted(cells, key=lambda s: s.chips)
            means = [getattr(s, metric).mean for s in cells]
            lo = [getattr(s, metric).p10 for s in cells]
            hi = [getattr(s, metric).p90 for s in cells]
            # Data-parallel lines dashed and on top: DiLoCo M=1 coincides with elastic.
            dp = cells[0].learners is None
            ax.plot(
                [s.chips for s in cells],
                means,
                "--" if dp else "-",
                marker="o",
                label=label,
                zorder=3 if dp else 2,
                linewidth=2.2 if dp else 1.5,
            )
            ax.fill_between([s.chips for s in cells], lo, hi, alpha=0.15)
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(list(chips), [format_count(n) for n in chips])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("chips")
        ax.set_title("goodput" if metric == "goodput" else "system uptime")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise OperationError(
            f"could not write the plot to {path}: {exc.strerror or exc}", hint="choose a writable --plot path"
        ) from exc
    finally:
        plt.close(fig)


def _sweep_lists(spec: str, learners: str | None) -> tuple[list[int], list[int]]:
    """Chip and learner lists of a sweep, checked against each other."""
    _, chips = _parse("--sweep", spec, parse_sweep)
    counts = _parse("--learners", learners or DEFAULT_SWEEP_LEARNERS, parse_count_list)
    if min(chips) < 1:
        raise UsageError(f"--sweep chip counts must be >= 1 (got {min(chips)})")
    if min(counts) < 1 or max(counts) > min(chips):
        raise UsageError(
            f"--learners must be between 1 and the smallest swept chip count "
            f"{min(chips):,} (got {','.join(map(str, counts))})"
        )
    return chips, counts


def _check_plot(plot: Path | None, sweeping: bool) -> None:
    """Refuse --plot before simulating when it cannot be honoured."""
    if plot is None:
        return
    if not sweeping:
        raise UsageError("--plot draws a sweep: add --sweep chips=... or drop --plot")
    parent = plot.expanduser().resolve().parent
    if not parent.is_dir():
        raise UsageError(f"--plot: directory {parent} does not exist (create it or pick another path)")
    extras.require("matplotlib", "--plot draws with")


@app.command()
def goodput(
    chips: str | None = typer.Option(None, "--chips", help="Chips in the fleet (N): 150000, 150k, 1.2M."),
    learners: str | None = typer.Option(
        None,
        "--learners",
        help="DiLoCo learners (M) of N/M chips; a list with --sweep. "
        f"Default {DEFAULT_LEARNERS}, or {DEFAULT_SWEEP_LEARNERS} with --sweep.",
    ),
    mtbi_years: float = typer.Option(1.0, "--mtbi-years", help="Mean time between interruptions per chip, years."),
    step_time: str = typer.Option("6s", "--step-time", help="Time of one training step."),
    step_jitter: float = typer.Option(
        0.0, "--step-jitter", help="Coefficient of variation of one replica's step time (stragglers)."
    ),
    recovery: str = typer.Option("30m", "--recovery", help="Failure until the failed replica is back in service."),
    reconfig: str = typer.Option(
        f"{gp.CALIBRATED_RECONFIG_S:g}s", "--reconfig", help="Elastic job: the pause that drops failed replicas."
    ),
    learner_reconfig: str = typer.Option(
        f"{gp.CALIBRATED_LEARNER_RECONFIG_S:g}s", "--learner-reconfig", help="Decoupled DiLoCo: one learner's pause."
    ),
    restart: str = typer.Option(
        f"{gp.CALIBRATED_RESTART_S:g}s", "--restart", help="Non-elastic job: restart from the last checkpoint."
    ),
    checkpoint_every: str = typer.Option(
        "auto", "--checkpoint-every", help="Non-elastic job's checkpoint interval; auto: Young/Daly for its failures."
    ),
    checkpoint_cost: str = typer.Option("1s", "--checkpoint-cost", help="Time one checkpoint blocks the job."),
    rate_cv: float = typer.Option(
        1.0, "--rate-cv", help="Burstiness: variation of the failure rate between periods (0: constant)."
    ),
    rate_period: str = typer.Option("1h", "--rate-period", help="How long one failure rate holds."),
    failure_domain: str = typer.Option(
        "128", "--failure-domain", help="Chips one failure takes out: its model-parallel replica."
    ),
    quorum: int = typer.Option(1, "--quorum", help="DiLoCo minimum quorum K: learners needed for global progress."),
    hours: float = typer.Option(24.0, "--hours", help="Simulated wall time, hours."),
    seeds: int = typer.Option(10, "--seeds", help="Monte Carlo runs (seeds SEED .. SEED+N-1)."),
    seed: int = typer.Option(0, "--seed", help="First seed."),
    sweep_spec: str | None = typer.Option(None, "--sweep", help="Sweep chip counts: chips=150000,300000,..."),
    plot: Path | None = typer.Option(None, "--plot", help="With --sweep: write a PNG of goodput and uptime."),
    from_run: str | None = typer.Option(
        None, "--from-run", help="Plan from this run's own measurements (a run name or directory)."
    ),
    mtbf: str | None = typer.Option(
        None, "--mtbf", help="With --from-run: the fleet's mean time between faults (default: the run's)."
    ),
    duration: str | None = typer.Option(
        None, "--duration", help="With --from-run: simulated wall time (default: the run's window)."
    ),
    per_host: int | None = typer.Option(
        None, "--per-host", help="With --from-run: learners per host, one warm spare each (default: the run's)."
    ),
    monkey_seed: int | None = typer.Option(
        None, "--monkey-seed", help="With --from-run: the faults `dldctl chaos monkey --seed` would inject."
    ),
    actions: str | None = typer.Option(
        None, "--actions", help="With --monkey-seed: the monkey's --actions (default: the kinds the run saw)."
    ),
    as_json: bool = typer.Option(False, "--json", help=f"Print JSON (schema in {sc.SIM_DOC})."),
) -> None:
    """Goodput and uptime of data-parallel, elastic data-parallel and Decoupled DiLoCo at scale.

    Example: dldctl simulate goodput --chips 1.2M --learners 8 --seeds 20

    Example: dldctl simulate goodput --from-run pilot --learners 64 --mtbf 10m

    Example: dldctl simulate goodput --sweep chips=150000,300000,600000,1200000,2400000 --learners 1,2,4,8,16
    --plot sweep.png
    """
    if seeds < 1:
        raise UsageError(f"--seeds must be >= 1 (got {seeds})")
    if from_run is not None:
        if chips is not None or sweep_spec is not None:
            raise UsageError("--from-run plans the run's own fleet: drop --chips and --sweep")
        ask = simulate_fromrun.Ask(learners, mtbf, duration, per_host, monkey_seed, actions)
        simulate_fromrun.goodput(from_run, ask, list(range(seed, seed + seeds)), as_json)
        return
    if any(x is not None for x in (mtbf, duration, per_host, monkey_seed, actions)):
        raise UsageError("--mtbf, --duration, --per-host, --monkey-seed and --actions go with --from-run")
    if sweep_spec is not None and chips is not None:
        raise UsageError("--chips and --sweep chips=... both set the fleet size: keep one")
    if sweep_spec is None and chips is None:
        raise UsageError("--chips is required (e.g. --chips 1.2M), or sweep with --sweep chips=...")
    _check_plot(plot, sweep_spec is not None)
    base = dict(
        mtbi_s=mtbi_years * gp.YEAR_S,
        step_time_s=_parse("--step-time", step_time, parse_duration),
        step_jitter=step_jitter,
        recovery_s=_parse("--recovery", recovery, parse_duration),
        reconfig_s=_parse("--reconfig", reconfig, parse_duration),
        learner_reconfig_s=_parse("--learner-reconfig", learner_reconfig, parse_duration),
        restart_s=_parse("--restart", restart, parse_duration),
        checkpoint_every_s=sc.parse_interval("--checkpoint-every", checkpoint_every),
        checkpoint_cost_s=_parse("--checkpoint-cost", checkpoint_cost, parse_duration),
        rate_cv=rate_cv,
        rate_period_s=_parse("--rate-period", rate_period, parse_duration),
        failure_domain=_parse("--failure-domain", failure_domain, parse_count),
        quorum=quorum,
        horizon_s=hours * 3600.0,
    )
    seed_list = list(range(seed, seed + seeds))
    if sweep_spec is not None:
        _goodput_sweep(sweep_spec, learners, base, seed_list, plot, as_json)
    elif chips is not None:  # always: without --sweep, a missing --chips was refused above
        _goodput_single(chips, learners, base, seed_list, as_json)


def _goodput_single(chips: str, learners: str | None, base: dict[str, Any], seeds: list[int], as_json: bool) -> None:
    n = _parse("--chips", chips, parse_count)
    m = _parse("--learners", learners or DEFAULT_LEARNERS, parse_count)
    fleet = _build(gp.FleetParams, FLEET_FLAGS, chips=n, learners=m, **base)
    results = monte_carlo(fleet, seeds)
    if as_json:
        _emit_json(
            {
                "schema": SCHEMA_GOODPUT,
                "mode": "single",
                "params": {**asdict(fleet), "seeds": seeds},
                "checkpoint_interval_s": {str(n): fleet.checkpoint_interval_s()},
                "assumptions": sc.assumptions([fleet]),
                "results": [s.to_dict() for s in results],
            }
        )
        return
    out = _stdout()
    out.print(_single_table(fleet, results, len(seeds)))
    _print_assumptions(out, [fleet])


def _goodput_sweep(
    spec: str, learners: str | None, base: dict[str, Any], seeds: list[int], plot: Path | None, as_json: bool
) -> None:
    chips, counts = _sweep_lists(spec, learners)
    if base["quorum"] > min(counts):
        raise UsageError(
            f"--quorum {base['quorum']} exceeds the smallest learner count {min(counts)}: "
            "lower --quorum or drop the small learner counts"
        )
    # Validate once at the largest fleet (which also bounds the failures per run).
    fleet = _build(gp.FleetParams, FLEET_FLAGS, chips=max(chips), learners=max(counts), **base)
    results = sweep(fleet, chips, counts, seeds)
    fleets = [replace(fleet, chips=n, learners=1, quorum=1) for n in chips]
    if plot is not None:
        _write_plot(plot, results, chips)
    if as_json:
        params = {**asdict(fleet), "chips": chips, "learners": counts, "seeds": seeds}
        _emit_json(
            {
                "schema": SCHEMA_GOODPUT,
                "mode": "sweep",
                "params": params,
                "checkpoint_interval_s": {str(f.chips): f.checkpoint_interval_s() for f in fleets},
                "assumptions": sc.assumptions(fleets),
                "plot": str(plot) if plot else None,
                "results": [s.to_dict() for s in results],
            }
        )
        return
    out = _stdout()
    out.print(_sweep_table("goodput", results, chips, len(seeds)))
    out.print(_sweep_table("system uptime", results, chips, len(seeds)))
    _print_assumptions(out, fleets)
    if plot is not None:
        out.print(f"plot written to {plot}")


def _print_assumptions(out: Any, fleets: list[gp.FleetParams]) -> None:
    """The model and constants under the table, dimmed (docs/simulate.md states each rule)."""
    out.print(f"[dim]model ({escape(sc.SIM_DOC)}):[/]")
    for line in sc.assumptions(fleets):
        out.print(f"[dim]  - {line}[/]", soft_wrap=True)


def _link_table(report: bw.LinkReport) -> Table:
    """Both strategies' transfer, average and needed link, and utilization on --link-gbps."""
    p = report.params
    u = p.utilization
    title = (
        f"{format_count(p.params)} parameters, {format_duration(p.step_time_s)} per step, "
        f"{p.sites} sites; each site's link, each way"
    )
    table = Table(title=title, title_justify="left")
    columns = ["strategy", "per transfer", "every", "hidden by compute", "average", f"needed for {u:.0%} busy"]
    if report.link_gbps is not None:
        columns.append(f"busy on {report.link_gbps:g} Gbit/s")
    for name in columns:
        table.add_column(name, justify="left" if name == "strategy" else "right", no_wrap=True)
    for t in (report.data_parallel, report.diloco):
        need = t.required_gbps(u)
        row = [
            LABELS[t.strategy],
            _bytes(t.bits / 8),
            format_duration(round(t.period_s, 3)),
            format_duration(round(t.hidden_s, 3)),
            _gbps(t.average_gbps),
            _gbps(need) if math.isfinite(need) else "unreachable",
        ]
        if report.link_gbps is not None:
            row.append(f"{t.utilization_at(report.link_gbps):.1%}")
        table.add_row(*row)
    return table


def _bytes(n: float) -> str:
    """Decimal bytes: 133 MB, 1.59 GB."""
    for div, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.0f} B"


def _gbps(x: float) -> str:
    """A rate in Gbit/s, or Mbit/s below 0.1 Gbit/s."""
    return f"{x:.3g} Gbit/s" if x >= 0.1 else f"{x * 1000:.3g} Mbit/s"


@app.command()
def bandwidth(
    params: str | None = typer.Option(None, "--params", help="Model parameters: 1B, 12B, 100B, 7e9."),
    step_time: str | None = typer.Option(None, "--step-time", help="Compute time of one step: 1.5, 2s, 800ms."),
    H: int = typer.Option(64, "--H", help="Inner steps between two syncs of one fragment."),
    fragments: int = typer.Option(4, "--fragments", help="Fragments (P); one leaves every H/P steps."),
    bits: int = typer.Option(4, "--bits", help="DiLoCo outer-gradient precision: 4, 8, 16 or 32."),
    compression: str = typer.Option("", "--compression", help="A codec in place of --bits: int4 ... 2bit, topk."),
    tau: int = typer.Option(2, "--tau", help="Steps a learner trains on before it needs the reply."),
    sites: int = typer.Option(4, "--sites", help="Data centres: data-parallel ring members, one DiLoCo learner each."),
    utilization: float = typer.Option(0.95, "--utilization", help="Target share of time computing, 0..1."),
    dp_bits: int = typer.Option(16, "--dp-bits", help="Data-parallel gradient precision: 8, 16 or 32."),
    dp_overlap: float = typer.Option(
        2 / 3,
        "--dp-overlap",
        show_default="2/3",
        help="Share of a step the all-reduce hides behind (the backward pass).",
    ),
    link_gbps: float | None = typer.Option(None, "--link-gbps", help="Also: utilization each reaches on this link."),
    from_run: str | None = typer.Option(
        None, "--from-run", help="Predict this run's fleet on other links from its measured bytes and steps."
    ),
    links: str | None = typer.Option(None, "--link", help="With --from-run: rates per site, e.g. 10mbit,1mbit."),
    syncer_link: str | None = typer.Option(
        None, "--syncer-link", help="With --from-run: the syncer's egress cap (a rate; same: the sites' rate)."
    ),
    target_loss: float | None = typer.Option(
        None, "--target-loss", help="With --from-run: also predict the time to this global eval loss."
    ),
    as_json: bool = typer.Option(False, "--json", help=f"Print JSON (schema in {sc.SIM_DOC})."),
) -> None:
    """Link bandwidth data-parallel needs versus Decoupled DiLoCo, and utilization on a given link.

    Example: dldctl simulate bandwidth --params 12B --step-time 1s --H 64 --fragments 4 --bits 4 --link-gbps 10

    Example: dldctl simulate bandwidth --from-run pilot --link 10mbit,1mbit --target-loss 2.3
    """
    if from_run is not None:
        simulate_fromrun.bandwidth(from_run, links, syncer_link, target_loss, as_json)
        return
    if links is not None or syncer_link is not None or target_loss is not None:
        raise UsageError("--link, --syncer-link and --target-loss go with --from-run; without it use --link-gbps")
    if params is None or step_time is None:
        raise UsageError("--params and --step-time are required (e.g. --params 12B --step-time 1s)")
    values = dict(
        params=_parse("--params", params, parse_quantity),
        step_time_s=_parse("--step-time", step_time, parse_duration),
        H=H,
        fragments=fragments,
        bits=bits,
        compression=compression,
        tau=tau,
        sites=sites,
        utilization=utilization,
        dp_bits=dp_bits,
        dp_overlap=dp_overlap,
    )
    link = _build(bw.LinkParams, LINK_FLAGS, **values)
    if link_gbps is not None and not link_gbps > 0:
        raise UsageError(f"--link-gbps must be > 0 (got {link_gbps})")
    report = bw.link_report(link, link_gbps)
    if as_json:
        _emit_json({"schema": SCHEMA_BANDWIDTH, **report.to_dict()})
        return
    out = _stdout()
    out.print(_link_table(report))
    out.print(_link_summary(report))


def _link_summary(report: bw.LinkReport) -> str:
    """The one-line conclusion under the bandwidth table."""
    p = report.params
    ingress = f"the syncer takes in {_gbps(report.syncer_ingress_gbps)} on average from {p.sites} learners."
    if not math.isfinite(report.diloco.required_gbps(p.utilization)):
        return (
            f"Decoupled DiLoCo cannot reach {p.utilization:.0%} busy with --tau 0: raise --tau "
            f"or lower --utilization; {ingress}"
        )
    if not math.isfinite(report.reduction):
        return f"Data-parallel cannot reach {p.utilization:.0%} busy at any link speed (nothing overlaps); {ingress}"
    return (
        f"Decoupled DiLoCo needs {report.reduction:,.0f}x less link than data-parallel at "
        f"{p.utilization:.0%} busy; {ingress}"
    )
